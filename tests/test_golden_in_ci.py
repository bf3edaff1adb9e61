"""The golden tests (bilm-tf's numbers, tests/fixtures/elmo-fixture) run in every clone, and in CI
(CI=true) one that skips fails: tests/conftest.py's `pytest_runtest_makereport`."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import FIXTURE, REPO

PROBE = '''
import pytest

def test_golden_that_skips(fixture_dir):
    pytest.skip("probe: as if an extra or the fixture were missing")

def test_other_that_skips():
    pytest.skip("probe: not a golden test, an extra missing")

def test_other_that_skips_for_hardware():
    pytest.skip("probe: needs a CUDA GPU")

def test_golden_that_runs(fixture_dir):
    assert (fixture_dir / "lm_weights.hdf5").is_file()
'''


def test_the_fixture_is_in_the_repository_with_its_license():
    names = {path.name for path in FIXTURE.iterdir()}
    assert {"options.json", "lm_weights.hdf5", "sentences.json", "vocab_test.txt", "elmo_token_embeddings.hdf5",
            *(f"lm_embeddings_{k}.hdf5" for k in range(3)), "README.md", "LICENSE"} <= names
    assert FIXTURE.is_relative_to(REPO) and "Apache-2.0" in (FIXTURE / "README.md").read_text()
    assert "Apache License" in (FIXTURE / "LICENSE").read_text()


MODULE_PROBE = '''
import pytest

pytest.importorskip("a_package_nobody_installed", reason="the probe's extra is not installed")

def test_never_collected():
    pass
'''


def _run_probe(tmp_path, ci: str | None, probe: str = PROBE) -> subprocess.CompletedProcess:
    (tmp_path / "test_probe.py").write_text(probe)
    env = {key: value for key, value in os.environ.items() if key != "CI"} | {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_a_skip_fails_in_ci_unless_hardware_is_missing(tmp_path):
    """In CI a golden test's skip fails, and so does any other test's unless it names missing
    hardware; elsewhere (a user's clone) all three skip."""
    ci = _run_probe(tmp_path, "true")
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert "2 failed, 1 passed, 1 skipped" in ci.stdout, ci.stdout
    assert "test_golden_that_skips: a golden test" in ci.stdout and "skipped in CI" in ci.stdout, ci.stdout
    assert "test_other_that_skips: skipped in CI (Skipped: probe: not a golden test, an extra missing)" in ci.stdout, ci.stdout
    elsewhere = _run_probe(tmp_path, None)
    assert elsewhere.returncode == 0 and "1 passed, 3 skipped" in elsewhere.stdout, elsewhere.stdout


def test_a_module_skipped_whole_fails_in_ci_only(tmp_path):
    """A module-level importorskip of a missing extra skips the whole file at collection: in CI
    that is an error, in a user's clone a skip."""
    ci = _run_probe(tmp_path, "true", MODULE_PROBE)
    assert ci.returncode != 0 and "skipped whole in CI (Skipped: the probe's extra is not installed)" in ci.stdout, ci.stdout
    elsewhere = _run_probe(tmp_path, None, MODULE_PROBE)
    assert elsewhere.returncode in (0, 5) and "1 skipped" in elsewhere.stdout and "error" not in elsewhere.stdout, elsewhere.stdout  # 5: nothing else collected
