"""Task data in the formats users have: detected from the file (or named), read lazily as records.

    conllu   CoNLL-U: one token a line, 10 tab-separated columns; the label is one column (UPOS by
             default, `column="xpos"` etc.); comments, multiword ranges and empty nodes are kept
             for writing back but are not tokens
    columns  one token a line, token first and label last, tab- or space-separated, a blank (or
             whitespace-only) line between sentences, `-DOCSTART-` lines skipped; one column = tokens only
    tsv      classification, one example a line: `label<TAB>text`, or a header line naming the
             text and label columns (`text`/`sentence`, `label`/`class`); a text-only file has no labels
    csv      the same with commas (quoted as the csv module reads them)
    jsonl    one JSON object a line: `{"tokens": [...], "labels": [...]}` for taggers,
             `{"text": "...", "label": ...}` (or `"tokens"`) for classifiers; labels are optional
    text     one sentence a line, no labels (for prediction); split on whitespace or tokenized

Every reader yields `Record`s and raises `DataFormatError` naming the file and the 1-based line
of anything malformed. `read_examples` reads a whole labelled file for training or scoring, and
normalizes entity tags (IOB1, BIO, BIOES) to BIO.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elmokit.jsonfiles import decode_json
from elmokit.tasks.readers import DataFormatError, LabelledSentence, TaggedSentence, open_data_file
from elmokit.tasks.schemes import detect_scheme, split_tag, to_bio

FORMATS = ("conllu", "columns", "tsv", "csv", "jsonl", "text")
KIND_FORMATS = {"tagger": ("conllu", "columns", "jsonl", "text"), "classifier": ("tsv", "csv", "jsonl", "text")}
CONLLU_COLUMNS = ("id", "form", "lemma", "upos", "xpos", "feats", "head", "deprel", "deps", "misc")
TEXT_NAMES = ("text", "sentence", "sentence1", "review", "document", "content")
LABEL_NAMES = ("label", "labels", "class", "sentiment", "category", "target")
SAMPLE_LINES = 200


@dataclass
class Record:
    """One example as read: its tokens, its gold labels (a list for a tagger, one string for a
    classifier, None when the file has none), the line it starts on, one line a token where the
    format has them, and what a writer needs to write it back with predicted labels (`source`)."""

    tokens: list[str]
    labels: list[str] | str | None
    line: int
    token_lines: list[int] = field(default_factory=list)
    source: Any = None


@dataclass
class FileFormat:
    """A file's format, and what its reader and writer need to know about its layout."""

    name: str
    column: str = "upos"  # conllu: which column holds the label
    separator: str | None = None  # columns: "\t", or None for runs of spaces
    header: list[str] | None = None  # tsv and csv: the header row, if the file has one
    text_column: int = 1  # tsv and csv
    label_column: int | None = 0  # tsv and csv; None: no label column


# ---------------------------------------------------------------------------------------------
# Detection
# ---------------------------------------------------------------------------------------------
def _sample(path: Path) -> list[str]:
    with open_data_file(path) as handle:
        return [line.rstrip("\r\n") for _, line in zip(range(SAMPLE_LINES), handle)]


def detect_format(path: str | Path, kind: str, labels: Collection[str] | None = None) -> str:
    """The format of `path` for a 'tagger' or a 'classifier', from its name and first lines.
    `labels` (a trained run's, when predicting) settles a file without blank lines or tabs: it is
    columns only where the last word of every line is one of them."""
    path = Path(path)
    name = path.name.lower().removesuffix(".gz")
    sample = _sample(path)
    first = next((line.strip() for line in sample if line.strip()), "")
    if name.endswith((".jsonl", ".json")) or first.startswith("{"):
        return "jsonl"
    if kind == "classifier":
        if name.endswith(".csv"):
            return "csv"
        return "tsv" if any("\t" in line for line in sample) else "text"
    if name.endswith(".conllu") or any(line.startswith(("# sent_id", "# text =")) for line in sample):
        return "conllu"
    token_lines = [line for line in sample if line.strip() and not line.startswith("#")]
    if token_lines and len(token_lines[0].split("\t")) == 10 and token_lines[0].split("\t")[0].isdigit():
        return "conllu"
    separated = any(not line.strip() for line in sample[:-1])
    if any("\t" in line or line.startswith("-DOCSTART-") for line in sample):
        return "columns"
    if separated:  # a column file: as many columns on every line, the last a label where there are several;
        # with the run's labels known, lines mostly of more than 4 words, of several lengths, mostly not ending in
        # a label, are sentences a line (a blank line between some): text
        widths = {len(line.split()) for line in token_lines}
        wide = sum(len(line.split()) > 4 for line in token_lines)
        labelled = sum(line.split()[-1] in labels for line in token_lines) if labels is not None else 0
        sentences = labels is not None and len(widths) > 1 and 2 * wide > len(token_lines) > 2 * labelled
        return "text" if sentences else "columns"
    widths = {len(line.split()) for line in token_lines}
    # a column file without blank lines (one sentence) has 2 to 4 columns (CoNLL-2003's 4) on every
    # line; lines of text that happen to have the same number of words (5 and 5) are text, and so are
    # lines of 2 to 4 words whose last words are not all labels of the run that reads them
    if len(token_lines) > 1 and len(widths) == 1 and widths <= {2, 3, 4}:
        if labels is None or all(line.split()[-1] in labels for line in token_lines):
            return "columns"
    return "text"


def resolve_format(path: str | Path, kind: str, name: str = "auto", column: str = "upos",
                   labels: Collection[str] | None = None) -> FileFormat:
    """The FileFormat of `path`: `name` ('auto' detects it, with `labels` as `detect_format`), with
    the layout details read from it."""
    path = Path(path)
    name = detect_format(path, kind, labels) if name == "auto" else name
    if name not in KIND_FORMATS[kind]:
        raise ValueError(f"{path}: format {name!r} is not one a {kind} reads ({', '.join(KIND_FORMATS[kind])})")
    if name == "conllu" and column not in CONLLU_COLUMNS[1:]:
        raise ValueError(f"--column must be one of {', '.join(CONLLU_COLUMNS[1:])}, got {column!r}")
    fmt = FileFormat(name, column=column)
    if name == "columns":
        fmt.separator = "\t" if any("\t" in line for line in _sample(path) if line.strip()) else None
    if name in ("tsv", "csv"):
        _read_header(path, fmt)
    return fmt


def _read_header(path: Path, fmt: FileFormat) -> None:
    """A first row naming a text column is a header: it sets the text and label columns."""
    with open_data_file(path) as handle:
        first = next(_table_rows(handle, fmt), (1, []))[1]
    names = [name.strip().lower() for name in first]
    text = next((i for i, name in enumerate(names) if name in TEXT_NAMES), None)
    if text is None:
        return
    fmt.header = first
    fmt.text_column = text
    fmt.label_column = next((i for i, name in enumerate(names) if name in LABEL_NAMES), None)


# ---------------------------------------------------------------------------------------------
# Readers: one generator per format
# ---------------------------------------------------------------------------------------------
def iter_records(path: str | Path, fmt: FileFormat, kind: str,
                 tokenize: Callable[[str], list[str]] = str.split) -> Iterator[Record]:
    """The records of `path`, lazily. `tokenize` splits text (classification files, text files)."""
    readers = {"conllu": _conllu_records, "columns": _column_records, "jsonl": _jsonl_records}
    if fmt.name in readers:
        yield from readers[fmt.name](Path(path), fmt, kind, tokenize)
    elif fmt.name in ("tsv", "csv"):
        yield from _table_records(Path(path), fmt, tokenize)
    elif fmt.name == "text":
        yield from _text_records(Path(path), tokenize)
    else:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt.name!r}")


def _numbered(path: Path) -> Iterator[tuple[int, str]]:
    with open_data_file(path) as handle:
        for number, line in enumerate(handle, start=1):
            yield number, line.rstrip("\r\n")


def _conllu_records(path: Path, fmt: FileFormat, kind: str, tokenize) -> Iterator[Record]:
    """Sentences of a CoNLL-U file; source = the sentence's lines as they are (comments included)."""
    label_index = CONLLU_COLUMNS.index(fmt.column)
    lines, tokens, labels, token_lines = [], [], [], []
    for number, line in _numbered(path):
        if not line.strip():
            if tokens:
                yield Record(tokens, labels, token_lines[0], token_lines, lines)
            lines, tokens, labels, token_lines = [], [], [], []
            continue
        lines.append(line)
        if line.startswith("#"):
            continue
        columns = line.split("\t")
        if len(columns) != 10:
            raise DataFormatError(path, number, f"expected 10 tab-separated CoNLL-U columns, got {len(columns)}")
        if "-" in columns[0] or "." in columns[0]:
            continue
        if not columns[0].isdigit():
            raise DataFormatError(path, number, f"token id must be an integer, a range or a decimal, got {columns[0]!r}")
        if not columns[1]:
            raise DataFormatError(path, number, "empty FORM")
        tokens.append(columns[1])
        labels.append(columns[label_index])
        token_lines.append(number)
    if tokens:
        yield Record(tokens, labels, token_lines[0], token_lines, lines)


def _column_records(path: Path, fmt: FileFormat, kind: str, tokenize) -> Iterator[Record]:
    """Sentences of a column file; source = the rows (lists of fields) of its tokens."""
    rows, token_lines, width = [], [], None

    def sentence() -> Record:
        labels = [row[-1] for row in rows] if width > 1 else None
        return Record([row[0] for row in rows], labels, token_lines[0], list(token_lines), list(rows))

    for number, line in _numbered(path):
        fields = [f.strip() for f in line.split("\t")] if fmt.separator == "\t" else line.split()
        if not line.strip() or fields[0] == "-DOCSTART-":
            if rows:
                yield sentence()
            rows, token_lines = [], []
            continue
        width = width or len(fields)
        if len(fields) != width or not fields[0]:
            raise DataFormatError(path, number, f"expected {width} {'tab' if fmt.separator else 'space'}-separated "
                                                f"columns (token first, label last) as on the first token line, got "
                                                f"{len(fields)}: {line!r}")
        if width > 1 and not fields[-1]:
            raise DataFormatError(path, number, f"empty label (the last of the {width} columns): {line!r}")
        rows.append(fields)
        token_lines.append(number)
    if rows:
        yield sentence()


def _table_rows(handle, fmt: FileFormat) -> Iterator[tuple[int, list[str]]]:
    if fmt.name == "csv":
        reader = csv.reader(handle)
        for row in reader:
            yield reader.line_num, row
    else:
        for number, line in enumerate(handle, start=1):
            yield number, line.rstrip("\r\n").split("\t")


def _table_records(path: Path, fmt: FileFormat, tokenize) -> Iterator[Record]:
    """Examples of a TSV or CSV file; source = the row's fields."""
    width = len(fmt.header) if fmt.header else None
    with open_data_file(path) as handle:
        for number, row in _table_rows(handle, fmt):
            if fmt.header and number == 1 or not any(cell.strip() for cell in row):
                continue
            if width is None:  # no header: label<TAB>text, or the text alone
                width = len(row)
                if width > 2:
                    raise DataFormatError(path, number, f"expected 'label{_separator(fmt)}text' or a header row naming "
                                                        f"the text and label columns, got {width} fields")
                fmt.text_column, fmt.label_column = (1, 0) if width == 2 else (0, None)
            if len(row) != width:
                raise DataFormatError(path, number, f"expected {width} fields as on the first row, got {len(row)}")
            tokens = tokenize(row[fmt.text_column])
            if not tokens:
                raise DataFormatError(path, number, "empty text")
            label = row[fmt.label_column].strip() if fmt.label_column is not None else None
            if label == "":
                raise DataFormatError(path, number, "empty label")
            yield Record(tokens, label, number, [], row)


def _separator(fmt: FileFormat) -> str:
    return "," if fmt.name == "csv" else "<TAB>"


def _jsonl_records(path: Path, fmt: FileFormat, kind: str, tokenize) -> Iterator[Record]:
    """Examples of a JSON Lines file; source = the parsed object (its other keys are written back)."""
    for number, line in _numbered(path):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataFormatError(path, number, f"invalid JSON: {error.msg} at character {error.pos + 1}") from None
        except (RecursionError, ValueError):  # deep nesting ([[[[...]]]]), an integer past Python's digit limit
            item = decode_json(line, f"{path}:{number}")  # raises JSONFileError, which says which
        if not isinstance(item, dict):
            raise DataFormatError(path, number, f"expected a JSON object, got {type(item).__name__}")
        tokens = _json_tokens(item, path, number, kind, tokenize)
        labels = _json_labels(item, path, number, kind, len(tokens))
        yield Record(tokens, labels, number, [number] * len(tokens), item)


def _json_tokens(item: dict, path: Path, number: int, kind: str, tokenize) -> list[str]:
    if "tokens" in item:
        tokens = item["tokens"]
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t for t in tokens):
            raise DataFormatError(path, number, '"tokens" must be a non-empty list of non-empty strings')
        return tokens
    if kind == "classifier" and isinstance(item.get("text"), str) and tokenize(item["text"]):
        return tokenize(item["text"])
    wanted = '"tokens" (a list of strings)' + (' or "text" (a non-empty string)' if kind == "classifier" else "")
    raise DataFormatError(path, number, f"expected {wanted}; keys are {sorted(item)}")


def _json_labels(item: dict, path: Path, number: int, kind: str, n_tokens: int) -> list[str] | str | None:
    if kind == "tagger":
        labels = item.get("labels")
        if labels is not None and (not isinstance(labels, list) or len(labels) != n_tokens
                                   or not all(isinstance(label, str) and label for label in labels)):
            raise DataFormatError(path, number, f'"labels" must be a list of {n_tokens} non-empty strings, '
                                                f"one a token")
        return labels
    label = item.get("label")
    if label is None:
        return None
    if isinstance(label, bool) or not isinstance(label, (str, int)) or str(label) == "":
        raise DataFormatError(path, number, f'"label" must be a non-empty string or an integer, got {label!r}')
    return str(label)


def _text_records(path: Path, tokenize) -> Iterator[Record]:
    """One sentence a line, no labels; blank lines are skipped. source = the line."""
    for number, line in _numbered(path):
        tokens = tokenize(line)
        if tokens:
            yield Record(tokens, None, number, [number] * len(tokens), line)


# ---------------------------------------------------------------------------------------------
# Whole labelled files, for training and scoring
# ---------------------------------------------------------------------------------------------
def read_examples(path: str | Path, kind: str, fmt: FileFormat, entity_tags: bool = False
                  ) -> tuple[list[TaggedSentence] | list[LabelledSentence], dict]:
    """Every example of a labelled file, and what was found: {'format', 'n', 'scheme'}.

    With `entity_tags` every tag must be O or B-, I-, E-, S- TYPE; the file's scheme is detected
    and its tags normalized to BIO.
    """
    records = list(iter_records(path, fmt, kind))
    if not records:
        raise DataFormatError(path, 1, f"no examples in this {fmt.name} file")
    if fmt.name == "text":
        raise DataFormatError(path, 1, f"read as plain text (one sentence a line, no labels), which a {kind} cannot "
                                       f"learn from or be scored on; it reads {', '.join(KIND_FORMATS[kind][:-1])} "
                                       "(name the format with --format if it was not recognized)")
    for record in records:
        if record.labels is None:
            raise DataFormatError(path, record.line, f"this {fmt.name} file has no labels; training and scoring need them")
        _check_label_characters(path, record)
    info = {"format": fmt.name, "n": len(records)}
    if kind == "classifier":
        return [LabelledSentence(r.tokens, r.labels) for r in records], info
    if fmt.name == "conllu":
        for record in records:
            _check_conllu_labels(path, record, fmt.column)
    if entity_tags:
        for record in records:
            _check_entity_tags(path, record)
        info["scheme"] = detect_scheme(r.labels for r in records)
        return [TaggedSentence(r.tokens, to_bio(r.labels, info["scheme"])) for r in records], info
    return [TaggedSentence(r.tokens, list(r.labels)) for r in records], info


def label_breaks_lines(label: str) -> bool:
    """Whether `label` holds a tab or a line break, which no file `predict` writes could hold:
    a CoNLL-U or column line would gain a column, a line would split in two."""
    return "\t" in label or len(f"x{label}x".splitlines()) != 1


def _check_label_characters(path: str | Path, record: Record) -> None:
    labels = [record.labels] if isinstance(record.labels, str) else record.labels
    for index, label in enumerate(labels):
        if label_breaks_lines(label):
            line = record.token_lines[index] if record.token_lines else record.line
            raise DataFormatError(path, line, f"label {label!r} holds a tab or a line break, which the files "
                                              "`elmo task predict` writes cannot hold; labels are one word or phrase")


def _check_entity_tags(path: str | Path, record: Record) -> None:
    for index, tag in enumerate(record.labels):
        try:
            split_tag(tag)
        except ValueError as error:
            line = record.token_lines[index] if record.token_lines else record.line
            raise DataFormatError(path, line, str(error)) from None


def _check_conllu_labels(path: str | Path, record: Record, column: str) -> None:
    for index, label in enumerate(record.labels):
        if label == "_" or not label.strip():
            raise DataFormatError(path, record.token_lines[index], f"no {column.upper()} label ({label!r})")
