"""Readers for the task data sets: UD CoNLL-U, CoNLL-2003, SST trees and CSVs, SemCor TSV.

Every reader returns plain Python lists (tokens and labels), reads plain or gzip files, and
raises `DataFormatError` naming the file and the 1-based line of anything malformed.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from elmokit.textfiles import CorpusError, locate_decode_error, not_a_regular_file, open_binary
from elmokit.tasks.schemes import iob1_to_bio

UPOS_TAGS = ("ADJ", "ADP", "ADV", "AUX", "CCONJ", "DET", "INTJ", "NOUN", "NUM", "PART", "PRON",
             "PROPN", "PUNCT", "SCONJ", "SYM", "VERB", "X")
NER_TYPES = ("PER", "LOC", "ORG", "MISC")


class DataFormatError(ValueError):
    """A data file does not have the expected format; the message names the file and line."""

    def __init__(self, path: str | Path, line_number: int, message: str):
        super().__init__(f"{path}:{line_number}: {message}")
        self.path, self.line_number = Path(path), line_number


@dataclass
class TaggedSentence:
    """One sentence with one label per token (POS tags or BIO entity tags)."""

    tokens: list[str]
    tags: list[str]


@dataclass
class LabelledSentence:
    """One sentence with one label for the whole sentence (sentiment)."""

    tokens: list[str]
    label: int | str


@dataclass
class SenseSentence:
    """A SemCor sentence: tokens, lemmas, and the gold sense keys of each token (empty if untagged)."""

    document: str
    tokens: list[str]
    lemmas: list[str]
    senses: list[tuple[str, ...]] = field(default_factory=list)


def open_data_file(path: str | Path) -> IO[str]:
    """Open a task data file as UTF-8 text (gzip detected, a truncated or fake .gz named by
    `elmokit.training.corpus`); a clear error if it is missing, not a regular file, or (when
    read) not UTF-8: the file and the line of the first bad byte."""
    path = Path(path)
    check_data_path(path)
    return _DataText(open_binary(path), path)


def check_data_path(path: Path) -> None:
    """A clear error unless `path` is a regular file: missing, a directory, a pipe or device, or a
    symbolic link that leads nowhere (a loop, a missing target) each said as what it is."""
    try:
        if path.is_file():
            return
        if path.is_dir():
            raise IsADirectoryError(f"data file {path} is a directory; give a file")
        if path.exists():
            raise CorpusError(not_a_regular_file(path))
    except OSError as error:  # ELOOP from stat: a loop of symbolic links
        if isinstance(error, IsADirectoryError):
            raise
        raise FileNotFoundError(f"data file {path} cannot be opened ({error.strerror})") from None
    if path.is_symlink():
        raise FileNotFoundError(f"data file {path} is a symbolic link that leads nowhere (to a missing file, or in "
                                "a loop of links)")
    raise FileNotFoundError(f"data file not found: {path}")


class _DataText(io.TextIOWrapper):
    """Strict UTF-8 text whose decoding error names the file and the line (`locate_decode_error`)."""

    def __init__(self, raw, path: Path):
        super().__init__(raw, encoding="utf-8", errors="strict")
        self.path = path

    def __next__(self) -> str:
        try:
            return super().__next__()
        except UnicodeDecodeError:
            raise CorpusError(f"{locate_decode_error(self.path)}; task data must be UTF-8") from None

    def readline(self, size: int = -1) -> str:
        try:
            return super().readline(size)
        except UnicodeDecodeError:
            raise CorpusError(f"{locate_decode_error(self.path)}; task data must be UTF-8") from None


def _numbered_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    with open_data_file(path) as handle:
        for number, line in enumerate(handle, start=1):
            yield number, line.rstrip("\r\n")


# ---------------------------------------------------------------------------------------------
# UD CoNLL-U: UPOS tags
# ---------------------------------------------------------------------------------------------
def read_conllu(path: str | Path) -> list[TaggedSentence]:
    """Sentences of a CoNLL-U file with their UPOS tags (column 4).

    Comment lines (`#`), multiword-token ranges (`3-4`) and empty nodes (`8.1`) are skipped.
    """
    sentences, tokens, tags = [], [], []
    for number, line in _numbered_lines(path):
        if not line.strip():
            if tokens:
                sentences.append(TaggedSentence(tokens, tags))
                tokens, tags = [], []
            continue
        if line.startswith("#"):
            continue
        columns = line.split("\t")
        if len(columns) != 10:
            raise DataFormatError(path, number, f"expected 10 tab-separated columns, got {len(columns)}")
        token_id = columns[0]
        if "-" in token_id or "." in token_id:
            continue
        if not token_id.isdigit():
            raise DataFormatError(path, number, f"token id must be an integer, a range or a decimal, got {token_id!r}")
        if not columns[1] or not columns[3] or columns[3] == "_":
            raise DataFormatError(path, number, f"missing FORM or UPOS: {line!r}")
        tokens.append(columns[1])
        tags.append(columns[3])
    if tokens:
        sentences.append(TaggedSentence(tokens, tags))
    return sentences


# ---------------------------------------------------------------------------------------------
# CoNLL-2003: IOB1 entity tags, converted to BIO
# ---------------------------------------------------------------------------------------------
def _check_entity_tag(tag: str, path: str | Path, number: int) -> None:
    if tag != "O" and not (tag[:2] in ("B-", "I-") and tag[2:]):
        raise DataFormatError(path, number, f"entity tag must be O, B-TYPE or I-TYPE, got {tag!r}")


def read_conll2003(path: str | Path, scheme: str = "iob1") -> list[TaggedSentence]:
    """Sentences of a CoNLL-2003 file (`word POS chunk NER`, space-separated) with BIO NER tags.

    `-DOCSTART-` lines are dropped. With `scheme="iob1"` (the original files) tags are converted to
    BIO; with `scheme="bio"` they are kept as they are.
    """
    if scheme not in ("iob1", "bio"):
        raise ValueError(f"scheme must be 'iob1' or 'bio', got {scheme!r}")
    sentences, tokens, tags = [], [], []

    def finish() -> None:
        if tokens:
            sentences.append(TaggedSentence(list(tokens), iob1_to_bio(tags) if scheme == "iob1" else list(tags)))
            tokens.clear()
            tags.clear()

    for number, line in _numbered_lines(path):
        if not line.strip():
            finish()
            continue
        columns = line.split()
        if columns[0] == "-DOCSTART-":
            finish()
            continue
        if len(columns) != 4:
            raise DataFormatError(path, number, f"expected 4 space-separated columns (word POS chunk NER), "
                                                f"got {len(columns)}: {line!r}")
        _check_entity_tag(columns[3], path, number)
        tokens.append(columns[0])
        tags.append(columns[3])
    finish()
    return sentences


# ---------------------------------------------------------------------------------------------
# SST: PTB-style sentiment trees and the SST-2 CSVs
# ---------------------------------------------------------------------------------------------
def parse_sst_tree(text: str) -> tuple[int, list[str]]:
    """`(3 (2 It) (4 ...))` -> (root label, leaves). Raises ValueError with the offset if malformed."""
    position, depth = 0, 0
    leaves: list[str] = []
    root_label = None
    while position < len(text):
        char = text[position]
        if char == "(":
            end = position + 1
            while end < len(text) and text[end] not in " ()":
                end += 1
            label = text[position + 1:end]
            if not (label.isdigit() and 0 <= int(label) <= 4):
                raise ValueError(f"node label must be 0-4, got {label!r} at character {position + 1}")
            if depth == 0:
                if root_label is not None:
                    raise ValueError(f"a second tree starts at character {position + 1}")
                root_label = int(label)
            depth += 1
            position = end
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ')' at character {position + 1}")
            position += 1
        elif char == " ":
            position += 1
        else:
            end = position
            while end < len(text) and text[end] not in " ()":
                end += 1
            if depth == 0:
                raise ValueError(f"text outside the tree at character {position + 1}")
            leaves.append(text[position:end])
            position = end
    if root_label is None or depth != 0 or not leaves:
        raise ValueError("not a complete tree (unbalanced parentheses or no leaves)")
    return root_label, leaves


def sst_binary_label(fine_label: int) -> int | None:
    """SST-5 -> SST-2: 0, 1 -> 0 (negative); 3, 4 -> 1 (positive); 2 (neutral) -> None (dropped)."""
    return None if fine_label == 2 else int(fine_label > 2)


def read_sst_trees(path: str | Path, binary: bool = False) -> list[LabelledSentence]:
    """Sentences of an SST tree file with their root labels: SST-5 (0-4), or SST-2 with `binary`
    (neutral sentences dropped). Leaves are the tokens; `-LRB-`/`-RRB-` are kept as they are."""
    sentences = []
    for number, line in _numbered_lines(path):
        if not line.strip():
            continue
        try:
            label, leaves = parse_sst_tree(line.strip())
        except ValueError as error:
            raise DataFormatError(path, number, f"malformed sentiment tree: {error}") from None
        if binary:
            label = sst_binary_label(label)
            if label is None:
                continue
        sentences.append(LabelledSentence(leaves, label))
    return sentences


def read_sst2_csv(path: str | Path) -> list[LabelledSentence]:
    """The SST-2 CSV files (`label,sentence`; 0 negative, 1 positive), split on whitespace."""
    sentences = []
    with open_data_file(path) as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header != ["label", "sentence"]:
            raise DataFormatError(path, 1, f"expected the header 'label,sentence', got {header!r}")
        for row in reader:
            number = reader.line_num
            if len(row) != 2 or row[0] not in ("0", "1") or not row[1].split():
                raise DataFormatError(path, number, f"expected 'label,sentence' with label 0 or 1, got {row!r}")
            sentences.append(LabelledSentence(row[1].split(), int(row[0])))
    return sentences


# ---------------------------------------------------------------------------------------------
# SemCor (6-column TSV, see data/wsd/README.md)
# ---------------------------------------------------------------------------------------------
def read_semcor(path: str | Path, max_documents: int | None = None) -> list[SenseSentence]:
    """Sentences of the SemCor TSV (`index form lemma ptb_pos sense_keys synsets`), each with its
    document name and the `;`-separated sense keys of every token (() where untagged).
    `max_documents` stops after that many documents (for quick runs)."""
    sentences: list[SenseSentence] = []
    document, current, n_documents = None, None, 0
    for number, line in _numbered_lines(path):
        if line.startswith("# doc = "):
            n_documents += 1
            if max_documents is not None and n_documents > max_documents:
                break
            document = line[len("# doc = "):].strip()
            continue
        if line.startswith("#"):
            continue
        if not line.strip():
            if current is not None and current.tokens:
                sentences.append(current)
            current = None
            continue
        columns = line.split("\t")
        if len(columns) != 6:
            raise DataFormatError(path, number, f"expected 6 tab-separated columns, got {len(columns)}")
        if document is None:
            raise DataFormatError(path, number, "token line before the first '# doc = ' line")
        if current is None:
            current = SenseSentence(document, [], [], [])
        current.tokens.append(columns[1])
        current.lemmas.append(columns[2])
        keys = () if columns[4] == "_" else tuple(columns[4].split(";"))
        if any("%" not in key for key in keys):
            raise DataFormatError(path, number, f"malformed sense key(s) {columns[4]!r} (expected lemma%...)")
        current.senses.append(keys)
    if current is not None and current.tokens:
        sentences.append(current)
    return sentences
