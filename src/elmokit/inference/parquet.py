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
a few numpy operations over the whole batch (no Python loop over tokens); `rows_table` makes a
row group of them. The file as a segment of `elmo embed` (written in row groups of a bounded
size, read row group by row group) is `elmokit.inference.segments.ParquetSegment`,
beside the HDF5 and .npz segments.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from elmokit.extras import require

PARQUET_MAGIC = b"PAR1"


class SentenceRow(NamedTuple):
    """What a row-per-sentence output (Parquet) stores beside a sentence's array; the HDF5 and
    .npz segments keep the array under its key alone."""

    line: int  # 0-based line number in the input
    sentence: str | None  # the line's text; None: not written (forget_sentences)
    tokens: list[str]


def require_pyarrow(purpose: str = "Parquet output") -> Any:
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
    pa = require_pyarrow()
    arrow_type = pa.list_(pa.float32(), dim)
    for _ in range(ndim - 1):
        arrow_type = pa.list_(arrow_type)
    return arrow_type


def embedding_array(arrays: Sequence[np.ndarray]) -> Any:
    """float32 arrays with the same number of axes and the same last size D -> one Arrow array,
    a row each (see the module docstring); the values are copied once, into one buffer."""
    pa = require_pyarrow()
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
    pa = require_pyarrow()
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
    pa = require_pyarrow()
    columns = {"line": pa.array([row.line for row in rows], type=pa.int64())}
    if rows and rows[0].sentence is not None:
        columns["sentence"] = pa.array([row.sentence for row in rows], type=pa.string())
    columns["tokens"] = pa.array([row.tokens for row in rows], type=pa.list_(pa.string()))
    columns["embedding"] = embedding_array(arrays)
    return pa.table(columns)


def refuse_repeated_lines(lines: np.ndarray, path: str | Path, why: str) -> None:
    """A ValueError naming two rows of `path` with the same line number (`lines`, in row order:
    the first two holding the smallest repeated number) and `why` that is wrong; nothing when
    every number is unique. Sorting, not a set: 8 bytes a row."""
    order = np.argsort(lines, kind="stable")  # equal numbers stay in row order
    repeats = np.flatnonzero(np.diff(lines[order]) == 0)
    if len(repeats):
        first, second = int(order[repeats[0]]), int(order[repeats[0] + 1])
        raise ValueError(f"{path}: rows {first} and {second} have the same line {int(lines[first])}; {why}")
