"""Atomic writes: the destination appears complete or not at all, with normal permissions, and
on the disk (fsync) before it is renamed; the output lock lets one writer in at a time."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from elmokit.io import OutputInUseError, atomic_path, atomic_write_text, output_lock
from tests.conftest import REPO


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


# ---------------------------------------------------------------------------------------------
# Durability: the data reaches the disk before the rename, the rename before returning
# ---------------------------------------------------------------------------------------------
def _record_syncs(monkeypatch) -> list[tuple[str, str]]:
    """(event, path) for every fsync and rename, in order."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(source, destination) -> None:
        events.append(("replace", str(destination)))
        real_replace(source, destination)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name the synced files")
def test_atomic_write_syncs_the_file_then_renames_then_syncs_the_directory(tmp_path, monkeypatch):
    events = _record_syncs(monkeypatch)
    target = tmp_path / "out.txt"
    atomic_write_text(target, "done")
    assert [event for event, _ in events] == ["fsync", "replace", "fsync"]
    assert events[0][1].startswith(str(tmp_path / ".out.txt.")) and events[0][1].endswith(".tmp")
    assert events[1][1] == str(target) and events[2][1] == str(tmp_path)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name the synced files")
def test_checkpoints_and_models_are_synced(tiny_model, tmp_path, monkeypatch):
    from elmokit import save_pretrained
    from elmokit.training.checkpoint import save_checkpoint

    events = _record_syncs(monkeypatch)
    save_checkpoint(tmp_path / "checkpoint.pt", {"model": tiny_model.state_dict()})
    save_pretrained(tiny_model, tmp_path / "model")
    for written in (tmp_path / "checkpoint.pt", tmp_path / "model" / "model.safetensors",
                    tmp_path / "model" / "config.json"):
        at = events.index(("replace", str(written)))
        assert events[at - 1][0] == "fsync" and events[at - 1][1].endswith(".tmp")  # its data first
        assert events[at + 1] == ("fsync", str(written.parent))  # then the rename


# ---------------------------------------------------------------------------------------------
# One writer at a time
# ---------------------------------------------------------------------------------------------
def _hold_lock_in_another_process(lock_path) -> subprocess.Popen:
    """A process that takes the lock, says so, and keeps it until killed."""
    code = ("import sys\nfrom elmokit.io import output_lock\n"
            f"with output_lock({str(lock_path)!r}, 'the test output'):\n"
            "    print('locked', flush=True)\n    sys.stdin.read()\n")
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert process.stdout.readline().strip() == "locked"
    return process


def test_a_second_writer_is_refused_naming_the_first(tmp_path):
    lock = tmp_path / "out.h5.lock"
    holder = _hold_lock_in_another_process(lock)
    try:
        with pytest.raises(OutputInUseError, match=rf"being written by another process \(pid {holder.pid} on "):
            with output_lock(lock, "out.h5"):
                pass
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger("elmokit"), "level", logging.NOTSET)  # a library's default, not -q
    lock = tmp_path / "run" / "train.lock"
    holder = _hold_lock_in_another_process(lock)
    holder.kill()  # SIGKILL: no cleanup, the lock file stays
    holder.wait()
    assert lock.exists()
    with output_lock(lock, "the run"):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert f"stale lock of the run left by pid {holder.pid}" in capsys.readouterr().err
    assert not lock.exists()


def test_lock_is_exclusive_within_one_process_and_released(tmp_path):
    lock = tmp_path / "new" / "o.lock"
    with output_lock(lock, "o"):
        with pytest.raises(OutputInUseError):
            with output_lock(lock, "o"):
                pass
    assert not (tmp_path / "new").exists()  # the directory it made for the lock is gone too
    with output_lock(lock, "o"):  # free again
        pass


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc/self/status")
def test_the_umask_is_read_without_setting_it(tmp_path, monkeypatch):
    """Reading the umask never sets it (to 0 and back: meanwhile a file made by another thread of
    `elmo serve` or a Ray actor got mode 0666); where /proc is not there it is set and restored."""
    import elmokit.io as io_module

    real_umask = os.umask
    previous = real_umask(0o027)
    try:
        def refused(mask: int) -> int:
            raise AssertionError(f"os.umask({mask:#o}) called")

        monkeypatch.setattr(os, "umask", refused)
        assert io_module._umask() == 0o027
        atomic_write_text(tmp_path / "out.txt", "done")
        assert (tmp_path / "out.txt").stat().st_mode & 0o777 == 0o640
        monkeypatch.setattr(os, "umask", real_umask)
        monkeypatch.setattr(io_module, "PROC_STATUS", str(tmp_path / "no-proc"))  # another system
        assert io_module._umask() == 0o027
    finally:
        real_umask(previous)
