"""The file-handling defects of issue 32's audit: each test fails without its fix."""

from __future__ import annotations

import json
import os

import pytest

from elmokit.io import output_lock


# ---------------------------------------------------------------------------------------------
# Defect 1: a lock file never follows a symbolic link nor replaces a file that is not a lock
# ---------------------------------------------------------------------------------------------
def test_a_symbolic_link_at_the_lock_path_is_refused_and_its_target_kept(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    lock = tmp_path / "out.hdf5.lock"
    lock.symlink_to(victim)
    with pytest.raises(FileExistsError, match="not a lock"):
        with output_lock(lock, "out.hdf5"):
            pass
    assert victim.read_text() == "precious\n"
    assert lock.is_symlink()


def test_a_dangling_symbolic_link_at_the_lock_path_creates_nothing(tmp_path):
    target = tmp_path / "elsewhere.txt"
    lock = tmp_path / "train.lock"
    lock.symlink_to(target)
    with pytest.raises(FileExistsError, match="not a lock"):
        with output_lock(lock, "the run"):
            pass
    assert not target.exists() and lock.is_symlink()


def test_a_regular_file_that_is_not_a_lock_is_neither_truncated_nor_deleted(tmp_path):
    lock = tmp_path / "X.lock"
    lock.write_text("my notes\n")
    with pytest.raises(FileExistsError, match="not a lock"):
        with output_lock(lock, "X"):
            pass
    assert lock.read_text() == "my notes\n"


def test_a_hard_link_at_the_lock_path_is_refused(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text(json.dumps({"pid": 1, "host": "h", "started": "s"}))
    lock = tmp_path / "X.lock"
    os.link(victim, lock)
    with pytest.raises(FileExistsError, match="not a lock"):
        with output_lock(lock, "X"):
            pass
    assert json.loads(victim.read_text())["pid"] == 1


def test_an_empty_or_stale_lock_file_is_still_taken_over(tmp_path):
    lock = tmp_path / "X.lock"
    lock.write_text("")
    with output_lock(lock, "X"):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()
