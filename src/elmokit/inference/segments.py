"""The files `elmo embed` writes, and reading them back: one array per sentence, keyed by line
number or by the sentence's text (escaped for the format: `sentence_key`), in HDF5 datasets or
`.npz` members (`Hdf5Segment`, `NpzSegment`: the partial segments and the final file alike), with
`sentence_to_index` (JSON) mapping sentences to keys; or Parquet rows (`ParquetSegment`, one row a
line with its sentence and tokens: `elmokit.inference.parquet`). `read_embeddings` /
`iter_embeddings` read an output back (AllenNLP's layout; see `elmokit.inference.files` for how it
is made)."""

from __future__ import annotations

import contextlib
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from elmokit.inference.parquet import (SentenceRow, embedding_arrays, is_parquet,
                                     refuse_repeated_lines, require_pyarrow, rows_table)

FILE_FORMATS = ("hdf5", "npz", "parquet")
INDEX_KEY = "sentence_to_index"
ROW_GROUP_BYTES = 32 << 20  # a Parquet segment's vectors buffered before a row group is written (memory stays flat)


NPZ_MAX_NAME_BYTES = 65_535  # a zip member's name has a 16-bit length


def format_for_path(path: Path) -> str:
    """The file format an output path asks for by its suffix: .npz, .parquet, else HDF5."""
    return {".npz": "npz", ".parquet": "parquet"}.get(path.suffix.lower(), "hdf5")


def sentence_key(sentence: str) -> str:
    """The name a sentence is stored under with `use_sentence_keys`: its text, except that '%',
    '/', '\\' and NUL become %25, %2F, %5C and %00 (HDF5 reads '/' as a group path and ends a name
    at NUL; a zip extractor on Windows reads '\\' in a .npz member name as a folder, `\\..\\x`),
    the names the file reserves ("." is HDF5's root group, "sentence_to_index" the index) have
    their first character escaped, and the empty sentence is "%". `key_sentence` inverts it."""
    if not sentence:
        return "%"
    key = sentence.replace("%", "%25").replace("/", "%2F").replace("\\", "%5C").replace("\x00", "%00")
    if key in (".", INDEX_KEY):
        key = f"%{ord(key[0]):02X}{key[1:]}"
    return key


def key_sentence(key: str) -> str:
    """The sentence (or line number) a stored key stands for: the inverse of `sentence_key`."""
    if key == "%":
        return ""
    return re.sub(r"%([0-9A-F]{2})", lambda match: chr(int(match[1], 16)), key)


# ---------------------------------------------------------------------------------------------
# Segment files: HDF5 datasets or .npz members, one per key
# ---------------------------------------------------------------------------------------------
def open_for_writing(path: Path):
    """A new file for a segment or the merged output. Its writes go through Python, so a full
    disk is an OSError: HDF5's own file driver crashes the whole process on one."""
    return open(path, "w+b")


class _Segment:
    """A segment file: `write` arrays under keys, `items` reads them back, `copy_to` another (the
    merge), `close` finishes the file (complete only once it returns), `abort` removes it
    whatever state a failed write left. The HDF5 and .npz kinds share the container
    (`_container()`) over a file object opened by `open_for_writing` when writing (`handle`),
    closed in that order; Parquet's writes row groups (`ParquetSegment`)."""

    path: Path
    handle: object
    sentence_index = True  # the merged output holds sentence_to_index (unless forget_sentences)

    def _container(self):
        raise NotImplementedError

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        raise NotImplementedError

    def write(self, key: str, array: np.ndarray, row: SentenceRow | None = None) -> None:
        """Store `array` under `key` (`row`, what a Parquet row holds beside it, is not kept)."""
        raise NotImplementedError

    def copy_to(self, out: _Segment) -> Iterator[str]:
        """Copy every array into `out` (the merge); yield each key copied."""
        for key, values in self.items():
            out.write(key, values)
            yield key

    def close(self) -> None:
        try:
            self._container().close()
        finally:
            if self.handle is not None:
                self.handle.close()

    def _drop_pending(self) -> None:
        """Forget what is buffered and not yet written (nothing, but for Parquet's rows)."""

    def abort(self) -> None:
        """Close, whatever state a failed write left, and remove the file."""
        self._drop_pending()
        with contextlib.suppress(Exception):
            self.close()
        self.path.unlink(missing_ok=True)


class Hdf5Segment(_Segment):
    suffix = ".h5"

    def __init__(self, path: Path, mode: str = "w"):
        self.path = path
        self.handle = open_for_writing(path) if mode == "w" else None
        try:
            self.file = h5py.File(self.handle or path, mode)
        except BaseException:
            if self.handle is not None:
                self.handle.close()
            raise

    def __contains__(self, key: str) -> bool:
        return key in self.file

    def write(self, key: str, array: np.ndarray, row: SentenceRow | None = None) -> None:
        if key not in self.file:  # a repeated sentence under use_sentence_keys
            self.file.create_dataset(key, data=array)

    def write_json(self, key: str, json_path: Path) -> None:
        """The ASCII JSON text of `json_path` as a 1-element string array (the original's layout:
        `file[key][0]`); h5py needs the text in memory once (as bytes, never as str)."""
        self.file.create_dataset(key, data=np.array([json_path.read_bytes()], dtype=h5py.string_dtype()))

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        names: list[str] = []
        self.file.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        for name in names:  # full paths: the keys of a file from before keys were escaped
            yield name, self.file[name][()]

    def _container(self):
        return self.file


class NpzSegment(_Segment):
    """A .npz written member by member (stored, like `numpy.savez`), never all in memory."""

    suffix = ".npz"

    def __init__(self, path: Path, mode: str = "w"):
        self.path = path
        self.handle = open_for_writing(path) if mode == "w" else None
        try:
            self.zip = zipfile.ZipFile(self.handle or path, mode, allowZip64=True)
        except BaseException:
            if self.handle is not None:
                self.handle.close()
            raise
        self.names = set(self.zip.namelist())

    def __contains__(self, key: str) -> bool:
        return f"{key}.npy" in self.names

    def write(self, key: str, array: np.ndarray, row: SentenceRow | None = None) -> None:
        name = f"{key}.npy"
        if name in self.names:
            return
        with self.zip.open(name, "w", force_zip64=True) as handle:
            np.lib.format.write_array(handle, np.require(array, requirements="C"), allow_pickle=False)
        self.names.add(name)

    def write_json(self, key: str, json_path: Path, block: int = 1 << 22) -> None:
        """The ASCII JSON text of `json_path` as a 0-d unicode array (loadable without pickle),
        streamed into the member block by block: never in memory whole (as UTF-32, 4 bytes a
        character)."""
        n_chars = json_path.stat().st_size
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(f"<U{n_chars}")), "fortran_order": False,
                  "shape": ()}
        with self.zip.open(f"{key}.npy", "w", force_zip64=True) as handle, open(json_path, "rb") as source:
            np.lib.format.write_array_header_2_0(handle, header)
            for chunk in iter(lambda: source.read(block), b""):
                handle.write(chunk.decode("ascii").encode("utf-32-le"))
        self.names.add(f"{key}.npy")

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self.zip.namelist():
            with self.zip.open(name) as handle:
                yield name.removesuffix(".npy"), np.lib.format.read_array(handle, allow_pickle=False)

    def _container(self):
        return self.zip


# ---------------------------------------------------------------------------------------------
# Parquet rows (`elmokit.inference.parquet`'s columns): the partial pieces and the merged output alike
# ---------------------------------------------------------------------------------------------
class ParquetSegment(_Segment):
    """Rows written in row groups of about `row_group_bytes` of vectors, or a file to read.

    The file is written through a Python file object, so that a full disk is an OSError; it is
    complete (with Parquet's footer) only once `close` returns. `abort` removes it."""

    suffix = ".parquet"
    sentence_index = False  # the rows hold their sentence; no sentence_to_index

    def __init__(self, path: str | Path, mode: str = "w", row_group_bytes: int | None = None):
        require_pyarrow()
        import pyarrow.parquet as pq

        self.path = Path(path)
        self.row_group_bytes = row_group_bytes or ROW_GROUP_BYTES
        self.writer = None
        self.pending: list[tuple[SentenceRow, np.ndarray]] = []
        self.pending_bytes = 0
        self.handle = open_for_writing(self.path) if mode == "w" else None
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

    def _drop_pending(self) -> None:
        self.pending, self.pending_bytes = [], 0


SEGMENT_TYPES = {"hdf5": Hdf5Segment, "npz": NpzSegment, "parquet": ParquetSegment}


# ---------------------------------------------------------------------------------------------
# Reading an output back
# ---------------------------------------------------------------------------------------------
def iter_embeddings(path: str | Path) -> Iterator[tuple[str, np.ndarray]]:
    """(key, array) for every array of an `elmo embed` output, HDF5, .npz or Parquet, one array (a
    Parquet row group) in memory at a time, in the file's order (not the input's): the key is the
    sentence text for an output written with --use-sentence-keys (stored names decoded with
    `key_sentence`), else the line number ("0", "1", ...). `sentence_to_index` is not an array of
    vectors and is skipped."""
    path = Path(path)
    if is_parquet(path):
        segment = ParquetSegment(path, "r")
        try:
            yield from segment.items()
        finally:
            segment.close()
        return
    if zipfile.is_zipfile(path):
        with np.load(path, allow_pickle=False) as archive:
            for name in archive.files:
                if name != INDEX_KEY:
                    yield key_sentence(name), archive[name]
        return
    with h5py.File(path, "r") as file:
        names: list[str] = []
        file.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        for name in names:
            if name != INDEX_KEY:
                yield key_sentence(name), file[name][()]


def read_embeddings(path: str | Path) -> dict[str, np.ndarray]:
    """Every array of an `elmo embed` output (HDF5, .npz or Parquet) by its sentence (with
    --use-sentence-keys) or line number ("0", "1", ...); see `iter_embeddings` to hold one at a
    time. E.g. `read_embeddings("vectors.h5")["The cat sat ."]` -> (L+1, 4, 2P) with --all."""
    return dict(iter_embeddings(path))
