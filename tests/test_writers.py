"""Commands that write: one writer at a time (a second `elmo embed` or `elmo train` on the same
output is refused, a lock left by a killed process is taken over), one rule for existing outputs
(refused without --overwrite, unfinished work never discarded unasked), and a full disk during
`elmo embed` is one clear error that keeps the finished work for --resume."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from elmokit import read_embeddings
from elmokit.cli import main
from tests.conftest import REPO, one_error_line, tiny_config

LINES = ["the cat sat on the mat .", "", "a/b c", ".", "colorless green ideas", "sentence_to_index",
         "naïve café", "a/b c", "%2F", "x y z"] * 3


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "in.txt"
    path.write_text("".join(line + "\n" for line in LINES), encoding="utf-8")
    return path


def _embed(source: Path, out: Path, model_dir: Path, *extra: str, quiet: bool = True) -> int:
    """`elmo embed` with small checkpoints: errors only (-q), or with quiet=False its messages
    (the report of what it embedded), without progress."""
    return main(["embed", str(source), str(out), "--model", str(model_dir), "--quiet" if quiet else "--no-progress",
                 "--batch-size", "4", "--checkpoint-every", "6", *extra])


# ---------------------------------------------------------------------------------------------
# One writer at a time
# ---------------------------------------------------------------------------------------------
def _hold(lock_path: Path) -> subprocess.Popen:
    """Another process holding the lock of an output, as a running `elmo` would."""
    code = ("import sys\nfrom elmokit.io import output_lock\n"
            f"with output_lock({str(lock_path)!r}, 'output'):\n    print('locked', flush=True)\n    sys.stdin.read()\n")
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert process.stdout.readline().strip() == "locked"
    return process


def _kill(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


def test_second_embed_to_one_output_is_refused_and_a_stale_lock_taken_over(model_dir, source, tmp_path, capsys):
    out = tmp_path / "o.h5"
    holder = _hold(tmp_path / "o.h5.lock")
    try:
        for extra in ([], ["--resume"], ["--overwrite"]):
            assert _embed(source, out, model_dir, *extra) == 2
            one_error_line(capsys, "o.h5 is being written by another process", f"pid {holder.pid}")
            assert not out.exists() and not (tmp_path / "o.h5.partial").exists()
    finally:
        _kill(holder)  # SIGKILL: its lock file stays behind
    assert (tmp_path / "o.h5.lock").exists()
    assert _embed(source, out, model_dir, quiet=False) == 0  # said without -q (with -q: tests/test_outputs_and_inputs.py)
    assert f"stale lock of {out} left by pid {holder.pid}" in capsys.readouterr().err
    assert len(read_embeddings(out)) == len(LINES) and not (tmp_path / "o.h5.lock").exists()


@pytest.fixture
def corpus(tmp_path) -> dict[str, Path]:
    (tmp_path / "train.txt").write_text("the cat sat\na dog ran to the cat\nthe dog sat\n" * 4, encoding="utf-8")
    assert main(["vocab", str(tmp_path / "train.txt"), "-o", str(tmp_path / "vocab.txt")]) == 0
    tiny_config().save(tmp_path / "model.json")
    return {"train": tmp_path / "train.txt", "vocab": tmp_path / "vocab.txt", "model": tmp_path / "model.json"}


def _train(corpus, run: Path, *extra: str) -> int:
    return main(["train", "--train", str(corpus["train"]), "--vocab", str(corpus["vocab"]), "--model",
                 str(corpus["model"]), "--output-dir", str(run), "--batch-size", "2", "--unroll-steps", "4",
                 "--epochs", "1", "--softmax", "full", "--log-every", "1", "--checkpoint-every", "5",
                 "--no-progress", "--device", "cpu", "--threads", "1", *extra])


def test_second_train_in_one_directory_is_refused_and_a_stale_lock_taken_over(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(corpus, run) == 0
    capsys.readouterr()
    before = _snapshot(run)
    holder = _hold(run / "train.lock")
    try:
        for extra in (["--resume"], ["--overwrite"], []):
            assert _train(corpus, run, *extra) == 2
            one_error_line(capsys, f"run directory {run} is being written by another process", f"pid {holder.pid}")
        fresh = tmp_path / "fresh"
        holder_of_new = _hold(fresh / "train.lock")  # a run that has only just started
        try:
            assert _train(corpus, fresh) == 2
            one_error_line(capsys, "being written by another process")
        finally:
            _kill(holder_of_new)
    finally:
        _kill(holder)
    assert {k: v for k, v in _snapshot(run).items() if k != "train.lock"} == before  # untouched
    assert _train(corpus, run, "--overwrite") == 0  # the killed holder's lock is stale
    assert "stale lock" in capsys.readouterr().err
    assert not (run / "train.lock").exists() and (run / "checkpoint.pt").exists()


# ---------------------------------------------------------------------------------------------
# Existing outputs: --overwrite or an error, for every command
# ---------------------------------------------------------------------------------------------
def test_train_never_replaces_a_run_or_its_unfinished_start_unasked(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "train_config.json").write_text("{}")  # a run killed before its first checkpoint
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (run / "notes.txt").write_text("mine")
    before = _snapshot(run)
    capsys.readouterr()
    assert _train(corpus, run) == 2
    one_error_line(capsys, "holds a run (train_config.json, metrics.jsonl)", "--resume", "--overwrite")
    assert _snapshot(run) == before
    assert _train(corpus, run, "--resume", "--overwrite") == 2
    assert _train(corpus, run, "--overwrite") == 0
    assert (run / "notes.txt").read_text() == "mine"  # not a run file: kept
    assert '"loss": 5.0' not in (run / "metrics.jsonl").read_text()


def test_export_refuses_existing_files_even_the_runs_own_best(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(corpus, run) == 0
    best = _snapshot(run / "best")
    capsys.readouterr()
    assert main(["export", str(run), "--last", "--native", str(run / "best")]) == 2
    one_error_line(capsys, "exists", str(run / "best" / "model.safetensors"), "--overwrite")
    assert _snapshot(run / "best") == best
    original = [str(tmp_path / "options.json"), str(tmp_path / "weights.hdf5")]
    assert main(["export", str(run), "--original", *original]) == 0
    written = (tmp_path / "weights.hdf5").read_bytes()
    assert main(["export", str(run), "--original", *original, "--native", str(tmp_path / "new")]) == 2
    one_error_line(capsys, "options.json", "weights.hdf5")
    assert not (tmp_path / "new").exists()  # nothing written when any output exists
    assert (tmp_path / "weights.hdf5").read_bytes() == written
    assert main(["export", str(run), "--last", "--native", str(run / "best"), "--overwrite"]) == 0
    card = json.loads((run / "best" / "provenance.json").read_text())  # the new model's, not the replaced one's
    assert card["model"] == "the run's last checkpoint"


def test_perplexity_per_sentence_refuses_an_existing_file(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(corpus, run) == 0
    scores = tmp_path / "scores.tsv"
    scores.write_text("keep me")
    capsys.readouterr()
    assert main(["perplexity", str(run), str(corpus["train"]), "--per-sentence", str(scores)]) == 2
    one_error_line(capsys, "exists", str(scores), "--overwrite")
    assert scores.read_text() == "keep me"
    assert main(["perplexity", str(run), str(corpus["train"]), "--per-sentence", str(scores), "--overwrite"]) == 0
    assert scores.read_text().startswith("file\tline\tn_targets")


def test_task_train_and_probe_refuse_an_existing_run(tmp_path, capsys):
    out = tmp_path / "task"
    out.mkdir()
    (out / "results.json").write_text('{"test": 97.0}')
    for command in (["task", "train", "--task", "pos", "--model", "none", "--out", str(out)],
                    ["task", "probe", "--out", str(out)]):
        if command[1] == "probe":
            (out / "probes.json").write_text("{}")
        assert main(command) == 2
        one_error_line(capsys, "exists", "--overwrite")
    assert (out / "results.json").read_text() == '{"test": 97.0}' and (out / "probes.json").read_text() == "{}"


def test_vocab_convert_and_plot_refuse_existing_files(model_dir, corpus, tmp_path, capsys):
    vocab = corpus["vocab"]
    kept = vocab.read_bytes()
    capsys.readouterr()
    assert main(["vocab", str(corpus["train"]), "-o", str(vocab), "--min-count", "2"]) == 2
    one_error_line(capsys, "exists", str(vocab))
    assert vocab.read_bytes() == kept
    assert main(["vocab", str(corpus["train"]), "-o", str(vocab), "--min-count", "2", "--overwrite"]) == 0
    capsys.readouterr()  # its report: "... entries written to ..."
    native = tmp_path / "native"
    native.mkdir()
    (native / "config.json").write_text("{}")
    assert main(["convert", "--model", str(model_dir), "--to-native", str(native)]) == 2
    one_error_line(capsys, "config.json", "--overwrite")
    plot = tmp_path / "p.png"
    plot.write_bytes(b"png")
    assert main(["similar", str(corpus["train"]), "--query", "the cat sat", "--word", "cat", "--model",
                 str(model_dir), "--plot", str(plot)]) == 2
    one_error_line(capsys, "p.png", "--overwrite")


def test_embed_never_discards_unfinished_work_unasked(model_dir, source, tmp_path, capsys):
    out = tmp_path / "o.npz"
    partial = tmp_path / "o.npz.partial"
    _fill_disk_at_merge(out, model_dir, source, capsys)  # leaves a finished partial
    before = _snapshot(partial)
    assert _embed(source, out, model_dir) == 2
    one_error_line(capsys, "unfinished work", "--resume", "--overwrite")
    assert _snapshot(partial) == before
    assert _embed(source, out, model_dir, "--overwrite") == 0  # asked: start over
    assert len(read_embeddings(out)) == len(LINES) and not partial.exists()


# ---------------------------------------------------------------------------------------------
# A full disk while embedding
# ---------------------------------------------------------------------------------------------
class _FullDisk(io.FileIO):
    """A new file on a disk that fills after `budget` bytes: then every write fails with ENOSPC,
    as `write(2)` does."""

    def __init__(self, path, budget: int):
        super().__init__(path, "w+")
        self.budget = budget

    def write(self, data) -> int:
        if self.tell() + len(memoryview(data).cast("B")) > self.budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


def _disk_fills(monkeypatch, when, budget: int) -> None:
    from elmokit.inference import segments as embedding

    real = embedding.open_for_writing
    monkeypatch.setattr(embedding, "open_for_writing",
                        lambda path: _FullDisk(path, budget) if when(Path(path)) else real(path))


def _fill_disk_at_merge(out: Path, model_dir: Path, source: Path, capsys, *extra: str) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        _disk_fills(monkeypatch, lambda path: path.name.startswith("merged"), budget=3000)
        assert _embed(source, out, model_dir, *extra) == 1  # the machine failed, not the request
    one_error_line(capsys, "No space left on device", "segments are kept there", "--resume")


@pytest.mark.parametrize("suffix", [".h5", ".npz"])
def test_disk_full_during_the_merge_keeps_the_segments_and_resume_finishes(model_dir, source, tmp_path, capsys,
                                                                          suffix):
    out, clean = tmp_path / f"o{suffix}", tmp_path / f"clean{suffix}"
    partial = Path(f"{out}.partial")
    _fill_disk_at_merge(out, model_dir, source, capsys, "--use-sentence-keys")
    assert not out.exists() and not list(partial.glob("merged*"))  # the half merge is removed
    progress = json.loads((partial / "progress-rank0.json").read_text())
    assert progress["done"] and len(progress["segments"]) == 5  # 30 lines, 6 a segment: all kept
    assert all((partial / name).is_file() for name in progress["segments"])

    assert _embed(source, out, model_dir, "--use-sentence-keys", "--resume", quiet=False) == 0
    assert f"wrote {out}: 0 sentences, " in capsys.readouterr().err  # only the merge was redone
    assert _embed(source, clean, model_dir, "--use-sentence-keys") == 0
    resumed, expected = read_embeddings(out), read_embeddings(clean)
    assert resumed.keys() == expected.keys() and len(resumed) == len(set(LINES))
    for key in expected:
        np.testing.assert_array_equal(resumed[key], expected[key])


@pytest.mark.parametrize("suffix", [".h5", ".npz"])
def test_disk_full_while_embedding_keeps_finished_segments_and_resume_finishes(model_dir, source, tmp_path,
                                                                              capsys, suffix):
    out, clean = tmp_path / f"o{suffix}", tmp_path / f"clean{suffix}"
    partial = Path(f"{out}.partial")
    with pytest.MonkeyPatch.context() as monkeypatch:
        _disk_fills(monkeypatch, lambda path: path.name.startswith("rank0-00002"), budget=2000)
        assert _embed(source, out, model_dir) == 1
    one_error_line(capsys, "No space left on device", str(partial), "--resume")
    progress = json.loads((partial / "progress-rank0.json").read_text())
    assert progress["segments"] == [f"rank0-0000{i}{suffix}" for i in range(2)] and progress["next_line"] == 12
    assert sorted(p.name for p in partial.iterdir()) == sorted(["progress-rank0.json", *progress["segments"]])

    assert _embed(source, out, model_dir, "--resume", quiet=False) == 0
    assert f"wrote {out}: {len(LINES) - 12} sentences, " in capsys.readouterr().err
    assert _embed(source, clean, model_dir) == 0
    resumed, expected = read_embeddings(out), read_embeddings(clean)
    assert resumed.keys() == expected.keys()
    for key in expected:
        np.testing.assert_array_equal(resumed[key], expected[key])


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name the synced files")
def test_embed_syncs_its_segments_and_output(model_dir, source, tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    out = tmp_path / "o.h5"
    assert _embed(source, out, model_dir) == 0
    renamed = [i for i, (event, path) in enumerate(events) if event == "replace" and path.endswith((".h5",))]
    assert len(renamed) == 5 + 1  # every segment, then the output
    for i in renamed:
        assert events[i - 1][0] == "fsync" and events[i + 1][0] == "fsync"
    assert events[renamed[-1]] == ("replace", str(out))


def test_task_predict_refuses_an_existing_output(tmp_path, capsys):
    out = tmp_path / "labelled.txt"
    out.write_text("keep me")
    (tmp_path / "in.txt").write_text("a b\n")
    assert main(["task", "predict", str(tmp_path / "no-run"), str(tmp_path / "in.txt"), "-o", str(out)]) == 2
    one_error_line(capsys, "exists", str(out), "--overwrite")
    assert out.read_text() == "keep me"


def test_an_output_that_is_a_pipe_or_a_directory_is_refused_not_replaced(model_dir, source, tmp_path, capsys):
    """--overwrite onto a FIFO (or /dev/null) would rename a file over it: refused before any work,
    by every writer, and the FIFO is still a FIFO; a directory or an empty name likewise."""
    import os
    import stat

    from elmokit.io import atomic_write_text

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert _embed(source, fifo, model_dir, "--overwrite") == 2
    assert "is not a regular file (a device, a pipe or a socket)" in capsys.readouterr().err
    assert not Path(f"{fifo}.partial").exists()
    assert main(["convert", "--model", str(model_dir), "--to-native", str(fifo), "--overwrite", "--quiet"]) == 2
    capsys.readouterr()
    with pytest.raises(FileExistsError, match="not a regular file"):
        atomic_write_text(fifo, "text")
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        atomic_write_text(tmp_path, "text")
    with pytest.raises(IsADirectoryError, match="empty name"):
        atomic_write_text("", "text")
