"""Embeddings as Parquet rows (pyarrow, the `parquet` extra): `elmo embed OUTPUT.parquet`'s file,
its partial segments, and the columns `elmokit.ray.embed_dataset` adds to a Ray dataset.

One row per input line:

    line       int64          0-based line number in the input
    sentence   string         the line's text (absent with `forget_sentences`)
    tokens     list<string>   the tokens that were embedded
    embedding  nested lists of float32: the array `elmo embed` writes to HDF5 for that line
               (`layers.shape_output`): (L+1, T, D) with "all", (T, D) with "top" or "average",
               (L+1, D) or (D,) with sentence vectors; every axis a list, the last (D = 2P
               features) a fixed-size list. pyarrow, pandas and Spark read it as nested lists;
               `embedding_arrays` (and `elmokit.read_embeddings`) as numpy arrays.

`embedding_array` and `embedding_arrays` convert between a list of arrays and that column in
a few numpy operations over the whole batch (no Python loop over tokens). `ParquetSegment` writes
rows in row groups of about `ROW_GROUP_BYTES` of vectors (memory stays flat), and reads a file
row group by row group; `elmokit.inference.files` uses it as it uses the HDF5 and .npz segments.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from elmokit.extras import require

PARQUET_MAGIC = b"PAR1"
ROW_GROUP_BYTES = 32 << 20  # vectors buffered before a row group is written (memory stays flat)


class SentenceRow(NamedTuple):
    """What a row-per-sentence output (Parquet) stores beside a sentence's array; the HDF5 and
    .npz segments keep the array under its key alone."""

    line: int  # 0-based line number in the input
    sentence: str | None  # the line's text; None: not written (forget_sentences)
    tokens: list[str]


def _pyarrow(purpose: str = "Parquet output") -> Any:
    require("parquet", purpose, ("pyarrow",))
    import pyarrow

    return pyarrow


def is_parquet(path: str | Path) -> bool:
    """Whether `path` is a Parquet file (it starts with the format's magic bytes)."""
    with open(path, "rb") as handle:
        return handle.read(4) == PARQUET_MAGIC


# ---------------------------------------------------------------------------------------------
# Arrays <-> the embedding column
# ---------------------------------------------------------------------------------------------
def embedding_type(ndim: int, dim: int) -> Any:
    """The Arrow type of an embedding of `ndim` axes whose last has `dim` features: `ndim - 1`
    nested lists around a fixed-size list of `dim` float32."""
    pa = _pyarrow()
    arrow_type = pa.list_(pa.float32(), dim)
    for _ in range(ndim - 1):
        arrow_type = pa.list_(arrow_type)
    return arrow_type


def embedding_array(arrays: Sequence[np.ndarray]) -> Any:
    """float32 arrays with the same number of axes and the same last size D -> one Arrow array,
    a row each (see the module docstring); the values are copied once, into one buffer."""
    pa = _pyarrow()
    if not arrays:
        raise ValueError("embedding_array needs at least one array (its shape gives the column's type)")
    ndim, dim = arrays[0].ndim, arrays[0].shape[-1] if arrays[0].ndim else 0
    if ndim == 0 or any(array.ndim != ndim or array.shape[-1] != dim for array in arrays):
        raise ValueError(f"every embedding of a column must have the same axes and last size; got "
                         f"{sorted({array.shape for array in arrays}, key=len)[:3]}")
    shapes = np.array([array.shape for array in arrays], dtype=np.int64)  # (rows, ndim)
    flat = np.concatenate([np.asarray(array, dtype=np.float32).reshape(-1) for array in arrays])
    column = pa.FixedSizeListArray.from_arrays(pa.array(flat, type=pa.float32()), dim)
    for axis in reversed(range(ndim - 1)):  # one list per element of the axes before `axis`
        lengths = np.repeat(shapes[:, axis], shapes[:, :axis].prod(axis=1))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        column = pa.ListArray.from_arrays(pa.array(offsets), column)
    return column


def embedding_arrays(column: Any) -> list[np.ndarray]:
    """An embedding column (an Arrow array or chunked array, as `embedding_array` writes it) -> one
    float32 numpy array a row, views of the column's buffer; ValueError for a row that is not
    rectangular (lists of different lengths on one axis) or a column of another type."""
    chunks = column.chunks if hasattr(column, "chunks") else [column]
    return [array for chunk in chunks for array in _chunk_arrays(chunk)]


def _chunk_arrays(chunk: Any) -> list[np.ndarray]:
    pa = _pyarrow()
    starts = np.arange(len(chunk), dtype=np.int64)  # each row's elements at the current level
    ends = starts + 1
    sizes, level = [], chunk  # sizes: per axis, each row's length on it
    while pa.types.is_list(level.type) or pa.types.is_large_list(level.type):
        offsets = level.offsets.to_numpy().astype(np.int64)
        offsets -= offsets[0]  # a sliced array's offsets start past 0
        first = np.minimum(starts, len(offsets) - 2)
        sizes.append(np.where(ends > starts, offsets[first + 1] - offsets[first], 0))
        starts, ends = offsets[starts], offsets[ends]
        level = level.flatten()
    if not (pa.types.is_fixed_size_list(level.type) and pa.types.is_float32(level.type.value_type)):
        raise ValueError(f"not an embedding column: expected nested lists of a fixed-size list of float32, "
                         f"got {chunk.type}")
    dim = level.type.list_size
    values = level.flatten().to_numpy(zero_copy_only=False)
    starts, ends = starts * dim, ends * dim
    arrays = []
    for row in range(len(chunk)):
        shape = (*(int(size[row]) for size in sizes), dim)
        if int(np.prod(shape)) != ends[row] - starts[row]:
            raise ValueError(f"row {row} of the embedding column is not rectangular: {ends[row] - starts[row]} "
                             f"values, its first lists give the shape {shape}")
        arrays.append(values[starts[row]:ends[row]].reshape(shape))
    return arrays


def rows_table(rows: Sequence[SentenceRow], arrays: Sequence[np.ndarray]) -> Any:
    """`rows` and their arrays -> a pyarrow Table with the columns line, sentence (unless the rows
    hold None), tokens and embedding."""
    pa = _pyarrow()
    columns = {"line": pa.array([row.line for row in rows], type=pa.int64())}
    if rows and rows[0].sentence is not None:
        columns["sentence"] = pa.array([row.sentence for row in rows], type=pa.string())
    columns["tokens"] = pa.array([row.tokens for row in rows], type=pa.list_(pa.string()))
    columns["embedding"] = embedding_array(arrays)
    return pa.table(columns)


# ---------------------------------------------------------------------------------------------
# A Parquet file as a segment of `elmo embed` (the partial pieces and the merged output alike)
# ---------------------------------------------------------------------------------------------
class ParquetSegment:
    """Rows written in row groups of about `row_group_bytes` of vectors, or a file to read.

    The file is written through a Python file object, so that a full disk is an OSError; it is
    complete (with Parquet's footer) only once `close` returns. `abort` removes it."""

    suffix = ".parquet"
    sentence_index = False  # the rows hold their sentence; no sentence_to_index

    def __init__(self, path: str | Path, mode: str = "w", row_group_bytes: int | None = None):
        _pyarrow()
        import pyarrow.parquet as pq

        self.path = Path(path)
        self.row_group_bytes = row_group_bytes or ROW_GROUP_BYTES
        self.writer = None
        self.pending: list[tuple[SentenceRow, np.ndarray]] = []
        self.pending_bytes = 0
        self.handle = open(self.path, "w+b") if mode == "w" else None
        self.file = None if mode == "w" else pq.ParquetFile(self.path)

    def write(self, key: str, array: np.ndarray, row: SentenceRow | None = None) -> None:
        """Buffer one sentence's row; a row group is written once `row_group_bytes` are buffered."""
        if row is None:
            raise ValueError(f"a Parquet row needs its line number and tokens (row=SentenceRow(...)) for key {key!r}")
        self.pending.append((row, array))
        self.pending_bytes += array.nbytes
        if self.pending_bytes >= self.row_group_bytes:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            rows, arrays = zip(*self.pending)
            self.pending, self.pending_bytes = [], 0
            self.write_table(rows_table(rows, arrays))

    def write_table(self, table: Any) -> None:
        """`table` as one row group (its schema must be the file's: the first table's)."""
        import pyarrow.parquet as pq

        if self.writer is None:
            self.writer = pq.ParquetWriter(self.handle, table.schema)
        self.writer.write_table(table, row_group_size=max(len(table), 1))

    def tables(self) -> Iterator[Any]:
        """The file's row groups, one Table at a time."""
        for index in range(self.file.num_row_groups):
            yield self.file.read_row_group(index)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """(line number as a str, array) for every row, in the file's order. A null line or
        embedding, or a line number two rows share, is a ValueError naming the file and rows (a
        dict of the rows would drop one of two rows silently); repeats are found once the last
        row group is read, after the rows before it were given."""
        first, lines = 0, []
        for table in self.tables():
            for column in ("line", "embedding"):
                nulls = table[column].is_null().to_numpy(zero_copy_only=False)
                if nulls.any():
                    raise ValueError(f"{self.path}: row {first + int(np.flatnonzero(nulls)[0])}: {column!r} is null; "
                                     "every row of an embeddings file has its line number and its array")
            lines.append(table["line"].to_numpy())
            first += len(table)
            yield from zip(map(str, lines[-1].tolist()), embedding_arrays(table["embedding"]))
        if lines:
            refuse_repeated_lines(np.concatenate(lines), self.path, "every row of an embeddings file is a line of "
                                  "its input, once")

    def copy_to(self, out: ParquetSegment) -> Iterator[str]:
        """Copy every row group into `out` as it is; yield the line number of each row copied."""
        for table in self.tables():
            out.write_table(table)
            yield from map(str, table["line"].to_pylist())

    def close(self) -> None:
        try:
            if self.handle is not None:
                self.flush()
                if self.writer is not None:
                    self.writer.close()
            elif self.file is not None:
                self.file.close()
        finally:
            if self.handle is not None:
                self.handle.close()

    def abort(self) -> None:
        """Close, whatever state a failed write left, and remove the file."""
        self.pending = []
        with contextlib.suppress(Exception):
            self.close()
        self.path.unlink(missing_ok=True)


def refuse_repeated_lines(lines: np.ndarray, path: str | Path, why: str) -> None:
    """A ValueError naming two rows of `path` with the same line number (`lines`, in row order:
    the first two holding the smallest repeated number) and `why` that is wrong; nothing when
    every number is unique. Sorting, not a set: 8 bytes a row."""
    order = np.argsort(lines, kind="stable")  # equal numbers stay in row order
    repeats = np.flatnonzero(np.diff(lines[order]) == 0)
    if len(repeats):
        first, second = int(order[repeats[0]]), int(order[repeats[0] + 1])
        raise ValueError(f"{path}: rows {first} and {second} have the same line {int(lines[first])}; {why}")


def iter_parquet_embeddings(path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """(line number as a str, array) for every row of a Parquet output, one row group in memory
    at a time (`elmokit.read_embeddings` of a .parquet file)."""
    segment = ParquetSegment(path, "r")
    try:
        yield from segment.items()
    finally:
        segment.close()
