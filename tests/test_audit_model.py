"""The hostile audit's model and API defects (issue 32): each test failed before its fix."""

from __future__ import annotations

import copy
import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from elmokit import Elmo, ElmoEmbedder, HubElmo, batch_to_ids, load_original, save_original
from elmokit.model.config import read_options
from elmokit.model.errors import WeightFileError
from elmokit.model.weights import expected_datasets
from elmokit.cli import main
from elmokit.training.checkpoint import save_model_dir
from elmokit.training.lm import LanguageModel
from tests.conftest import one_error_line, one_line
from tests.test_train import corpus  # noqa: F401 (a fixture: a tiny corpus, vocabulary and training config)


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


# ---------------------------------------------------------------------------------------------
# Defect 18: the API's edges
# ---------------------------------------------------------------------------------------------
def test_hub_elmo_takes_an_empty_batch_as_elmo_does(model_dir):
    outputs = HubElmo(str(model_dir))([])
    assert outputs["elmo"].shape == (0, 0, 12) and outputs["word_emb"].shape == (0, 0, 6)
    assert outputs["lstm_outputs2"].shape == (0, 0, 12) and outputs["default"].shape == (0, 12)
    assert outputs["sequence_len"].shape == (0,)


@pytest.mark.parametrize("arguments, message", [
    ({"num_output_representations": -1}, "num_output_representations must be an integer >= 1, got -1"),
    ({"num_output_representations": 0}, "num_output_representations must be an integer >= 1, got 0"),
    ({"dropout": float("nan")}, r"dropout must be a probability in \[0, 1\], got nan"),
    ({"dropout": -0.1}, r"dropout must be a probability in \[0, 1\], got -0.1"),
], ids=["negative", "zero", "nan", "below-zero"])
def test_elmo_refuses_bad_arguments_when_built(model_dir, arguments, message):
    with pytest.raises(ValueError, match=message):
        Elmo(str(model_dir), **arguments)


def test_elmo_forward_names_what_it_expects(model_dir):
    elmo = Elmo(str(model_dir), dropout=0.0)
    with pytest.raises(TypeError, match=r"Elmo.forward: inputs: expected a tensor of char ids .*got list"):
        elmo([["a", "cat"]])
    with pytest.raises(TypeError, match="expected integer char ids"):
        elmo(batch_to_ids([["a"]]).float())


@pytest.mark.parametrize("bad_id", [262, 1000, -1])
def test_char_ids_beyond_the_table_are_named(model_dir, bad_id):
    ids = batch_to_ids([["a", "cat"]])
    ids[0, 1, 2] = bad_id
    for module, who in ((Elmo(str(model_dir), dropout=0.0), "Elmo.forward"), (HubElmo(str(model_dir)), "HubElmo")):
        with pytest.raises(ValueError, match=rf"{who}.*char ids must lie in \[0, 262\).*{bad_id}"):
            module(ids)


@pytest.mark.parametrize("copy_of", [copy.deepcopy, lambda embedder: pickle.loads(pickle.dumps(embedder))],
                         ids=["deepcopy", "pickle"])
def test_elmo_embedder_can_be_copied_and_pickled(model_dir, copy_of):
    embedder = ElmoEmbedder(str(model_dir))
    expected = embedder.embed_sentence(["a", "cat"])
    copied = copy_of(embedder)
    assert copied.cache is not None and copied.cache is not embedder.cache
    np.testing.assert_array_equal(copied.embed_sentence(["a", "cat"]), expected)
    np.testing.assert_array_equal(copy_of(ElmoEmbedder(str(model_dir), cache_tokens=False))
                                  .embed_sentence(["a", "cat"]), expected)


# ---------------------------------------------------------------------------------------------
# Defect 11: a full disk while writing a checkpoint
# ---------------------------------------------------------------------------------------------
def run_on_a_full_disk(*argv: str) -> subprocess.CompletedProcess:
    """`python ARGV...` in a process of its own whose writes past 64 KiB fail with EFBIG, as on a
    full disk (SIGXFSZ ignored). Never in pytest's process: the limit holds for every file it
    writes, and its own report to a log already over 64 KiB (as CI's is) would fail too."""

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))

    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, preexec_fn=limited,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")})


def one_line_of(done: subprocess.CompletedProcess, *expected: str) -> None:
    """The process exited 1 with one line on stderr, no traceback, holding every `expected` text."""
    assert done.returncode == 1, done.stderr
    one_line(done.stderr, *expected)


SAVE_A_BIG_CHECKPOINT = """
import sys, torch
from elmokit.training.checkpoint import save_checkpoint
try:
    save_checkpoint(sys.argv[1], {"model": {"weight": torch.zeros(100_000)}})
except OSError as error:
    sys.exit(str(error))
"""


def test_a_checkpoint_that_cannot_be_written_is_one_oserror_naming_it(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"previous")
    one_line_of(run_on_a_full_disk("-c", SAVE_A_BIG_CHECKPOINT, str(path)),
                "checkpoint.pt: could not write the checkpoint", "disk full", "bytes free")
    assert path.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_elmo_train_on_a_full_disk_says_so_in_one_line(corpus, tmp_path):
    run = tmp_path / "run"
    one_line_of(run_on_a_full_disk("-m", "elmokit", "train", "--config", str(corpus["train_json"]),
                                   "--output-dir", str(run), "--epochs", "1"),
                "checkpoint.pt: could not write the checkpoint", "disk full")


# ---------------------------------------------------------------------------------------------
# Defect 10: torch.compile(Elmo(...)) with oneDNN's kernels on
# ---------------------------------------------------------------------------------------------
def test_torch_compile_of_elmo_gives_the_eager_vectors(model_dir, monkeypatch):
    if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
        pytest.skip("torch.compile's inductor needs a C++ compiler on the CPU; none is installed")
    monkeypatch.delenv("ELMOKIT_KERNELS", raising=False)  # the default: oneDNN where it applies
    torch._dynamo.reset()
    elmo = Elmo(str(model_dir), dropout=0.0).eval()
    char_ids = batch_to_ids([["a", "cat"], ["hello"]])
    with torch.no_grad():
        expected = elmo(char_ids)["elmo_representations"][0]
        compiled = torch.compile(elmo)(char_ids)["elmo_representations"][0]
    torch.testing.assert_close(compiled, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Issue 32 point 4: --deterministic
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def restores_deterministic_mode(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def test_train_deterministic_is_recorded_and_sets_torch_deterministic_mode(corpus, tmp_path,
                                                                           restores_deterministic_mode):
    assert not torch.are_deterministic_algorithms_enabled()
    run = tmp_path / "run"
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--epochs", "1",
                 "--deterministic"]) == 0
    assert json.loads((run / "train_config.json").read_text())["deterministic"] is True
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and torch.backends.cudnn.deterministic


def test_elmo_convert_on_a_full_disk_is_one_line_and_exit_1(tmp_path):
    """safetensors' failed write is the OSError it is (the machine failed the run: exit 1), one
    line naming the file, no temporary file left (hostile review)."""
    one_line_of(run_on_a_full_disk("-m", "elmokit", "convert", "--to-native", str(tmp_path / "native")),
                "native/model.safetensors failed (File too large); is the disk full or over its quota?")
    assert not [path for path in tmp_path.rglob("*") if path.name.endswith(".tmp")]


def test_elmo_convert_to_original_on_a_full_disk_is_one_line_and_exit_1(tmp_path):
    """h5py's failed write likewise (an HDF5 file that failed to close can take the process that
    holds it down at exit)."""
    one_line_of(run_on_a_full_disk("-m", "elmokit", "convert", "--to-original", str(tmp_path / "o.json"),
                                   str(tmp_path / "w.hdf5")),
                "w.hdf5 failed (File too large); is the disk full")
    assert not [path for path in tmp_path.rglob("*") if path.name.endswith(".tmp")]
