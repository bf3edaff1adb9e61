"""Atomic writes: the destination appears complete or not at all, with normal permissions."""

from __future__ import annotations

import os

import pytest

from elmokit.io import atomic_path, atomic_write_text


def test_atomic_write_gives_the_usual_permissions(tmp_path):
    target = tmp_path / "out.txt"
    atomic_write_text(target, "done")
    mask = os.umask(0)
    os.umask(mask)
    assert target.read_text() == "done"
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask


def test_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]
