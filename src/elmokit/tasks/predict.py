"""Predicting a file with a trained task model: read it lazily, predict a chunk of sentences at a
time (in the batches evaluation uses), and write each example back in the input's format with
the predicted labels, or as JSON Lines.

What each input format becomes (entity tags in BIO):

    conllu   the same lines, the label column (UPOS, or the one the run was trained on) filled in
    columns  each token line with its last column replaced by the prediction (or, for a file of
             tokens alone, the prediction added as a second column); a blank line after each sentence
    tsv/csv  each row with the label column set (a column added, first, where there is none)
    jsonl    each object with "labels" (tagger) or "label" (classifier) set, other keys kept
    text     tagger: `token<TAB>label` lines, a blank line after each sentence;
             classifier: `label<TAB>text` lines
"""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

from elmokit.io import atomic_path
from elmokit.progress import progress_bar
from elmokit.tasks.formats import CONLLU_COLUMNS, FileFormat, Record, iter_records, resolve_format

CHUNK_BATCHES = 16  # a chunk of this many batches is read, embedded and predicted at once


class PredictionWriter:
    """Writes records with their predicted labels to `handle`, in `fmt` or as JSON Lines."""

    def __init__(self, handle, fmt: FileFormat, kind: str, jsonl: bool = False):
        self.handle, self.fmt, self.kind, self.jsonl = handle, fmt, kind, jsonl
        self.header_written = False

    def write(self, record: Record, prediction: list[str] | str) -> None:
        if self.jsonl:
            key = "labels" if self.kind == "tagger" else "label"
            self.handle.write(json.dumps({"tokens": record.tokens, key: prediction}, ensure_ascii=False) + "\n")
            return
        name = self.fmt.name
        if name in ("tsv", "csv") or (name == "text" and self.kind == "classifier"):
            self._write_row(record, prediction)
        elif name == "conllu":
            self.handle.write(conllu_block(record, prediction, self.fmt.column))
        elif name == "jsonl":
            item = dict(record.source)
            item["labels" if self.kind == "tagger" else "label"] = prediction
            self.handle.write(json.dumps(item, ensure_ascii=False) + "\n")
        else:  # columns, with their own separator (a space where runs of spaces parted them), or tokens
            # alone (text for a tagger, a token a line): token<TAB>label
            spaced = (name == "columns" and self.fmt.separator is None and isinstance(record.source, list)
                      and len(record.source[0]) > 1)
            self.handle.write(columns_block(record, prediction, " " if spaced else self.fmt.separator or "\t"))

    def _write_row(self, record: Record, prediction: str) -> None:
        fmt = self.fmt
        if fmt.name == "text":
            self.handle.write(f"{prediction}\t{record.source}\n")
            return
        if fmt.header and not self.header_written:
            header = list(fmt.header) if fmt.label_column is not None else ["label", *fmt.header]
            self.handle.write(format_row(header, fmt.name))
        self.header_written = True
        row = list(record.source)
        if fmt.label_column is None:
            row.insert(0, prediction)
        else:
            row[fmt.label_column] = prediction
        self.handle.write(format_row(row, fmt.name))


def format_row(row: list[str], name: str) -> str:
    if name == "tsv":
        return "\t".join(row) + "\n"
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(row)
    return buffer.getvalue()


def conllu_block(record: Record, prediction: list[str], column: str) -> str:
    """The sentence's CoNLL-U lines with `column` of every token line set to its prediction."""
    index = CONLLU_COLUMNS.index(column)
    labels = iter(prediction)
    lines = []
    for line in record.source:
        columns = line.split("\t")
        if not line.startswith("#") and "-" not in columns[0] and "." not in columns[0]:
            columns[index] = next(labels)
        lines.append("\t".join(columns))
    return "\n".join(lines) + "\n\n"


def columns_block(record: Record, prediction: list[str], separator: str) -> str:
    """One line a token: its columns with the last replaced by the prediction (added if the token
    stands alone); a blank line after the sentence."""
    rows = record.source if isinstance(record.source, list) else [[token] for token in record.tokens]
    lines = [separator.join([*(row[:-1] if len(row) > 1 else row), label]) for row, label in zip(rows, prediction)]
    return "\n".join(lines) + "\n\n"


def chunks(records: Iterator[Record], size: int) -> Iterator[list[Record]]:
    while chunk := list(islice(records, size)):
        yield chunk


def predict_file(run, input_path: str | Path, output: str | Path | None = None, data_format: str = "auto",
                 column: str | None = None, tokenize: bool = False, jsonl: bool = False,
                 progress: bool = True) -> dict:
    """Predict every example of `input_path` with a loaded TaskRun and write them to `output`
    (written whole: a temporary file renamed into place) or stdout. Returns {'examples', 'format'}.

    `tokenize` splits raw text with the Moses tokenizer (text, TSV, CSV and JSONL "text"), else
    text is split on whitespace.
    """
    from elmokit.inference.files import make_tokenizer

    if tokenize and data_format == "auto" and run.kind == "tagger":
        data_format = "text"
    fmt = resolve_format(input_path, run.kind, data_format, column or run.config.column,
                         labels=set(run.vocabularies.labels))
    records = iter_records(input_path, fmt, run.kind, make_tokenizer(tokenize))
    batch_size = 2 * run.config.batch_size
    if output is None:
        n = _predict_records(run, records, PredictionWriter(sys.stdout, fmt, run.kind, jsonl), batch_size, progress)
    else:
        with atomic_path(output) as tmp, open(tmp, "w", encoding="utf-8") as handle:
            n = _predict_records(run, records, PredictionWriter(handle, fmt, run.kind, jsonl), batch_size, progress)
    return {"examples": n, "format": fmt.name}


def _predict_records(run, records: Iterator[Record], writer: PredictionWriter, batch_size: int, progress: bool) -> int:
    bar = progress_bar(desc="predict", unit="sent", enabled=progress)
    n = 0
    for chunk in chunks(records, CHUNK_BATCHES * batch_size):
        predictions = run.predict_labels([record.tokens for record in chunk], batch_size)
        for record, prediction in zip(chunk, predictions):
            writer.write(record, prediction)
        n += len(chunk)
        bar.update(len(chunk))
    bar.close()
    return n
