"""Original HDF5 and native safetensors: round trips, parameter counts, and every bad input."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from elmokit import (ConfigError, ElmoConfig, WeightFileError, batch_to_ids, load_original, load_pretrained,
                     save_original, save_pretrained)
from elmokit.model.weights import expected_datasets
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


# ---------------------------------------------------------------------------------------------
# Untrusted HDF5: nothing outside the file is read, only finite floats are accepted
# ---------------------------------------------------------------------------------------------
def _replace_dataset(path, name, create):
    """Rewrite dataset `name` of an HDF5 file with `create(file, name, original_values)`."""
    with h5py.File(path, "a") as file:
        values = file[name][...]
        del file[name]
        create(file, name, values)


def _external(tmp_path):
    def create(file, name, values):
        secret = tmp_path / "secret.bin"
        secret.write_bytes(values.astype("<f4").tobytes())  # exactly what a real dataset would hold
        file.create_dataset(name, shape=values.shape, dtype="<f4", external=[(str(secret), 0, values.nbytes)])
    return create


def _virtual(tmp_path):
    def create(file, name, values):
        with h5py.File(tmp_path / "other.h5", "w") as other:
            other["data"] = values
        layout = h5py.VirtualLayout(shape=values.shape, dtype=values.dtype)
        layout[...] = h5py.VirtualSource(str(tmp_path / "other.h5"), "data", shape=values.shape)
        file.create_virtual_dataset(name, layout)
    return create


def _external_link(tmp_path):
    def create(file, name, values):
        with h5py.File(tmp_path / "other.h5", "w") as other:
            other["data"] = values
        file[name] = h5py.ExternalLink(str(tmp_path / "other.h5"), "data")
    return create


def _soft_link(tmp_path):
    def create(file, name, values):
        file["elsewhere"] = values
        file[name] = h5py.SoftLink("/elsewhere")
    return create


def _as(dtype):
    return lambda tmp_path: lambda file, name, values: file.create_dataset(name, data=values.astype(dtype))


def _compound(tmp_path):
    def create(file, name, values):
        kind = np.dtype([("value", "<f4"), ("flag", "<i4")])
        data = np.zeros(values.shape, kind)
        data["value"] = values
        file.create_dataset(name, data=data)
    return create


def _with(value):
    def make(tmp_path):
        def create(file, name, values):
            values = values.copy()
            values.flat[1] = value
            file.create_dataset(name, data=values)
        return create
    return make


def _beyond_float32(tmp_path):  # finite as float64, infinite as the float32 the model holds
    def create(file, name, values):
        values = values.astype(np.float64)
        values.flat[1] = 1e39
        file.create_dataset(name, data=values)
    return create


def _unstored(tmp_path):  # declared, chunked, never written: the library would invent fill values
    return lambda file, name, values: file.create_dataset(name, shape=values.shape, dtype="f4", chunks=True)


@pytest.mark.parametrize("make, message", [
    (_external, r"'CNN_proj/W_proj' uses external storage"),
    (_virtual, r"'CNN_proj/W_proj' is a virtual dataset"),
    (_external_link, r"'CNN_proj/W_proj' is an external link"),
    (_soft_link, r"'CNN_proj/W_proj' is a soft link"),
    (_as(np.int32), r"'CNN_proj/W_proj' has dtype int32, expected floating point"),
    (_as(np.bool_), r"'CNN_proj/W_proj' has dtype bool, expected floating point"),
    (_compound, r"'CNN_proj/W_proj' has dtype \{?.*value.*flag"),
    (_with(np.nan), r"dataset 'CNN_proj/W_proj' holds 1 NaN or infinite values"),
    (_with(np.inf), r"dataset 'CNN_proj/W_proj' holds 1 NaN or infinite values"),
    (_beyond_float32, r"dataset 'CNN_proj/W_proj' holds 1 NaN or infinite values"),
    (_unstored, r"'CNN_proj/W_proj' declares 480 bytes but stores only 0"),
], ids=["external", "virtual", "external-link", "soft-link", "int32", "bool", "compound", "nan", "inf",
        "overflow", "unstored"])
def test_hostile_hdf5_is_refused_naming_the_dataset(original_pair, tmp_path, make, message):
    options, weights = original_pair
    _replace_dataset(weights, "CNN_proj/W_proj", make(tmp_path))
    with pytest.raises(WeightFileError, match=message):
        load_original(options, weights)


def test_storage_is_checked_before_any_value_is_read(original_pair, tmp_path, monkeypatch):
    options, weights = original_pair
    _replace_dataset(weights, "CNN_proj/W_proj", _external(tmp_path))
    reads = []
    monkeypatch.setattr(h5py.Dataset, "__getitem__", lambda self, key: reads.append(self.name))
    with pytest.raises(WeightFileError, match="external storage"):
        load_original(options, weights)
    assert reads == []


def test_compressed_and_float64_datasets_still_load(original_pair, tiny_model):
    options, weights = original_pair
    for name in ("CNN_proj/W_proj", "char_embed"):
        _replace_dataset(weights, name, lambda f, n, v: f.create_dataset(n, data=v.astype(np.float64),
                                                                         compression="gzip", shuffle=True))
    loaded = load_original(options, weights)
    for name, tensor in tiny_model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_convert_refuses_a_hostile_file_in_one_line_and_writes_nothing(original_pair, tmp_path, capsys):
    from elmokit.cli import main

    options, weights = original_pair
    _replace_dataset(weights, "CNN_proj/W_proj", _external(tmp_path))
    assert main(["convert", "--options-file", str(options), "--weight-file", str(weights),
                 "--to-native", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "external storage" in err and "CNN_proj/W_proj" in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Untrusted native directories: the config is checked against the header before allocating
# ---------------------------------------------------------------------------------------------
def _edit_config(directory, section, **values):
    config = json.loads((directory / "config.json").read_text())
    config[section].update(values)
    (directory / "config.json").write_text(json.dumps(config))


def test_huge_config_in_a_small_directory_allocates_nothing(model_dir, monkeypatch):
    from elmokit.model import weights

    _edit_config(model_dir, "lstm", cell_dim=2**26, projection_dim=2**10)  # ~2 TB of float32
    devices = []
    real = weights.BiLM
    monkeypatch.setattr(weights, "BiLM", lambda config: devices.append(torch.get_default_device()) or real(config))
    with pytest.raises(WeightFileError, match=r"tensor 'token_encoder.projection.weight' has shape \(6, 20\), "
                                              r"config.json implies \(1024, 20\)"):
        load_pretrained(model_dir)
    assert devices == [torch.device("meta")]  # only the skeleton was built, on the meta device


def test_more_layers_than_the_file_has_tensors_is_refused_before_building(model_dir, monkeypatch):
    from elmokit.model import weights

    _edit_config(model_dir, "lstm", n_layers=10**9)
    monkeypatch.setattr(weights, "BiLM", lambda config: pytest.fail("built a model"))
    with pytest.raises(WeightFileError, match=r"config.json: lstm.n_layers asks for 1,000,000,000, but .* holds only 19"):
        load_pretrained(model_dir)


def test_sizes_that_overflow_are_refused(model_dir):
    _edit_config(model_dir, "lstm", cell_dim=10**18, projection_dim=10**18)
    with pytest.raises(WeightFileError, match="config.json: sizes too large"):
        load_pretrained(model_dir)


@pytest.mark.parametrize("dtype, name", [(torch.int32, "I32"), (torch.int64, "I64"), (torch.bool, "BOOL"),
                                         (torch.uint8, "U8")])
def test_integer_and_bool_tensors_are_refused(tiny_model, tmp_path, dtype, name):
    from safetensors.torch import save_file

    save_pretrained(tiny_model, tmp_path / "m")
    tensors = {k: v.contiguous() for k, v in tiny_model.state_dict().items()}
    tensors["lstm.layers.0.bias"] = tensors["lstm.layers.0.bias"].to(dtype)  # same shape, reinterpretable
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(WeightFileError, match=rf"tensor 'lstm.layers.0.bias' has dtype {name}, expected floating point"):
        load_pretrained(tmp_path / "m")


def test_an_integer_softmax_is_refused_too(tiny_model, tmp_path):
    from elmokit.model.weights import read_safetensors

    save_pretrained(tiny_model, tmp_path / "m", extra_tensors={"softmax.weight": torch.zeros(5, 6, dtype=torch.int16)})
    with pytest.raises(WeightFileError, match=r"'softmax.weight' has dtype I16"):
        read_safetensors(tmp_path / "m" / "model.safetensors", prefix="softmax.")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_native_weights_are_refused(tiny_model, tmp_path, value):
    with torch.no_grad():
        tiny_model.lstm.layers[1].projection[0, 2, 3] = value
    save_pretrained(tiny_model, tmp_path / "m")
    with pytest.raises(WeightFileError, match=r"tensor 'lstm.layers.1.projection' holds 1 NaN or infinite"):
        load_pretrained(tmp_path / "m")


@pytest.mark.parametrize("text, message", [
    ('{"char_cnn": [1, 2], "lstm": {}}', "char_cnn"),
    ('{"char_cnn": {}, "lstm": "big"}', "lstm"),
    ('[1, 2]', "expected a JSON object"),
])
def test_native_config_of_the_wrong_structure(model_dir, text, message):
    (model_dir / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=rf"config.json.*{message}|{message}.*config.json"):
        load_pretrained(model_dir)


def test_provenance_is_read_by_one_function_for_every_reader(model_dir, capsys):
    """read_provenance: {} without the file, the record, or one error naming the file (elmo info,
    the Hugging Face and sentence-transformers loaders all read it through this function)."""
    import json

    from elmokit.cli import main
    from elmokit.model.weights import PROVENANCE_NAME, WeightFileError, read_provenance

    assert read_provenance(model_dir) == {}
    (model_dir / PROVENANCE_NAME).write_text(json.dumps({"trained_by": "elmo train"}), encoding="utf-8")
    assert read_provenance(model_dir) == {"trained_by": "elmo train"}
    for text, expected in (("[1, 2]", "expected a JSON object"), ("{not json", "not a readable provenance record")):
        (model_dir / PROVENANCE_NAME).write_text(text, encoding="utf-8")
        with pytest.raises(WeightFileError, match=expected):
            read_provenance(model_dir)
        capsys.readouterr()
        assert main(["info", str(model_dir)]) == 2
        assert PROVENANCE_NAME in capsys.readouterr().err
