"""The hostile audit's model and API defects (issue 32): each test failed before its fix."""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

from elmokit import load_original, save_original
from elmokit.model.config import read_options
from elmokit.model.errors import WeightFileError
from elmokit.model.weights import expected_datasets
from elmokit.cli import main
from elmokit.training.checkpoint import save_model_dir
from elmokit.training.lm import LanguageModel
from tests.conftest import one_error_line


# ---------------------------------------------------------------------------------------------
# Defect 5: the options JSON and the weights at one path
# ---------------------------------------------------------------------------------------------
def _language_model_dir(bilm, directory):
    vocab = directory.parent / "vocab.txt"
    vocab.write_text("<S>\n</S>\n<UNK>\nw\n")
    model = LanguageModel(bilm.config, 4)
    model.bilm.load_state_dict(bilm.state_dict())
    save_model_dir(model.eval(), directory, vocab)
    return directory


def test_convert_refuses_options_and_weights_at_one_path(model_dir, tmp_path, capsys):
    same = tmp_path / "same"
    assert main(["convert", "--model", str(model_dir), "--to-original", str(same), str(same)]) == 2
    one_error_line(capsys, "same file", str(same))
    assert not same.exists()


def test_export_refuses_options_and_weights_at_one_path(tiny_model, tmp_path, capsys):
    source = _language_model_dir(tiny_model, tmp_path / "lm")
    same = tmp_path / "same"
    assert main(["export", str(source), "--original", str(same), str(same)]) == 2
    one_error_line(capsys, "same file", str(same))
    assert not same.exists()


def test_save_original_refuses_a_link_to_its_other_output(tiny_model, tmp_path):
    (tmp_path / "weights.hdf5").write_bytes(b"precious")
    os.symlink(tmp_path / "weights.hdf5", tmp_path / "options.json")
    with pytest.raises(ValueError, match="same file"):
        save_original(tiny_model, tmp_path / "options.json", tmp_path / "weights.hdf5")
    assert (tmp_path / "weights.hdf5").read_bytes() == b"precious"


# ---------------------------------------------------------------------------------------------
# Defect 4: gzip chunks of zeros as a decompression bomb
# ---------------------------------------------------------------------------------------------
def test_a_compressed_weight_file_declaring_far_more_than_it_holds_is_refused(tiny_model, tmp_path):
    options, weights = tmp_path / "options.json", tmp_path / "weights.hdf5"
    save_original(tiny_model, options, weights)
    edited = json.loads(options.read_text())
    edited["char_cnn"]["embedding"]["dim"] = 20_000  # 24 MB of float32 zeros, each dataset under 1032x
    options.write_text(json.dumps(edited))
    with h5py.File(weights, "w") as file:
        for name, shape in expected_datasets(read_options(options)).items():
            file.create_dataset(name, data=np.zeros(shape, "f4"), compression="gzip", compression_opts=9,
                                chunks=True)
    assert weights.stat().st_size < 2**20
    with pytest.raises(WeightFileError, match="decompression bomb"):
        load_original(options, weights)
