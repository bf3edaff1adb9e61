"""The inputs of `elmo embed --ray` read by Ray Data's read tasks, in parallel on the cluster, so
that the corpus never passes through the driver (which holds only the list of files).

`CorpusFiles` is a Ray file datasource (`ray.data.read_datasource`): Ray gives each read task
whole files, and a task reads its files from the first line to the last, so a row's `line` is its
number in its file however Ray later splits or merges the blocks (the identity of a row is
`(file, line)`). Text files are read as every elmokit reader reads them (`textfiles.read_lines`:
plain or .gz, strict UTF-8, errors naming file:line); Parquet files row group by row group, each
row keeping its columns. Imported by `elmokit.ray` once Ray is known to be installed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from ray.data.datasource import FileBasedDatasource

from elmokit.inference.parquet import refuse_repeated_lines
from elmokit.textfiles import read_lines

LINE_COLUMN = "line"  # a row's number in its file, from 0: `file` and `line` identify it


class CorpusFiles(FileBasedDatasource):
    """Text files (rows: `line`, `sentence`) or Parquet files (rows: every column, and `line`
    unless the file has an integer column of unique line numbers), with `file` (the path as the
    caller gave it) when `with_file`. Each file yields tables of `rows_per_block` rows.

    Args:
        paths: local paths every node of the cluster reads at the same place (a shared file system).
        parquet: the files are Parquet (else text, one sentence a line).
        text_column: a Parquet file's column of sentences: a null there is a ValueError naming the
            file and row.
        rows_per_block: rows of each table a read task yields.
        with_file: add the `file` column.
    """

    def __init__(self, paths: Sequence[str], *, parquet: bool, text_column: str, rows_per_block: int,
                 with_file: bool):
        super().__init__(list(paths))
        self.parquet, self.text_column = parquet, text_column
        self.rows_per_block, self.with_file = rows_per_block, with_file

    def _open_input_source(self, filesystem: Any, path: str, **open_args: Any) -> Any:
        """Random access (Parquet reads its footer first); text is read by path (`read_lines`)."""
        return filesystem.open_input_file(path)

    def _read_stream(self, f: Any, path: str) -> Iterator[Any]:
        tables = parquet_tables(f, path, self.text_column, self.rows_per_block) if self.parquet \
            else text_tables(Path(path), self.rows_per_block)
        for table in tables:
            yield table.append_column("file", pa.array([path] * len(table), pa.string())) if self.with_file else table


def text_tables(path: Path, rows_per_block: int) -> Iterator[Any]:
    """The lines of a text file as tables of `line` (0-based in the file) and `sentence`."""
    numbers, sentences = [], []
    for number, sentence in enumerate(read_lines(path)):
        numbers.append(number)
        sentences.append(sentence)
        if len(numbers) == rows_per_block:
            yield _lines_table(numbers, sentences)
            numbers, sentences = [], []
    if numbers:
        yield _lines_table(numbers, sentences)


def _lines_table(numbers: list[int], sentences: list[str]) -> Any:
    return pa.table({LINE_COLUMN: pa.array(numbers, pa.int64()), "sentence": pa.array(sentences, pa.string())})


def parquet_tables(source: Any, path: str, text_column: str, rows_per_block: int) -> Iterator[Any]:
    """The rows of a Parquet file as tables with `line`: the file's own (int64; checked for nulls
    here and for repeats at the end of the file) or the row's number; a null sentence or line is
    a ValueError naming the file and row."""
    first, own_lines = 0, []
    for batch in pq.ParquetFile(source).iter_batches(batch_size=rows_per_block):
        table = pa.Table.from_batches([batch])
        _refuse_nulls(table, text_column, path, first, "every row needs a sentence (an empty string gives an "
                                                          "empty one)")
        if LINE_COLUMN in table.column_names:
            _refuse_nulls(table, LINE_COLUMN, path, first, "the line column identifies each row")
            lines = table.column(LINE_COLUMN).cast(pa.int64())
            own_lines.append(lines.to_numpy())
            table = table.set_column(table.schema.get_field_index(LINE_COLUMN), LINE_COLUMN, lines)
        else:
            table = table.append_column(LINE_COLUMN, pa.array(np.arange(first, first + len(table)), pa.int64()))
        first += len(table)
        yield table
    if own_lines:
        refuse_repeated_lines(np.concatenate(own_lines), path, "a Parquet input's own 'line' column must number "
                              "its rows uniquely (drop or rename it to let elmo embed number them)")


def _refuse_nulls(table: Any, column: str, path: str, first: int, why: str) -> None:
    nulls = table.column(column).null_count
    if nulls:
        row = first + int(np.flatnonzero(table.column(column).is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"{path}: row {row}: {column!r} is null; {why}")
