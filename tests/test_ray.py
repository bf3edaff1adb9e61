"""elmokit.ray on a local Ray instance (2 CPUs): `embed_dataset` gives every row the vectors one
process gives it, whatever the split and the number of actors; `elmo embed --ray local` writes a
folder of Parquet files with every line exactly once, even when an actor is killed mid-run."""

from __future__ import annotations

import os
import re
import threading
import time

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

import elmokit.ray as elmo_ray  # noqa: E402
from elmokit import ElmoEmbedder  # noqa: E402
from elmokit.cli import main  # noqa: E402
from elmokit.inference.layers import shape_output  # noqa: E402
from elmokit.inference.parquet import embedding_arrays  # noqa: E402


def _corpus(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(40)] + ["naïve", "東京", "😀"]
    return [" ".join(rng.choice(words, rng.integers(0, 14))) for _ in range(n)]


@pytest.fixture(scope="module")
def local_ray():
    """One Ray instance for the module (starting one takes seconds): 2 CPUs, no dashboard, a small
    object store, usage statistics off; shut down at the end whatever happened."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200_000_000, log_to_driver=False,
             configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield ray
    finally:
        ray.shutdown()


def _one_process(model, sentences: list[str], layers: str, sentence_vectors: bool) -> list[np.ndarray]:
    embedder = ElmoEmbedder(module=model)
    return [shape_output(embedder.embed_sentence(sentence.split()), layers, sentence_vectors)
            for sentence in sentences]


def test_embed_dataset_equals_one_process_whatever_the_split(local_ray, tiny_model, tmp_path, monkeypatch):
    """A Parquet input read in tables of 7 rows (the last of 3) into Ray's blocks, batches of 5 rows,
    2 actors: every row as one process embeds it sentence by sentence, every other column kept,
    `line` added."""
    sentences = _corpus(45, seed=0)
    items = [{"text": text, "id": 100 + i, "label": f"L{i % 3}"} for i, text in enumerate(sentences)]
    pq.write_table(pa.Table.from_pylist(items), tmp_path / "corpus.parquet")
    monkeypatch.setattr(elmo_ray, "ROWS_PER_BLOCK", 7)
    ds, sentence_column = elmo_ray.read_files([tmp_path / "corpus.parquet"])
    assert sentence_column == "text" and ds.materialize().num_blocks() >= 2  # Ray splits it for the 2 actors
    out = elmo_ray.embed_dataset(ds, model=tiny_model, layers="average", batch_size=5, concurrency=2)
    rows = sorted(out.take_all(), key=lambda row: row["line"])
    assert [row["line"] for row in rows] == list(range(len(sentences)))
    want = _one_process(tiny_model, sentences, "average", False)
    for row, item, expected in zip(rows, items, want):
        assert row["text"] == item["text"] and row["label"] == item["label"] and row["id"] == item["id"]
        assert row["tokens"] == item["text"].split()
        got = np.asarray(row["embedding"], dtype=np.float32).reshape(expected.shape)
        np.testing.assert_allclose(got, expected, atol=1e-6, err_msg=f"row {row['line']}")


def _kill_first_actor_once(done: threading.Event, partial, killed: list[int]) -> None:
    """SIGKILL the embedding actor's process once the first output file is written (mid-run)."""
    while not done.is_set():
        if partial.is_dir() and any(partial.glob("*.parquet")):
            for process in psutil.process_iter(["pid", "name"]):
                if "MapBatches(SentenceEmbedder)" in (process.info["name"] or ""):
                    process.kill()
                    killed.append(process.info["pid"])
                    return
        time.sleep(0.01)


def test_cli_on_ray_writes_every_line_once_after_a_killed_actor(local_ray, model_dir, tiny_model, tmp_path,
                                                                 monkeypatch, capsys):
    first, second = _corpus(30, seed=1), _corpus(25, seed=2)
    inputs = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for path, lines in zip(inputs, (first, second)):
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    output = tmp_path / "vectors"
    output.mkdir()
    (output / "old.parquet").write_bytes(b"x")
    command = ["embed", "--ray", "local", "--workers", "1", *map(str, inputs), str(output), "--model",
               str(model_dir), "--top", "--batch-size", "2", "--no-progress"]
    assert main(command) == 2  # a non-empty output is replaced only with --overwrite
    assert "not empty" in capsys.readouterr().err and (output / "old.parquet").exists()
    monkeypatch.setattr(elmo_ray, "ROWS_PER_BLOCK", 5)  # 12 blocks: the kill lands mid-run
    done, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_first_actor_once, args=(done, tmp_path / "vectors.partial", killed))
    killer.start()
    try:
        assert main([*command, "--overwrite"]) == 0
    finally:
        done.set()
        killer.join()
    assert killed, "no actor was killed: the run ended before its first file was written"
    assert not (tmp_path / "vectors.partial").exists() and not (output / "old.parquet").exists()
    table = pa.concat_tables(pq.read_table(path) for path in sorted(output.glob("*.parquet")))
    keys = sorted(zip(table["file"].to_pylist(), table["line"].to_pylist()))
    assert keys == [(str(path), i) for path, n in zip(inputs, (30, 25)) for i in range(n)]  # each once
    table = table.sort_by([("file", "ascending"), ("line", "ascending")])
    sentences = first + second
    assert table["sentence"].to_pylist() == sentences
    want = _one_process(tiny_model, sentences, "top", False)
    for i, (got, expected) in enumerate(zip(embedding_arrays(table["embedding"]), want)):
        np.testing.assert_allclose(got, expected, atol=1e-6, err_msg=f"row {i}")


def test_actor_errors_name_the_column(tiny_model):
    """The actor's callable, run here without Ray: missing or non-text columns, a clash, no rows."""
    actor = elmo_ray.SentenceEmbedder(tiny_model, "text", False, "en", "all", True, "cpu", None, 1)
    empty = actor(pa.table({"text": pa.array([], pa.string())}))
    assert len(empty) == 0 and empty.schema.field("embedding").type == pa.list_(pa.list_(pa.float32(), 12))
    out = actor(pa.table({"text": ["a b", ""]}))
    assert [np.asarray(row).shape for row in out["embedding"].to_pylist()] == [(3, 12), (3, 12)]
    with pytest.raises(KeyError, match="no column 'text'.*has sentence"):
        actor(pa.table({"sentence": ["a"]}))
    with pytest.raises(TypeError, match="column 'text' must hold strings"):
        actor(pa.table({"text": pa.array([None, "a"], pa.string())}))
    with pytest.raises(ValueError, match="already has a column 'tokens'"):
        actor(pa.table({"text": ["a"], "tokens": [["a"]]}))
    with pytest.raises(ValueError, match="output format must be one of"):
        elmo_ray.embed_dataset(None, layers="middle")


def test_cli_refusals_before_ray_starts(model_dir, tmp_path, capsys):
    """What --ray cannot do, and several inputs without it, stop with one line before Ray starts."""
    source = tmp_path / "in.txt"
    source.write_text("a b\n", encoding="utf-8")
    model = ["--model", str(model_dir)]
    assert main(["embed", str(source), str(source), str(tmp_path / "o.h5"), *model]) == 2
    assert "several INPUT files (2) need --ray" in capsys.readouterr().err
    for extra, named in ((["--resume"], "--resume"), (["--format", "npz"], "--format npz"),
                         (["--use-sentence-keys"], "--use-sentence-keys"), (["--workers", "0"], "--workers")):
        assert main(["embed", "--ray", "local", str(source), str(tmp_path / "out"), *extra, *model]) == 2
        assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_input_checks_before_ray_starts(model_dir, tmp_path, capsys, monkeypatch):
    """Flags --ray does not use, Parquet inputs whose sentence column is missing, not text, or
    clashes with what the run adds, and a Parquet input without --ray: one line each, before Ray."""
    source = tmp_path / "in.txt"
    source.write_text("a b\n", encoding="utf-8")
    model = ["--model", str(model_dir)]
    out = str(tmp_path / "out")
    for extra, named in ((["--threads", "2"], "--threads does not apply to --ray"),
                         (["--checkpoint-every", "10"], "--checkpoint-every does not apply"),
                         (["--max-output-gb", "1"], "--max-output-gb does not apply")):
        assert main(["embed", "--ray", "local", str(source), out, *extra, *model]) == 2
        assert named in capsys.readouterr().err
    tables = {"nope": pa.table({"sentence": ["a"]}), "ints": pa.table({"text": pa.array([1, 2])}),
              "tokens": pa.table({"text": ["a"], "tokens": [["a"]]}), "file": pa.table({"text": ["a"], "file": ["x"]})}
    for name, table in tables.items():
        pq.write_table(table, tmp_path / f"{name}.parquet")
    for inputs, said in ((["nope"], "no column 'text' to embed (--text-column); it has sentence"),
                         (["ints"], "column 'text' holds int64, not strings"),
                         (["tokens"], "has a column 'tokens', which elmo embed --ray adds"),
                         (["file", "file"], "has a column 'file', which elmo embed --ray adds")):
        paths = [str(tmp_path / f"{name}.parquet") for name in inputs]
        assert main(["embed", "--ray", "local", *paths, out, *model]) == 2
        assert said in capsys.readouterr().err
    assert main(["embed", str(tmp_path / "nope.parquet"), str(tmp_path / "o.h5"), *model]) == 2
    assert "is a Parquet file: Parquet inputs are read by --ray" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    # --max-length and --overlap reach the actors
    seen = {}
    monkeypatch.setattr(elmo_ray, "embed_files", lambda *args, **kwargs: seen.update(kwargs) or
                        {"rows": 1, "tokens": 2, "files": 1, "seconds": 1.0})
    assert main(["embed", "--ray", "local", str(source), out, "--max-length", "400", "--overlap", "8", *model]) == 0
    assert seen["max_length"] == 400 and seen["overlap"] == 8


def test_a_null_past_the_first_block_is_named_with_its_row_in_the_file(local_ray, model_dir, tmp_path, monkeypatch,
                                                                       capsys):
    """Read in blocks of 5 rows by Ray's read tasks, the null of row 12 is named as row 12 of its
    file (not row 2 of its block), in one line, and nothing is written."""
    path = tmp_path / "nulls.parquet"
    texts = [f"w{i} a" for i in range(20)]
    texts[12] = None
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), path)
    monkeypatch.setattr(elmo_ray, "ROWS_PER_BLOCK", 5)
    out = tmp_path / "out"
    assert main(["embed", "--ray", "local", str(path), str(out), "--model", str(model_dir), "--no-progress"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (f"elmo embed: error: {path}: row 12: 'text' is null; every row needs a sentence (an empty "
                     "string gives an empty one)")
    assert not out.exists() and not (tmp_path / "out.partial").exists()


def test_the_driver_reads_no_line_of_the_corpus(local_ray, model_dir, tiny_model, tmp_path, monkeypatch):
    """`elmo embed --ray` leaves the reading to Ray's read tasks (other processes): with the
    driver's own readers of text and Parquet broken, both kinds embed, each line numbered in its
    file across blocks of 4 rows."""
    from elmokit import textfiles

    def broken(*args, **kwargs):
        raise AssertionError("the driver read the corpus")

    monkeypatch.setattr(textfiles, "open_binary", broken)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", broken)
    monkeypatch.setattr(elmo_ray, "ROWS_PER_BLOCK", 4)
    lines = _corpus(11, seed=4)
    (tmp_path / "a.txt").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    pq.write_table(pa.table({"text": lines, "id": list(range(11))}), tmp_path / "a.parquet")
    for name in ("a.txt", "a.parquet"):
        summary = elmo_ray.embed_files([tmp_path / name], tmp_path / f"out-{name}", model=tiny_model, layers="top",
                                       progress=False)
        table = pq.read_table(tmp_path / f"out-{name}").sort_by("line")
        assert summary["rows"] == 11 and table["line"].to_pylist() == list(range(11)), name
        assert table["sentence" if name == "a.txt" else "text"].to_pylist() == lines, name


def test_the_actor_windows_long_sentences_as_asked(tiny_model):
    """max_length / overlap: a sentence longer than max_length is embedded in overlapping windows,
    as `elmo embed --max-length --overlap` does in one process."""
    from elmokit.inference.files import embed_sentences

    tokens = [f"w{i % 7}" for i in range(30)]
    actor = elmo_ray.SentenceEmbedder(tiny_model, "text", False, "en", "all", False, "cpu", None, 1,
                                      max_length=10, overlap=2)
    got = np.asarray(actor(pa.table({"text": [" ".join(tokens)]}))["embedding"].to_pylist()[0])
    windowed = next(iter(embed_sentences(ElmoEmbedder(module=tiny_model), [tokens], 4, 10, 2)))
    whole = ElmoEmbedder(module=tiny_model).embed_sentence(tokens)
    np.testing.assert_allclose(got, windowed, atol=1e-6)
    assert np.abs(got - whole).max() > 1e-4  # the windows differ from the whole sentence: the flag mattered


def test_connecting_keeps_the_sigterm_handler(tmp_path):
    """ray.init installs a SIGTERM handler that aborts the process; `connect` puts the command's
    back (elmo embed --ray then stops on SIGTERM as on Ctrl-C)."""
    import subprocess
    import sys

    code = ("import signal, ray, elmokit.ray as r\n"
            "handler = lambda *args: None\n"
            "signal.signal(signal.SIGTERM, handler)\n"
            "r.connect('local', 1)\n"
            "print(signal.getsignal(signal.SIGTERM) is handler)\n"
            "ray.shutdown()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert done.stdout.strip().splitlines()[-1] == "True", done.stderr[-2000:]


def test_a_dictionary_encoded_text_column_is_text(tmp_path):
    """pandas' categoricals arrive as dictionary-encoded strings: accepted as the sentence column."""
    path = tmp_path / "cats.parquet"
    pq.write_table(pa.table({"text": pa.array(["a b", "a b", "c"]).dictionary_encode()}), path)
    elmo_ray.check_parquet_inputs([path], "text")  # no error
    pq.write_table(pa.table({"text": pa.array([1, 2]).dictionary_encode()}), tmp_path / "ints.parquet")
    with pytest.raises(ValueError, match="holds int64, not strings"):
        elmo_ray.check_parquet_inputs([tmp_path / "ints.parquet"], "text")


def test_a_parquet_inputs_own_line_column_must_be_unique_integers(local_ray, model_dir, tmp_path, capsys):
    """A Parquet input's `line` identifies its rows: kept (as int64) when integers, unique, never
    null; refused, naming file, column or rows, when text (before Ray), repeated or null."""
    model = ["--model", str(model_dir), "--no-progress"]
    pq.write_table(pa.table({"text": ["a", "b c", "d"], "line": pa.array([10, 3, 7], pa.int32())}), tmp_path / "ok.parquet")
    assert main(["embed", "--ray", "local", str(tmp_path / "ok.parquet"), str(tmp_path / "ok"), *model]) == 0
    table = pq.read_table(tmp_path / "ok").sort_by("line")
    assert table["line"].type == pa.int64() and table["line"].to_pylist() == [3, 7, 10]
    assert table["text"].to_pylist() == ["b c", "d", "a"]
    bad = {"words": (pa.array(["x", "y", "z"]), "column 'line' holds string; a Parquet input's own line column "
                                                 "must hold integers"),
           "twice": (pa.array([4, 9, 4]), "rows 0 and 2 have the same line 4; a Parquet input's own 'line' column "
                                          "must number its rows uniquely"),
           "null": (pa.array([4, None, 5], pa.int64()), "row 1: 'line' is null")}
    for name, (lines, said) in bad.items():
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"text": ["a", "b", "c"], "line": lines}), path)
        assert main(["embed", "--ray", "local", str(path), str(tmp_path / name), *model]) == 2
        assert f"{path}: {said}" in capsys.readouterr().err.strip().splitlines()[-1], name
        assert not (tmp_path / name).exists()


def test_forget_sentences_drops_a_parquet_inputs_text_column(local_ray, model_dir, tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a b", "c"], "id": [5, 6]}), path)
    assert main(["embed", "--ray", "local", str(path), str(tmp_path / "out"), "--forget-sentences", "--model",
                 str(model_dir), "--no-progress"]) == 0
    table = pq.read_table(tmp_path / "out").sort_by("line")
    assert set(table.column_names) == {"id", "line", "tokens", "embedding"}
    assert table["id"].to_pylist() == [5, 6] and table["tokens"].to_pylist() == [["a", "b"], ["c"]]


def test_overwrite_removes_a_stale_partial_of_another_run(local_ray, model_dir, tmp_path):
    """A partial left by another run (its file a Parquet file of other rows) is not carried into
    the output that --overwrite writes."""
    source = tmp_path / "in.txt"
    source.write_text("a b\nc\n", encoding="utf-8")
    (tmp_path / "out.partial").mkdir()
    pq.write_table(pa.table({"line": [99], "sentence": ["stale"]}), tmp_path / "out.partial" / "zzz-stale.parquet")
    command = ["embed", "--ray", "local", str(source), str(tmp_path / "out"), "--model", str(model_dir), "--no-progress"]
    assert main(command) == 2  # not removed without being asked
    assert main([*command, "--overwrite"]) == 0
    assert not (tmp_path / "out.partial").exists() and not list((tmp_path / "out").glob("zzz*"))
    table = pq.read_table(tmp_path / "out").sort_by("line")
    assert table["line"].to_pylist() == [0, 1] and table["sentence"].to_pylist() == ["a b", "c"]


def test_text_column_is_refused_for_text_inputs(model_dir, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("a b\n", encoding="utf-8")
    assert main(["embed", "--ray", "local", str(source), str(tmp_path / "out"), "--text-column", "body", "--model",
                 str(model_dir)]) == 2
    assert capsys.readouterr().err.strip() == (f"elmo embed: error: --text-column body names a column of Parquet "
                                               f"inputs; {source} is text, one sentence a line: leave --text-column out")


def test_an_address_where_nothing_answers_fails_at_once(model_dir, tmp_path, capsys, monkeypatch):
    """Nothing listens on port 1: a ConnectionError naming the address, not Ray's minutes of retries."""
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: pytest.fail("ray.init was called"))
    source = tmp_path / "in.txt"
    source.write_text("a b\n", encoding="utf-8")
    for address in ("127.0.0.1:1", "ray://127.0.0.1:1"):
        assert main(["embed", "--ray", address, str(source), str(tmp_path / "out"), "--model", str(model_dir)]) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith(f"elmo embed: error: --ray {address}: nothing answers at 127.0.0.1:1 within "
                                f"{elmo_ray.CONNECT_TIMEOUT_S} s") and "\n" not in error
    assert not (tmp_path / "out").exists()


def test_more_workers_than_cpus_is_said_once(local_ray, caplog):
    """The fixture's Ray has 2 CPUs: 3 workers are warned of (once), 2 are not."""
    with caplog.at_level("WARNING", logger="elmokit.ray"):
        elmo_ray.warn_if_oversubscribed("auto", 2)
        assert not caplog.records
        elmo_ray.warn_if_oversubscribed("auto", 3)
    assert [record.getMessage() for record in caplog.records] == [
        "--workers 3 is more than the 2 CPUs Ray has here: the actors share them, each with its own copy of the "
        "model in memory"]


def test_the_actor_runs_the_rows_it_is_given(tiny_model, monkeypatch):
    """forward_rows (elmo embed --batch-size under --ray) is the recurrence's rows in the actor."""
    seen = []
    embed_sentences = elmo_ray.embed_sentences
    monkeypatch.setattr(elmo_ray, "embed_sentences", lambda embedder, sentences, rows, *args:
                        seen.append(rows) or embed_sentences(embedder, sentences, rows, *args))
    elmo_ray.SentenceEmbedder(tiny_model, "text", False, "en", "top", False, "cpu", None, 1,
                              forward_rows=3)(pa.table({"text": ["a b", "c", "d e f", "g"]}))
    assert seen == [3]


def test_quiet_silences_rays_info_lines(model_dir, tmp_path):
    """`elmo -q embed --ray local`: no INFO line of Ray's on stderr (its own process: Ray is
    configured when it starts)."""
    import subprocess
    import sys

    source = tmp_path / "in.txt"
    source.write_text("a b\nc\n", encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "elmokit", "-q", "embed", "--ray", "local", str(source),
                           str(tmp_path / "out"), "--model", str(model_dir)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out").is_dir()
    assert [line for line in done.stderr.splitlines() if re.search(r"\sINFO\s", line)] == []
