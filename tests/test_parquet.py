"""`elmo embed OUTPUT.parquet` (elmokit.inference.parquet): one row per line with its line number,
sentence, tokens and the HDF5 layout's array, in row groups; resumed, locked, merged across ranks
as the other formats; read back by `elmokit.read_embeddings` and by pyarrow as nested lists."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from elmokit import ElmoEmbedder, read_embeddings  # noqa: E402
from elmokit.cli import main  # noqa: E402
from elmokit.inference import parquet, segments  # noqa: E402
from elmokit.inference.files import EmbedOptions, embed_file  # noqa: E402
from elmokit.inference.parquet import embedding_array, embedding_arrays  # noqa: E402

LINES = ["the cat sat on the mat .", "", "colorless green ideas", "a", "naïve café 😀 東京 ."]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _corpus(n: int, seed: int = 1) -> list[str]:
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(50)]
    return [" ".join(rng.choice(words, rng.integers(0, 12))) for _ in range(n)]


@pytest.mark.parametrize("flag", ["--all", "--top", "--average"])
@pytest.mark.parametrize("sentence_vectors", [False, True])
def test_parquet_rows_hold_the_hdf5_arrays(model_dir, tmp_path, flag, sentence_vectors):
    source = _write(tmp_path / "in.txt", LINES)
    extra = ["--sentence-vectors"] if sentence_vectors else []
    common = [flag, *extra, "--model", str(model_dir), "--quiet"]
    assert main(["embed", str(source), str(tmp_path / "o.h5"), *common]) == 0
    assert main(["embed", str(source), str(tmp_path / "o.parquet"), *common]) == 0
    hdf5 = read_embeddings(tmp_path / "o.h5")
    table = pq.read_table(tmp_path / "o.parquet")
    assert table.column_names == ["line", "sentence", "tokens", "embedding"]
    assert table.schema.field("line").type == pa.int64()
    assert table["line"].to_pylist() == list(range(len(LINES)))
    assert table["sentence"].to_pylist() == LINES
    assert table["tokens"].to_pylist() == [line.split() for line in LINES]
    rows = table["embedding"].to_pylist()  # plain pyarrow: nested Python lists
    for key, row in zip(map(str, range(len(LINES))), rows):
        assert np.asarray(row, dtype=np.float32).reshape(hdf5[key].shape).tolist() == hdf5[key].tolist()
    read = read_embeddings(tmp_path / "o.parquet")
    assert read.keys() == hdf5.keys() - {"sentence_to_index"}
    for key, array in read.items():
        assert array.dtype == np.float32 and array.shape == hdf5[key].shape, key
        np.testing.assert_array_equal(array, hdf5[key])


def test_format_flag_forget_sentences_and_sentence_keys(model_dir, tmp_path, capsys):
    source = _write(tmp_path / "in.txt", LINES)
    out = tmp_path / "vectors.bin"
    assert main(["embed", str(source), str(out), "--format", "parquet", "--forget-sentences", "--top",
                 "--model", str(model_dir), "--quiet"]) == 0
    assert pq.read_schema(out).names == ["line", "tokens", "embedding"]  # no sentence column
    assert main(["embed", str(source), str(tmp_path / "k.parquet"), "--use-sentence-keys",
                 "--model", str(model_dir), "--quiet"]) == 2
    assert "use-sentence-keys" in capsys.readouterr().err and not (tmp_path / "k.parquet").exists()


def test_row_groups_bound_memory_and_segments_merge(tiny_model, tmp_path, monkeypatch):
    """Small row groups and segments: the file has many row groups, and the same rows."""
    lines = _corpus(60)
    source = _write(tmp_path / "in.txt", lines)
    embedder = ElmoEmbedder(module=tiny_model)
    embed_file(embedder, source, tmp_path / "big.parquet", EmbedOptions(file_format="parquet"), progress=False)
    monkeypatch.setattr(segments, "ROW_GROUP_BYTES", 3 * 5 * 12 * 4 * 4)  # about 4 rows of 5 tokens
    options = EmbedOptions(file_format="parquet", checkpoint_every=16)
    embed_file(embedder, source, tmp_path / "small.parquet", options, progress=False)
    big, small = pq.ParquetFile(tmp_path / "big.parquet"), pq.ParquetFile(tmp_path / "small.parquet")
    assert big.num_row_groups == 1 and small.num_row_groups >= 12
    assert max(small.metadata.row_group(i).num_rows for i in range(small.num_row_groups)) <= 16
    assert small.read().to_pylist() == big.read().to_pylist()
    assert not (tmp_path / "small.parquet.partial").exists()


class _Crash(RuntimeError):
    pass


class _CrashingEmbedder(ElmoEmbedder):
    """Stops the run (as a kill would) at its `crash_at`-th batch."""

    crash_at = 8  # 5 calls of 2 sentences fill the first segment of 10

    def embed_many(self, sentences, rows=64):
        self.crash_at -= 1
        if self.crash_at == 0:
            raise _Crash("stopped mid-run")
        return super().embed_many(sentences, rows)


def test_interrupted_run_resumes_to_the_same_rows(tiny_model, tmp_path):
    lines = _corpus(80, seed=2)
    source = _write(tmp_path / "in.txt", lines)
    options = EmbedOptions(file_format="parquet", output_format="average", batch_size=2, checkpoint_every=10)
    output = tmp_path / "o.parquet"
    crashing = _CrashingEmbedder(module=tiny_model)
    crashing.STREAM_WINDOW = 1  # one batch of 2 sentences a call: the crash comes after a segment
    with pytest.raises(_Crash):
        embed_file(crashing, source, output, options, progress=False)
    assert not output.exists()
    assert [p.name for p in sorted((tmp_path / "o.parquet.partial").glob("*.parquet"))] == ["rank0-00000.parquet"]
    with pytest.raises(FileExistsError, match="resume=True"):  # not thrown away without being asked
        embed_file(ElmoEmbedder(module=tiny_model), source, output, options, progress=False)
    resumed = embed_file(ElmoEmbedder(module=tiny_model), source, output, options, progress=False, resume=True)
    assert resumed == len(lines) - 10
    embed_file(ElmoEmbedder(module=tiny_model), source, tmp_path / "whole.parquet", options, progress=False)
    whole, again = pq.read_table(tmp_path / "whole.parquet"), pq.read_table(output)
    assert again["line"].to_pylist() == list(range(len(lines)))
    assert again.drop_columns("embedding").to_pylist() == whole.drop_columns("embedding").to_pylist()
    for a, b in zip(embedding_arrays(again["embedding"]), embedding_arrays(whole["embedding"])):
        np.testing.assert_allclose(a, b, atol=1e-6)
    with pytest.raises(FileExistsError):  # a finished output is replaced only with overwrite
        embed_file(ElmoEmbedder(module=tiny_model), source, output, options, progress=False)


def test_two_ranks_write_every_line_once(tiny_model, tmp_path):
    """Two ranks (threads with a barrier, as torchrun's processes): rank 0 merges their segments."""
    lines = _corpus(23, seed=3)
    source = _write(tmp_path / "in.txt", lines)
    options = EmbedOptions(file_format="parquet", output_format="top", checkpoint_every=4)
    barrier = threading.Barrier(2)
    errors = []

    def rank(r: int) -> None:
        try:
            embed_file(ElmoEmbedder(module=tiny_model), source, tmp_path / "two.parquet", options, progress=False,
                       rank=r, world_size=2, barrier=barrier.wait)
        except BaseException as error:  # reported below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    embed_file(ElmoEmbedder(module=tiny_model), source, tmp_path / "one.parquet", options, progress=False)
    two = pq.read_table(tmp_path / "two.parquet").sort_by("line")
    one = pq.read_table(tmp_path / "one.parquet")
    assert two["line"].to_pylist() == list(range(len(lines)))
    assert two.drop_columns("embedding").to_pylist() == one.drop_columns("embedding").to_pylist()
    for a, b in zip(embedding_arrays(two["embedding"]), embedding_arrays(one["embedding"])):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("shapes", [[(3, 5, 4), (3, 0, 4), (3, 2, 4)], [(5, 4), (0, 4), (1, 4)],
                                    [(3, 4), (3, 4)], [(4,), (4,), (4,)]])
def test_embedding_column_round_trip(shapes):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    column = embedding_array(arrays)
    assert column.to_pylist() == [array.tolist() for array in arrays]  # as nested lists
    for start in (0, 1):  # a sliced column (a row group's part) reads its own rows
        back = embedding_arrays(pa.chunked_array([column.slice(start)]))
        assert [b.shape for b in back] == [a.shape for a in arrays[start:]]
        for a, b in zip(arrays[start:], back):
            np.testing.assert_array_equal(a, b)


def test_embedding_column_errors_name_the_problem():
    with pytest.raises(ValueError, match="same axes and last size"):
        embedding_array([np.zeros((2, 4), np.float32), np.zeros((2, 5), np.float32)])
    ragged = pa.array([[[1.0, 2.0], [3.0]]], type=pa.list_(pa.list_(pa.float32())))
    with pytest.raises(ValueError, match="not an embedding column"):
        embedding_arrays(ragged)
    for lists in ([[[1.0]], [[2.0], [3.0]]], [[[1.0], [2.0]], [[3.0]]]):  # more, and fewer, than the first list says
        uneven = pa.array([lists], type=pa.list_(pa.list_(pa.list_(pa.float32(), 1))))
        with pytest.raises(ValueError, match="row 0 .* not rectangular"):
            embedding_arrays(uneven)


def _rows_file(path: Path, lines: list, arrays: list) -> Path:
    """A Parquet file of `elmo embed`'s columns with the given line numbers and arrays (None: null)."""
    column = embedding_array([a for a in arrays if a is not None])
    values = iter(column.to_pylist())
    embedding = pa.array([None if a is None else next(values) for a in arrays], type=column.type)
    pq.write_table(pa.table({"line": pa.array(lines, pa.int64()), "tokens": [["w"]] * len(lines),
                             "embedding": embedding}), path)
    return path


def test_read_embeddings_keys_rows_by_their_line_column(tmp_path):
    """The key is the row's `line`, as a string, not its position in the file."""
    arrays = [np.full((1, 4), value, np.float32) for value in (1.0, 2.0, 3.0)]
    read = read_embeddings(_rows_file(tmp_path / "r.parquet", [10, 3, 7], arrays))
    assert sorted(read) == ["10", "3", "7"]
    for key, value in (("10", 1.0), ("3", 2.0), ("7", 3.0)):
        np.testing.assert_array_equal(read[key], np.full((1, 4), value, np.float32))


def test_read_embeddings_refuses_a_null_or_repeated_row(tmp_path):
    ok = np.zeros((1, 4), np.float32)
    nulls = _rows_file(tmp_path / "null.parquet", [0, 1, 2], [ok, None, ok])
    with pytest.raises(ValueError, match=rf"^{nulls}: row 1: 'embedding' is null; every row of an embeddings file"):
        read_embeddings(nulls)
    pq.write_table(pq.read_table(_rows_file(tmp_path / "x.parquet", [0, 1], [ok, ok])).set_column(
        0, "line", pa.array([0, None], pa.int64())), tmp_path / "noline.parquet")
    with pytest.raises(ValueError, match=r"noline.parquet: row 1: 'line' is null"):
        read_embeddings(tmp_path / "noline.parquet")
    twice = _rows_file(tmp_path / "twice.parquet", [4, 5, 6, 5], [ok, ok, ok, ok])
    with pytest.raises(ValueError, match=rf"^{twice}: rows 1 and 3 have the same line 5; every row of an embeddings"):
        read_embeddings(twice)


def test_read_embeddings_of_many_row_groups_and_two_ranks(tiny_model, tmp_path, monkeypatch):
    """A file of many row groups and one merged from two ranks read back: every line's array, as
    one process writes it in one row group."""
    lines = _corpus(23, seed=5)
    source = _write(tmp_path / "in.txt", lines)
    options = EmbedOptions(file_format="parquet", output_format="top", checkpoint_every=4)
    embed_file(ElmoEmbedder(module=tiny_model), source, tmp_path / "one.parquet", options, progress=False)
    want = read_embeddings(tmp_path / "one.parquet")
    monkeypatch.setattr(segments, "ROW_GROUP_BYTES", 3 * 5 * 12 * 4)  # a few rows a group
    barrier = threading.Barrier(2)
    threads = [threading.Thread(target=embed_file, args=(ElmoEmbedder(module=tiny_model), source,
                                                         tmp_path / "two.parquet", options),
                                kwargs=dict(progress=False, rank=r, world_size=2, barrier=barrier.wait))
               for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert pq.ParquetFile(tmp_path / "two.parquet").num_row_groups >= 6
    got = read_embeddings(tmp_path / "two.parquet")
    assert sorted(got, key=int) == [str(i) for i in range(len(lines))] == sorted(want, key=int)
    for key, array in want.items():
        np.testing.assert_allclose(got[key], array, atol=1e-6, err_msg=key)
