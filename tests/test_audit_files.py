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



def test_elmo_embed_refuses_a_symbolic_link_at_its_lock(model_dir, tmp_path, capsys):
    from elmokit.cli import main

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "in.txt").write_text("a b\n", encoding="utf-8")
    (tmp_path / "out.hdf5.lock").symlink_to(victim)
    assert main(["embed", str(tmp_path / "in.txt"), str(tmp_path / "out.hdf5"), "--model", str(model_dir)]) == 2
    assert "is not a lock of elmokit" in capsys.readouterr().err
    assert victim.read_text() == "precious\n" and not (tmp_path / "out.hdf5").exists()

# ---------------------------------------------------------------------------------------------
# Defect 16: a UTF-8 byte order mark is not text
# ---------------------------------------------------------------------------------------------
BOM = "\ufeff"


def _embedder(tiny_model):
    from elmokit import ElmoEmbedder

    return ElmoEmbedder(module=tiny_model, device="cpu")


@pytest.mark.parametrize("compressed", [False, True])
def test_a_leading_bom_is_dropped_by_every_reader(tmp_path, compressed):
    import gzip

    from elmokit.textfiles import open_text, read_lines

    path = tmp_path / ("bom.txt.gz" if compressed else "bom.txt")
    data = (BOM + "hello world\nbye\n").encode("utf-8")
    path.write_bytes(gzip.compress(data) if compressed else data)
    assert list(read_lines(path)) == ["hello world", "bye"]
    with open_text(path) as handle:
        assert handle.read() == "hello world\nbye\n"


def test_embed_gives_a_bom_file_the_vectors_of_the_same_file_without_it(tiny_model, tmp_path):
    import h5py

    embedder = _embedder(tiny_model)
    (tmp_path / "bom.txt").write_text(BOM + "hello world\n", encoding="utf-8")
    (tmp_path / "plain.txt").write_text("hello world\n", encoding="utf-8")
    embedder.embed_file(tmp_path / "bom.txt", tmp_path / "bom.h5")
    embedder.embed_file(tmp_path / "plain.txt", tmp_path / "plain.h5")
    with h5py.File(tmp_path / "bom.h5") as bom, h5py.File(tmp_path / "plain.h5") as plain:
        assert json.loads(bom["sentence_to_index"][0]) == {"hello world": "0"}
        assert (bom["0"][()] == plain["0"][()]).all()


def test_prepare_keeps_no_bom_token(tmp_path):
    import gzip

    from elmokit.training.corpus import prepare_corpus

    (tmp_path / "raw.txt").write_text(BOM + "hello world\n", encoding="utf-8")
    prepare_corpus([tmp_path / "raw.txt"], tmp_path / "out", workers=1, pretokenized=True, progress=False)
    shards = sorted((tmp_path / "out").glob("shard-*"))
    text = "".join(gzip.open(shard, "rt", encoding="utf-8").read() for shard in shards)
    assert text == "hello world\n"


def test_a_vocabulary_saved_with_a_bom_loads(tmp_path):
    from elmokit.training.vocab import Vocabulary

    (tmp_path / "vocab.txt").write_text(BOM + "<S>\n</S>\n<UNK>\nthe\n", encoding="utf-8")
    assert len(Vocabulary.load(tmp_path / "vocab.txt")) == 4


# ---------------------------------------------------------------------------------------------
# Defect 19: embed_file refuses to replace an existing output unless overwrite=True
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("as_open_file", [False, True])
def test_embed_file_refuses_an_existing_output_like_the_command(tiny_model, tmp_path, as_open_file):
    embedder = _embedder(tiny_model)
    source = tmp_path / "in.txt"
    source.write_text("hello world\n", encoding="utf-8")
    output = tmp_path / "precious.h5"
    output.write_text("precious\n")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        embedder.embed_file(open(source) if as_open_file else source, output)
    assert output.read_text() == "precious\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.txt", "precious.h5"]
    embedder.embed_file(open(source) if as_open_file else source, output, overwrite=True)
    assert output.read_bytes().startswith(b"\x89HDF")


def test_the_library_embed_file_refuses_by_default_too(tiny_model, tmp_path):
    from elmokit.inference.files import embed_file

    source = tmp_path / "in.txt"
    source.write_text("hello\n", encoding="utf-8")
    (tmp_path / "out.h5").write_text("precious\n")
    with pytest.raises(FileExistsError):
        embed_file(_embedder(tiny_model), source, tmp_path / "out.h5", progress=False)
    assert (tmp_path / "out.h5").read_text() == "precious\n"


# ---------------------------------------------------------------------------------------------
# Defect 21: a sentence key is never a path, in HDF5 nor in a .npz (zip) member name
# ---------------------------------------------------------------------------------------------
def test_sentence_keys_escape_backslashes_and_invert():
    from elmokit.inference.segments import key_sentence, sentence_key

    for sentence in ["\\..\\x", "a\\b", "%5C", "\\", "..\\..\\evil"]:
        key = sentence_key(sentence)
        assert "\\" not in key and key_sentence(key) == sentence


def test_npz_member_names_hold_no_backslash(tiny_model, tmp_path):
    import zipfile

    from elmokit.inference.files import EmbedOptions, embed_file

    source = tmp_path / "in.txt"
    source.write_text("\\.. \\x\nplain\n", encoding="utf-8")
    embed_file(_embedder(tiny_model), source, tmp_path / "out.npz",
               EmbedOptions(file_format="npz", use_sentence_keys=True), progress=False)
    names = zipfile.ZipFile(tmp_path / "out.npz").namelist()
    assert not [name for name in names if "\\" in name], names
    assert "%5C.. %5Cx.npy" in names


# ---------------------------------------------------------------------------------------------
# Defect 9: a tampered progress record is refused, and the merge checks that every line is there
# ---------------------------------------------------------------------------------------------
def _partial_run(tiny_model, tmp_path, monkeypatch):
    """A run stopped just before its merge: OUT.partial holds every segment and a finished record."""
    from elmokit.inference import files

    source = tmp_path / "in.txt"
    source.write_text("".join(f"w{i} x\n" for i in range(7)), encoding="utf-8")
    output = tmp_path / "out.h5"

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(files, "merge_segments", stop)
        with pytest.raises(KeyboardInterrupt):
            files.embed_file(_embedder(tiny_model), source, output, files.EmbedOptions(checkpoint_every=2),
                             progress=False)
    record_path = tmp_path / "out.h5.partial" / "progress-rank0.json"
    return source, output, record_path, json.loads(record_path.read_text())


def _resume(tiny_model, source, output):
    from elmokit.inference.files import EmbedOptions, embed_file

    return embed_file(_embedder(tiny_model), source, output, EmbedOptions(checkpoint_every=2), resume=True,
                      progress=False)


def test_a_progress_record_naming_a_file_outside_its_folder_is_refused(tiny_model, tmp_path, monkeypatch):
    source, output, record_path, record = _partial_run(tiny_model, tmp_path, monkeypatch)
    assert record["done"] and len(record["segments"]) == 4
    other = tmp_path / "other.h5"
    (record_path.parent / record["segments"][0]).rename(other)
    record["segments"][0] = str(other)
    record_path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="not a segment of rank 0.*overwrite=True"):
        _resume(tiny_model, source, output)
    assert not output.exists() and other.exists()


def test_a_merge_missing_lines_is_refused(tiny_model, tmp_path, monkeypatch):
    source, output, record_path, record = _partial_run(tiny_model, tmp_path, monkeypatch)
    record.update(next_line=10**9, segments=record["segments"][:1], done=True)
    record_path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="lines 3-4 of .* are in no segment"):
        _resume(tiny_model, source, output)
    assert not output.exists()


def test_a_segment_holding_other_lines_is_refused(tiny_model, tmp_path, monkeypatch):
    source, output, record_path, record = _partial_run(tiny_model, tmp_path, monkeypatch)
    record["segments"][1] = record["segments"][0]
    record_path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="does not hold lines 3-4"):
        _resume(tiny_model, source, output)
    assert not output.exists()


@pytest.mark.parametrize("text", ["{}", "[1, 2]", '{"identity": {}, "next_line": 1.5, "segments": [], "done": true}',
                                  "not json"])
def test_a_progress_record_of_the_wrong_shape_is_an_error_not_a_traceback(tiny_model, tmp_path, monkeypatch, text):
    source, output, record_path, _ = _partial_run(tiny_model, tmp_path, monkeypatch)
    record_path.write_text(text)
    with pytest.raises(ValueError, match="not a progress record of elmo embed"):
        _resume(tiny_model, source, output)


# ---------------------------------------------------------------------------------------------
# Defect 2: a line has a length limit, checked before the line is held whole
# ---------------------------------------------------------------------------------------------
def test_a_gzip_bomb_of_one_line_is_refused_without_reading_it_whole(tmp_path):
    import gzip
    import tracemalloc

    from elmokit.textfiles import LineTooLongError, read_lines

    bomb = tmp_path / "bomb.txt.gz"
    with gzip.open(bomb, "wb", compresslevel=1) as handle:
        handle.write(b"fine\n")
        for _ in range(64):
            handle.write(bytes(1 << 20))  # 64 MiB of NULs on line 2
    tracemalloc.start()
    try:
        with pytest.raises(LineTooLongError, match=r"bomb.txt.gz:2: a line longer than 8,388,608 bytes"):
            list(read_lines(bomb))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 24 * 2**20, peak


@pytest.fixture
def short_lines(monkeypatch, tmp_path):
    """A 100-byte line limit, and a file whose third line is 101 bytes."""
    monkeypatch.setenv("ELMOKIT_MAX_LINE_BYTES", "100")
    path = tmp_path / "long.txt"
    path.write_text("a b\n" + "x" * 100 + "\n" + "y " * 50 + "z\nc\n", encoding="utf-8")
    return path


def test_every_reader_names_the_file_and_line_of_a_line_too_long(short_lines, tmp_path, tiny_model):
    from elmokit.inference.files import embed_file
    from elmokit.training.corpus import prepare_corpus
    from elmokit.training.vocab import count_tokens

    where = f"{short_lines}:3: a line longer than 100 bytes"
    with pytest.raises(ValueError, match=where):
        embed_file(_embedder(tiny_model), short_lines, tmp_path / "out.h5", progress=False)
    with pytest.raises(ValueError, match=where):
        prepare_corpus([short_lines], tmp_path / "shards", workers=1, pretokenized=True, progress=False)
    with pytest.raises(ValueError, match=where):
        count_tokens([short_lines])
    assert not (tmp_path / "out.h5").exists()


def test_the_command_prints_the_limit_as_one_line(short_lines, tmp_path, model_dir, capsys):
    from elmokit.cli import main

    assert main(["embed", str(short_lines), str(tmp_path / "o.h5"), "--model", str(model_dir), "-q"]) != 0
    error = capsys.readouterr().err
    assert f"{short_lines}:3: a line longer than 100 bytes" in error and "Traceback" not in error


# ---------------------------------------------------------------------------------------------
# Defect 15: the merge's sentence index is streamed, not built in memory
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_sentence_keys", [False, True])
def test_the_sentence_index_is_the_json_of_the_dict_with_the_last_line_winning(tmp_path, use_sentence_keys):
    from elmokit.inference.files import write_sentence_index
    from elmokit.inference.segments import sentence_key

    lines = ["a b", "", "c \"q\" \\ é", "a b", "x", "", "a b", "sentence_to_index", "\x00"]
    source = tmp_path / "in.txt"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    write_sentence_index(source, use_sentence_keys, tmp_path / "index.json")
    expected = {line: (sentence_key(line) if use_sentence_keys else str(i)) for i, line in enumerate(lines)}
    assert (tmp_path / "index.json").read_text(encoding="ascii") == json.dumps(expected)


def test_the_sentence_index_takes_memory_by_line_not_by_text(tmp_path):
    import tracemalloc

    from elmokit.inference.files import write_sentence_index

    source = tmp_path / "in.txt"
    line = "\x00" * 2000  # escaped 6 times over in the JSON
    with open(source, "w", encoding="utf-8") as handle:
        for i in range(4000):  # 8 MB of text, 48 MB of JSON
            handle.write(f"{i} {line}\n")
    tracemalloc.start()
    try:
        write_sentence_index(source, False, tmp_path / "index.json")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (tmp_path / "index.json").stat().st_size > 48_000_000
    assert peak < 4 * 2**20, peak


@pytest.mark.parametrize("suffix", [".h5", ".npz"])
def test_the_output_index_reads_back_as_before(tiny_model, tmp_path, suffix):
    from elmokit.inference.files import EmbedOptions, embed_file

    source = tmp_path / "in.txt"
    source.write_text("a b\nc\na b\n", encoding="utf-8")
    output = tmp_path / f"out{suffix}"
    embed_file(_embedder(tiny_model), source, output, EmbedOptions(file_format=suffix.strip(".").replace("h5", "hdf5")),
               progress=False)
    if suffix == ".npz":
        import numpy as np

        with np.load(output, allow_pickle=False) as archive:
            index = archive["sentence_to_index"]
            assert index.shape == () and index.dtype.kind == "U"
            text = str(index)
    else:
        import h5py

        with h5py.File(output) as file:
            text = file["sentence_to_index"][0]
            assert file["sentence_to_index"].shape == (1,)
    assert json.loads(text) == {"a b": "2", "c": "1"}


# ---------------------------------------------------------------------------------------------
# Defect 22 (embed's part): SIGTERM stops a run as Ctrl-C does; --resume and --overwrite exclude
# each other, as in elmo train
# ---------------------------------------------------------------------------------------------
def test_sigterm_stops_embed_cleanly_and_the_run_resumes(model_dir, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    source = tmp_path / "in.txt"
    source.write_text("".join(f"w{i % 50} x{i % 7} y z\n" for i in range(2000)), encoding="utf-8")
    output = tmp_path / "out.h5"
    partial = tmp_path / "out.h5.partial"
    command = [sys.executable, "-m", "elmokit", "embed", str(source), str(output), "--model", str(model_dir),
               "--no-progress", "--batch-size", "4", "--checkpoint-every", "50"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    record = partial / "progress-rank0.json"
    while process.poll() is None:
        if record.exists() and len(json.loads(record.read_text() or "{}").get("segments", [])) >= 1:
            break
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate()
    assert not output.exists(), "the run ended before it could be stopped"
    assert process.returncode == 130, stderr
    assert "interrupted: SIGTERM" in stderr and "--resume" in stderr
    assert not (tmp_path / "out.h5.lock").exists()
    assert not [path.name for path in partial.iterdir() if path.name.endswith(".tmp")]
    resumed = subprocess.run(command + ["--resume"], env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert output.exists() and not partial.exists()


def test_resume_and_overwrite_together_are_refused_as_train_refuses_them(model_dir, tmp_path, capsys):
    from elmokit.cli import main
    from elmokit.inference.files import embed_file

    source = tmp_path / "in.txt"
    source.write_text("a b\n", encoding="utf-8")
    with pytest.raises(ValueError, match="resume=True .* or overwrite=True .*, not both"):
        embed_file(None, source, tmp_path / "o.h5", resume=True, overwrite=True)
    assert main(["embed", str(source), str(tmp_path / "o.h5"), "--model", str(model_dir), "--resume",
                 "--overwrite"]) == 2
    assert "give --resume (continue the unfinished run) or --overwrite (start over), not both" in capsys.readouterr().err
    assert not (tmp_path / "o.h5").exists()


def test_embed_threads_are_bounded_as_train_threads_are(tmp_path, model_dir, capsys):
    """elmo embed --threads beyond the machine is refused by name, as elmo train's is (defect 12)."""
    from elmokit.cli import main
    from elmokit.training.config import max_threads

    (tmp_path / "in.txt").write_text("a b\n", encoding="utf-8")
    assert main(["embed", str(tmp_path / "in.txt"), str(tmp_path / "out.h5"), "--model", str(model_dir),
                 "--threads", str(max_threads() + 1)]) == 2
    assert f"--threads must be from 1 to {max_threads()}" in capsys.readouterr().err
    assert not (tmp_path / "out.h5").exists()
