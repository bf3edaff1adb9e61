"""Shared test fixtures: a tiny config, and the paths of ../shared (skipped when absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from elmokit import BiLM, CharCNNConfig, ElmoConfig, LSTMConfig, save_pretrained

# Tests run tiny tensors: one thread avoids OpenMP spinning on a shared 2-core machine.
torch.set_num_threads(1)
# Commands default to --device auto; the tests compare their output with references computed on
# the CPU, so a GPU machine runs them there too (a test that wants the GPU asks for it).
os.environ.setdefault("ELMOKIT_DEVICE", "cpu")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
DATA = SHARED / "data"
FIXTURE = DATA / "elmo-fixture"


def tiny_config() -> ElmoConfig:
    return ElmoConfig(
        char_cnn=CharCNNConfig(embedding_dim=4, filters=((1, 4), (2, 8), (3, 8)), n_highway=1),
        lstm=LSTMConfig(cell_dim=12, projection_dim=6, n_layers=2, cell_clip=3.0, proj_clip=3.0),
    )


@pytest.fixture
def tiny_model() -> BiLM:
    torch.manual_seed(0)
    return BiLM(tiny_config()).eval()


@pytest.fixture
def model_dir(tiny_model, tmp_path) -> Path:
    """The tiny model saved as a native directory."""
    save_pretrained(tiny_model, tmp_path / "model")
    return tmp_path / "model"


def require_shared(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"needs {path} (the shared data folder beside the repo); absent in a fresh clone")
    return path


@pytest.fixture
def fixture_dir() -> Path:
    return require_shared(FIXTURE)


SENTENCES = [
    ["The", "cat", "sat", "on", "the", "mat", "."],
    ["Colorless", "green", "ideas"],
    [],
    ["naïve", "café", "😀", "東京"],
    ["a"],
]


def one_error_line(capsys, *expected: str) -> str:
    """The captured stderr is one line, no traceback, holding every `expected` text."""
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err
