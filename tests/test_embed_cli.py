"""`elmo embed` and its engine (elmokit.inference.files) on a tiny model: layouts, long sentences,
bad input, a killed run resumed, and two processes under torchrun."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from elmokit import ElmoEmbedder
from elmokit.cli import main
from elmokit.inference.files import embed_sentences, split_windows
from tests.conftest import REPO

SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}






def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _read_all(path: Path) -> dict[str, np.ndarray]:
    if path.suffix == ".npz":
        with np.load(path) as archive:
            return {key: archive[key] for key in archive.files}
    with h5py.File(path) as file:
        return {key: file[key][()] for key in file}


LINES = ["the cat sat on the mat .", "", "colorless green ideas", "a"]


@pytest.mark.parametrize("flag, per_token, per_sentence", [
    ("--all", (3, 7, 12), (3, 12)), ("--top", (7, 12), (12,)), ("--average", (7, 12), (12,))])
def test_layouts_hdf5_npz_and_sentence_vectors(model_dir, tiny_model, tmp_path, flag, per_token, per_sentence):
    source = _write(tmp_path / "in.txt", LINES)
    model = ["--model", str(model_dir), "--quiet"]
    assert main(["embed", str(source), str(tmp_path / "o.h5"), flag, *model]) == 0
    assert main(["embed", str(source), str(tmp_path / "o.npz"), flag, *model]) == 0
    assert main(["embed", str(source), str(tmp_path / "s.h5"), flag, "--sentence-vectors", *model]) == 0
    hdf5, npz, sentences = (_read_all(tmp_path / name) for name in ("o.h5", "o.npz", "s.h5"))
    assert set(hdf5) == set(npz) == set(sentences) == {"0", "1", "2", "3", "sentence_to_index"}
    assert hdf5["0"].shape == per_token and hdf5["1"].shape[-2] == 0  # blank line: empty, key kept
    assert sentences["0"].shape == per_sentence and not sentences["1"].any()
    layers = ElmoEmbedder(module=tiny_model).embed_sentence(LINES[0].split())  # (3, 7, 12)
    want = {"--all": layers, "--top": layers[2], "--average": (layers[0] + layers[1] + layers[2]) / 3}[flag]
    np.testing.assert_allclose(hdf5["0"], want, atol=1e-6)
    for key, line in zip(("0", "1", "2", "3"), LINES):  # each vector from the same run's per-token output
        n_tokens = len(line.split())
        tokens = [np.take(hdf5[key], i, axis=-2) for i in range(n_tokens)]  # every token, the first included
        want = sum(tokens) / n_tokens if n_tokens else np.zeros(per_sentence, np.float32)
        np.testing.assert_allclose(sentences[key], want, atol=1e-6, err_msg=f"line {key}: {line!r}")
    for key in ("0", "1", "2", "3"):
        np.testing.assert_array_equal(hdf5[key], npz[key])
    assert json.loads(hdf5["sentence_to_index"][0]) == json.loads(str(npz["sentence_to_index"])) == {
        "the cat sat on the mat .": "0", "": "1", "colorless green ideas": "2", "a": "3"}


def test_sentence_keys_tokenize_and_forget(model_dir, tmp_path):
    source = _write(tmp_path / "raw.txt", ["Hello, world!", "Hello, world!", "It's done."])
    out = tmp_path / "o.h5"
    assert main(["embed", str(source), str(out), "--top", "--tokenize", "--use-sentence-keys",
                 "--forget-sentences", "--model", str(model_dir), "--quiet"]) == 0
    data = _read_all(out)
    assert set(data) == {"Hello, world!", "It's done."}  # a repeated sentence is stored once
    assert data["Hello, world!"].shape == (4, 12)  # Moses: Hello , world !


def test_split_windows_tile_the_sentence():
    for n_tokens in (1, 80, 81, 200, 1001):
        windows = split_windows(n_tokens, 80, 32)
        kept = [i for start, end, keep_from, keep_to in windows for i in range(keep_from, keep_to)]
        assert kept == list(range(n_tokens))
        for start, end, keep_from, keep_to in windows:
            assert end - start <= 80 and start <= keep_from and keep_to <= end
            assert keep_from - start >= 32 or start == 0
            assert end - keep_to >= 32 or end == n_tokens


def test_long_sentences_are_windowed_not_dropped(tiny_model):
    """With random tiny weights the context fades slowly: with 32 tokens of context on each side
    the top layer agrees with the unwindowed result to 0.05 (observed 0.048; values up to ~0.8),
    and the agreement improves with the overlap. Layer 0 is context-free, hence exact."""
    embedder = ElmoEmbedder(module=tiny_model)
    sentence = list(np.random.default_rng(0).choice([f"w{i}" for i in range(50)], 300))
    full = embedder.embed_sentence(sentence)
    direct = next(embed_sentences(embedder, [sentence], max_length=1000))
    np.testing.assert_allclose(direct, full, atol=1e-6)
    errors = {}
    for overlap in (8, 32):
        windowed = next(embed_sentences(embedder, [sentence, ["short"]], max_length=80, overlap=overlap))
        assert windowed.shape == full.shape
        np.testing.assert_allclose(windowed[0], full[0], atol=1e-6)
        errors[overlap] = np.abs(windowed[2] - full[2]).max()
    assert errors[32] < 0.1 and errors[32] < errors[8]


def test_bad_input_is_one_line_and_writes_nothing(model_dir, tmp_path, capsys):
    out = tmp_path / "o.h5"
    model = ["--model", str(model_dir), "--quiet"]

    def fails(source, *extra, expect: str, target=out) -> None:
        assert main(["embed", str(source), str(target), *model, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert expect in err and len(err.splitlines()) == 1, err
        assert not Path(str(target) + ".partial").exists()

    fails(tmp_path / "missing.txt", expect="missing.txt")
    (tmp_path / "folder").mkdir()  # a folder given as the input file (the output outside it)
    fails(tmp_path / "folder", expect="is a directory")
    (tmp_path / "empty.txt").write_text("")
    fails(tmp_path / "empty.txt", expect="empty")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("good line\ncaf\xe9\n".encode("latin-1"))
    fails(bad, expect="latin1.txt:2: invalid UTF-8")
    blank = _write(tmp_path / "blank.txt", ["a", ""])
    fails(blank, expect="is a directory", target=tmp_path / "folder")
    fails(blank, "--max-length", "10", "--overlap", "5", expect="max-length")
    assert not out.exists()
    out.write_text("keep me")
    fails(blank, expect="--overwrite")
    assert out.read_text() == "keep me"
    assert main(["embed", str(blank), str(out), *model, "--overwrite"]) == 0
    assert set(_read_all(out)) == {"0", "1", "sentence_to_index"}


def _embed_command(source: Path, output: Path, model_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "elmokit", "embed", str(source), str(output), "--model", str(model_dir),
            "--no-progress", "--batch-size", "8", *extra]


def test_killed_run_resumes_to_the_same_file(model_dir, tmp_path):
    rng = np.random.default_rng(1)
    words = [f"w{i}" for i in range(200)]
    lines = [" ".join(rng.choice(words, rng.integers(0, 30))) for _ in range(1000)]
    source = _write(tmp_path / "in.txt", lines)
    output = tmp_path / "killed.h5"
    partial = tmp_path / "killed.h5.partial"
    process = subprocess.Popen(_embed_command(source, output, model_dir, "--checkpoint-every", "50"),
                               env=SUBPROCESS_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    progress = partial / "progress-rank0.json"
    while process.poll() is None:  # no deadline: a slow machine only takes longer to get there
        if progress.exists() and len(json.loads(progress.read_text() or "{}").get("segments", [])) >= 2:
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not output.exists() and partial.is_dir(), "the run ended before it could be killed"

    again = subprocess.run(_embed_command(source, output, model_dir, "--checkpoint-every", "50", "--resume"),
                           env=SUBPROCESS_ENV, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    report = [line for line in again.stderr.splitlines() if line.startswith(f"wrote {output}: ")]
    resumed = int(report[0].split(": ")[1].split()[0].replace(",", ""))  # this run's sentences only
    assert 0 < resumed < len(lines) - 50 and not partial.exists()
    assert main(["embed", str(source), str(tmp_path / "whole.h5"), "--model", str(model_dir), "--quiet"]) == 0
    whole, killed = _read_all(tmp_path / "whole.h5"), _read_all(output)
    assert whole.keys() == killed.keys()
    for key in whole:
        if key != "sentence_to_index":
            np.testing.assert_allclose(killed[key], whole[key], atol=1e-6)
    assert json.loads(killed["sentence_to_index"][0]) == json.loads(whole["sentence_to_index"][0])


def test_resume_refuses_another_input(model_dir, tmp_path, capsys):
    source = _write(tmp_path / "in.txt", ["a b", "c"])
    partial = tmp_path / "o.h5.partial"
    partial.mkdir()
    identity = {"input": {}, "options": {}, "model": "", "world_size": 1}
    (partial / "progress-rank0.json").write_text(json.dumps(
        {"identity": identity, "next_line": 1, "segments": [], "done": False}))
    assert main(["embed", str(source), str(tmp_path / "o.h5"), "--model", str(model_dir), "--resume"]) == 2
    assert "cannot resume" in capsys.readouterr().err and partial.is_dir()


def test_torchrun_two_processes_equal_one(model_dir, tmp_path):
    """torchrun as `python -m torch.distributed.run`: torch ships it, so the test always runs."""
    source = _write(tmp_path / "in.txt", [" ".join(f"w{j}" for j in range(i % 13)) for i in range(41)])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "elmokit", "embed", str(source), str(tmp_path / "two.npz"), "--model", str(model_dir),
               "--quiet", "--top", "--checkpoint-every", "7"]
    result = subprocess.run(command, env=SUBPROCESS_ENV, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert main(["embed", str(source), str(tmp_path / "one.npz"), "--model", str(model_dir), "--quiet",
                 "--top"]) == 0
    one, two = _read_all(tmp_path / "one.npz"), _read_all(tmp_path / "two.npz")
    assert one.keys() == two.keys() and len(one) == 42
    for key in one.keys() - {"sentence_to_index"}:
        np.testing.assert_allclose(two[key], one[key], atol=1e-6)
    assert str(one["sentence_to_index"]) == str(two["sentence_to_index"])
    assert not (tmp_path / "two.npz.partial").exists()


def test_windows_bound_sentences_and_tokens_held_at_once():
    from elmokit.inference.windows import position_windows

    sentences = [["w"] * n for n in (3, 4, 10, 1, 1, 1, 2, 30, 2)]
    windows = list(position_windows(sentences, max_sentences=3, max_positions=12))
    assert [s for window in windows for s in window] == sentences  # everything, in order
    for window in windows:  # positions = tokens + 2 boundaries a sentence
        assert len(window) <= 3
        assert sum(len(s) + 2 for s in window) <= 12 or len(window) == 1  # a longer sentence goes alone
    assert [list(map(len, w)) for w in windows] == [[3, 4], [10], [1, 1, 1], [2], [30], [2]]


def test_malloc_threshold_is_set_unless_the_user_chose_one(monkeypatch):
    import ctypes.util

    from elmokit.inference.files import fix_malloc_mmap_threshold

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "33554432")
    assert fix_malloc_mmap_threshold() is False  # the user's choice stands
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    is_glibc = platform.libc_ver()[0] == "glibc" and ctypes.util.find_library("c") is not None
    assert fix_malloc_mmap_threshold() is is_glibc


def test_resume_at_another_batch_size_warns_and_goes_on(tmp_path, caplog):
    """Another batch size changes the vectors in float32's last bits only: a resume says so and goes
    on (a user halving it after running out of memory keeps the work); any other change is refused."""
    from elmokit.inference.files import start_progress

    partial = tmp_path / "o.h5.partial"
    partial.mkdir()
    made = {"input": {"size": 3}, "options": {"output_format": "all"}, "model": "m", "world_size": 1, "batch_size": 64}
    first = start_progress(partial, 0, made, resume=False)
    first.next_line, first.segments = 10, []
    first.save()
    with caplog.at_level("WARNING", logger="elmokit"):
        resumed = start_progress(partial, 0, {**made, "batch_size": 16}, resume=True)
    assert resumed.next_line == 10 and resumed.identity["batch_size"] == 16
    assert "at 16 rows, where it was made at 64 rows" in caplog.text and "not bit for bit" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="elmokit"):  # no batch size given: the engine's rows
        start_progress(partial, 0, {**made, "batch_size": None}, resume=True)
    assert "at the engine's rows, where it was made at 16 rows" in caplog.text
    with pytest.raises(ValueError, match="cannot resume .* different model;"):
        start_progress(partial, 0, {**made, "model": "other", "batch_size": 8}, resume=True)
    caplog.clear()
    with caplog.at_level("WARNING", logger="elmokit"):  # the same rows, other segments: no word of rounding
        start_progress(partial, 0, {**made, "batch_size": None, "checkpoint_every": 7}, resume=True)
    assert "not bit for bit" not in caplog.text


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_sigterm_lost_in_a_finalizer_still_stops_the_run(model_dir, tmp_path, monkeypatch):
    """SIGTERM's KeyboardInterrupt raised inside a finalizer is printed and dropped by Python; the
    run stops at its next group all the same (exit 130, the finished segments kept), not at the end."""
    from elmokit.inference import files

    source = _write(tmp_path / "in.txt", [" ".join(["word"] * (1 + i % 5)) for i in range(40)])
    output = tmp_path / "out.h5"
    real, groups_seen = files.embed_sentence_groups, []

    class Finalized:
        def __del__(self):  # where the signal's handler happens to run
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)

    def groups(*args, **kwargs):
        for group in real(*args, **kwargs):
            groups_seen.append(len(group))
            if len(groups_seen) == 1:
                Finalized()  # the interrupt raised in __del__ is lost
            yield group

    monkeypatch.setattr(files, "embed_sentence_groups", groups)
    command = ["embed", str(source), str(output), "--model", str(model_dir), "--no-progress", "--checkpoint-every", "4",
               "--batch-size", "2"]
    assert main(command) == 130
    assert not output.exists() and (tmp_path / "out.h5.partial").is_dir() and len(groups_seen) == 1
