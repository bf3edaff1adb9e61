"""Original HDF5 and native safetensors: round trips, parameter counts, and every bad input."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from elmokit import (ConfigError, ElmoConfig, WeightFileError, batch_to_ids, load_original, load_pretrained,
                     save_original, save_pretrained)
from elmokit.weights import expected_datasets
from tests.conftest import SENTENCES


def _datasets(path):
    out = {}
    with h5py.File(path) as file:
        file.visititems(lambda n, o: out.__setitem__(n, o[...]) if isinstance(o, h5py.Dataset) else None)
    return out


@pytest.mark.parametrize("name, expected", [("small", 13_593_296), ("original", 93_600_848)])
def test_released_shapes_have_the_published_parameter_counts(name, expected):
    shapes = expected_datasets(ElmoConfig.from_name(name))
    assert sum(int(np.prod(shape)) for shape in shapes.values()) == expected


def test_original_file_round_trips_bit_for_bit(fixture_dir, tmp_path):
    model = load_original(fixture_dir / "options.json", fixture_dir / "lm_weights.hdf5")
    save_original(model, tmp_path / "options.json", tmp_path / "weights.hdf5")
    before, after = _datasets(fixture_dir / "lm_weights.hdf5"), _datasets(tmp_path / "weights.hdf5")
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype == np.float32
        assert np.array_equal(before[name], after[name]), name
    assert ElmoConfig.from_options(json.loads((tmp_path / "options.json").read_text())) == model.config


def test_native_round_trip_gives_identical_outputs(tiny_model, tmp_path):
    save_pretrained(tiny_model, tmp_path / "model")
    loaded = load_pretrained(tmp_path / "model")
    assert loaded.config == tiny_model.config
    with torch.no_grad():
        for a, b in zip(tiny_model(batch_to_ids(SENTENCES)).layers, loaded(batch_to_ids(SENTENCES)).layers):
            assert torch.equal(a, b)


def test_config_json_round_trip(tmp_path):
    for name in ("small", "medium", "original"):
        config = ElmoConfig.from_name(name)
        config.save(tmp_path / "config.json")
        assert ElmoConfig.load(tmp_path / "config.json") == config
        assert ElmoConfig.from_options(config.to_options()) == config


@pytest.mark.parametrize("changes, message", [
    ({"lstm": {"cell_dim": 0}}, "cell_dim"),
    ({"char_cnn": {"activation": "gelu"}}, "activation"),
    ({"char_cnn": {"filters": [[0, 4]]}}, "width"),
    ({"lstm": {"cell_clip": -1}}, "cell_clip"),
])
def test_config_validation(changes, message):
    data = ElmoConfig.from_name("small").to_dict()
    for section, values in changes.items():
        data[section].update(values)
    with pytest.raises(ConfigError, match=message):
        ElmoConfig.from_dict(data)


@pytest.fixture
def original_pair(tiny_model, tmp_path):
    save_original(tiny_model, tmp_path / "options.json", tmp_path / "weights.hdf5")
    return tmp_path / "options.json", tmp_path / "weights.hdf5"


def _rewrite(path, edit):
    data = _datasets(path)
    edit(data)
    path.unlink()
    with h5py.File(path, "w") as file:
        for name, value in data.items():
            file.create_dataset(name, data=value)


def test_missing_weight_file(original_pair, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.hdf5"):
        load_original(original_pair[0], tmp_path / "nope.hdf5")


def test_truncated_and_non_hdf5_files(original_pair, tmp_path):
    options, weights = original_pair
    truncated = tmp_path / "truncated.hdf5"
    truncated.write_bytes(weights.read_bytes()[:2000])
    with pytest.raises(WeightFileError, match="truncated.hdf5"):
        load_original(options, truncated)
    text = tmp_path / "text.hdf5"
    text.write_text("not hdf5")
    with pytest.raises(WeightFileError, match="text.hdf5.*not a readable HDF5"):
        load_original(options, text)


def test_missing_and_extra_datasets(original_pair):
    options, weights = original_pair
    _rewrite(weights, lambda d: d.pop("CNN_proj/b_proj"))
    with pytest.raises(WeightFileError, match=r"missing \['CNN_proj/b_proj'\]"):
        load_original(options, weights)
    _rewrite(weights, lambda d: d.update({"CNN_proj/b_proj": np.zeros(6, np.float32), "softmax/W": np.zeros(3)}))
    with pytest.raises(WeightFileError, match=r"unexpected \['softmax/W'\]"):
        load_original(options, weights)


def test_wrong_shape_names_dataset_and_shapes(original_pair):
    options, weights = original_pair
    _rewrite(weights, lambda d: d.update({"CNN_proj/W_proj": np.zeros((20, 7), np.float32)}))
    with pytest.raises(WeightFileError, match=r"'CNN_proj/W_proj' has shape \(20, 7\).*imply \(20, 6\)"):
        load_original(options, weights)


def test_options_that_contradict_the_weights(original_pair):
    options, weights = original_pair
    data = json.loads(options.read_text())
    data["lstm"]["projection_dim"] = 8
    options.write_text(json.dumps(data))
    with pytest.raises(WeightFileError, match="options.json"):
        load_original(options, weights)


def test_unknown_activation(original_pair):
    options, weights = original_pair
    data = json.loads(options.read_text())
    data["char_cnn"]["activation"] = "swish"
    options.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="options.json.*activation.*swish"):
        load_original(options, weights)


def test_bad_native_directories(tiny_model, tmp_path):
    with pytest.raises(FileNotFoundError, match="not an elmokit model directory"):
        load_pretrained(tmp_path)
    save_pretrained(tiny_model, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(WeightFileError, match="not a readable safetensors"):
        load_pretrained(tmp_path / "m")
    save_pretrained(tiny_model, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["lstm"]["cell_dim"] = 13
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightFileError, match="has shape"):
        load_pretrained(tmp_path / "m")


def test_fp16_storage_is_upcast(tiny_model, tmp_path):
    save_pretrained(tiny_model.half(), tmp_path / "m")
    loaded = load_pretrained(tmp_path / "m")
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
