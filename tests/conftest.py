"""Shared test fixtures: a tiny config, the golden fixture of bilm-tf (tests/fixtures/elmo-fixture),
and the paths of ../shared (skipped when absent); in CI (CI=true) a test that skips fails unless
the machine lacks hardware or runs as root (`HARDWARE_SKIP`)."""

from __future__ import annotations

import os
import re
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
# bilm-tf's golden numbers (AllenNLP's test fixture, Apache-2.0: its README.md and LICENSE beside it),
# in the repository so that every clone runs the tests that compare with them
FIXTURE = REPO / "tests" / "fixtures" / "elmo-fixture"


def tiny_config() -> ElmoConfig:
    return ElmoConfig(
        char_cnn=CharCNNConfig(embedding_dim=4, filters=((1, 4), (2, 8), (3, 8)), n_highway=1),
        lstm=LSTMConfig(cell_dim=12, projection_dim=6, n_layers=2, cell_clip=3.0, proj_clip=3.0),
    )


@pytest.fixture
def tiny_model() -> BiLM:
    torch.manual_seed(0)
    return BiLM(tiny_config()).eval()


def clipped_three_layer_model() -> BiLM:
    """The tiny model's char CNN with 3 LSTM layers (the residual from layer 2 on matters) whose
    cell clip (0.5) and projection clip (0.25) differ and both bind: the token projection is
    scaled by 40, so that cell and projected states pass them (without either clip, or with the
    two swapped, the layers move by 0.15 or more; float32 and float64 agree within 1e-6)."""
    torch.manual_seed(0)
    lstm = LSTMConfig(cell_dim=12, projection_dim=6, n_layers=3, cell_clip=0.5, proj_clip=0.25)
    model = BiLM(ElmoConfig(char_cnn=tiny_config().char_cnn, lstm=lstm)).eval()
    with torch.no_grad():
        model.token_encoder.projection.weight.mul_(40.0)
    return model


@pytest.fixture
def clipped_model() -> BiLM:
    return clipped_three_layer_model()


@pytest.fixture
def model_dir(tiny_model, tmp_path) -> Path:
    """The tiny model saved as a native directory."""
    save_pretrained(tiny_model, tmp_path / "model")
    return tmp_path / "model"


def require_shared(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"needs {path} (the shared data folder beside the repo); absent in a fresh clone")
    return path


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    """The golden fixture: a test that takes it, itself or through another fixture, is a golden
    test (`pytest_runtest_makereport`)."""
    return FIXTURE


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


# The only reasons a test may skip in CI: hardware the CI machine lacks (a CUDA GPU; VNNI, AMX or
# bfloat16 products on its CPU) or running as root. A missing extra, data folder or tool is a
# failure there: CI installs everything the suite tests (scripts/setup.sh, .ci/run) and has
# ../shared beside the clone. (With CI=true in a copy that has no ../shared, as scripts/mutation.py
# runs, a test that names that missing folder may skip; everything else still fails.)
HARDWARE_SKIP = re.compile(r"\b(CUDA|GPU|VNNI|AMX|AMX-INT8|bfloat16|root)\b")


def _skip_reason(report) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (CI=true), a test that skips for any reason but missing hardware or root
    (`HARDWARE_SKIP`) is reported as failed, and a golden test (one that takes `fixture_dir`: the
    proof of the original numbers) fails whatever its reason: a skip would pass unnoticed."""
    report = (yield).get_result()
    if not (report.skipped and in_ci()) or getattr(report, "wasxfail", None) is not None:
        return
    reason = _skip_reason(report)
    if "fixture_dir" in getattr(item, "fixturenames", ()):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid}: a golden test (bilm-tf's numbers, tests/fixtures/elmo-fixture) "
                           f"skipped in CI ({reason}); CI must run every golden test")
    elif not HARDWARE_SKIP.search(reason) and not (not SHARED.exists() and str(SHARED) in reason):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid}: skipped in CI ({reason}); in CI a test may skip only for missing "
                           "hardware (GPU, VNNI/AMX, bfloat16 products) or root: install what it needs")


_MODULES_SKIPPED_IN_CI: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same rule for a whole module skipped as it is collected (a module-level
    `pytest.importorskip` of an extra, a `pytest.skip(allow_module_level=True)`): in CI the run
    goes on (a collection error would stop it) and fails at its end, naming the module."""
    report = (yield).get_result()
    if report.skipped and in_ci():
        reason = _skip_reason(report)
        if not HARDWARE_SKIP.search(reason) and not (not SHARED.exists() and str(SHARED) in reason):
            _MODULES_SKIPPED_IN_CI.append(f"{collector.nodeid}: skipped whole in CI ({reason})")


def pytest_sessionfinish(session, exitstatus):
    if _MODULES_SKIPPED_IN_CI and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    for line in _MODULES_SKIPPED_IN_CI:
        terminalreporter.write_line(f"FAILED {line}; in CI a test may skip only for missing hardware (GPU, "
                                    "VNNI/AMX, bfloat16 products) or root: install what it needs", red=True)


SENTENCES = [
    ["The", "cat", "sat", "on", "the", "mat", "."],
    ["Colorless", "green", "ideas"],
    [],
    ["naïve", "café", "😀", "東京"],
    ["a"],
]


def one_error_line(capsys, *expected: str) -> str:
    """The captured stderr is one line, no traceback, holding every `expected` text."""
    return one_line(capsys.readouterr().err, *expected)


def one_line(err: str, *expected: str) -> str:
    """`err` (a command's stderr) is one line, no traceback, holding every `expected` text."""
    err = err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err
