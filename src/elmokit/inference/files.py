# Why this file is long: it is one pipeline with one resumable state (read -> embed -> segments
# -> merge), documented above in the order it runs; the on-disk format itself is in segments.py,
# the size estimate and the report in estimate.py.
"""Embed a text file into HDF5, .npz or Parquet, streaming: the engine behind `elmo embed` and
`ElmoEmbedder.embed_file`.

The pipeline, in the order text travels:

    input file (UTF-8, one sentence per line; plain or .gz)
      -> lines, decoded one at a time          (`read_lines`; a bad byte -> an error naming file:line)
      -> tokens: whitespace, or Moses          (`make_tokenizer`)
      -> batches of `batch_size` sentences; a sentence longer than `max_length` tokens is cut into
         overlapping windows and stitched back  (`split_windows`, `embed_sentences`)
      -> (L+1, n, 2P) per sentence, then the form asked for  (`layers.shape_output`)
      -> segment files in OUTPUT.partial/, one closed every `checkpoint_every` sentences
      -> merged into OUTPUT with `sentence_to_index`, renamed into place  (`merge_segments`)

Output layout (AllenNLP's): one array per input line, keyed by the line number ("0", "1", ...) or,
with `use_sentence_keys`, by the sentence text (a repeated sentence is stored once), escaped where
the file format needs it (`sentence_key`: '%', '/', '\\' and NUL as %25, %2F, %5C, %00; "." and
"sentence_to_index" with their first character escaped; the empty sentence as "%"). Per token:
(L+1, n, 2P) for "all", (n, 2P) for "top" (the last layer) and "average" (the mean of the layers).
With `sentence_vectors`, the mean over the sentence's tokens instead: (L+1, 2P) for "all", (2P,)
for "top" and "average"; an empty sentence gives zeros. Unless `forget_sentences`, the array
`sentence_to_index` holds one JSON string mapping each sentence's text to its key (the last line
wins for a repeated sentence). A blank line is an empty sentence, its key kept. HDF5 holds one
dataset per key; .npz one `KEY.npy` member per key (read with `numpy.load`). `read_embeddings`
(or `iter_embeddings`, one array at a time) reads either back, keyed by line number or sentence.

Interruptions: nothing is ever written to OUTPUT until it is complete. Work goes to the directory
OUTPUT.partial/, as segment files that are closed and listed in `progress-rank{r}.json` (with the
next input line to embed, the input's size, mtime and a hash of its first MiB, the options, a
digest of the model and its precision, `elmo.bilm_precision`) every `checkpoint_every` sentences;
`resume=True` continues from the last listed segment after a crash or a kill, and refuses a
partial made from other input, options, model or precision (float32, bfloat16 or int8; a partial
of an older elmokit, which did not record its precision, resumes with a warning).
Without `resume`, an existing partial is discarded only with `overwrite`. Every file is flushed to
the disk before it is renamed into place; a failed write (a full disk) is one error that keeps the
finished segments, and `resume=True` continues (or redoes the merge) once there is space. One
process writes an output at a time: `OUTPUT.lock` (see `elmokit.io.output_lock`).

Several processes (torchrun): process `rank` of `world_size` embeds the lines i with
i % world_size == rank into its own segments; after a barrier, rank 0 merges every segment.

Memory: bounded by one batch (a long sentence: one window batch and its own output array), one
open segment, and at the end the `sentence_to_index` dict and JSON (about 3x the input's text,
built by re-reading the input); the vectors are never all held.
"""

from __future__ import annotations

from typing import Protocol

import array
import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import numbers
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from elmokit.inference.segments import (
    FILE_FORMATS,
    INDEX_KEY,
    NPZ_MAX_NAME_BYTES,
    SEGMENT_TYPES,
    NpzSegment,
    Hdf5Segment,
    SentenceRow,
    sentence_key,
)
from elmokit.inference.elmo import bilm_precision
from elmokit.model.weights import model_fingerprint
from elmokit.inference.layers import check_output_format, shape_output
from elmokit.inference.windows import position_windows

from elmokit.extras import require
from elmokit.tokenizer import check_lang, tokenize as moses_tokens
from elmokit.io import atomic_write_text, check_replaceable, durable_replace, output_lock, refuse_overwrite
from elmokit.textfiles import CorpusError, not_a_regular_file, read_lines
from elmokit.inference.estimate import EmbedReport, InputScan, check_output_size
from elmokit.progress import check_stop, progress_bar

log = logging.getLogger(__name__)
PROGRESS_GLOB = "progress-rank*.json"


class Embedder(Protocol):
    """What this module needs of an `ElmoEmbedder` (inference/embedder.py, which calls into this
    module for `embed_file`; a protocol, so the two modules do not import each other)."""

    STREAM_WINDOW: int
    POSITION_BUDGET: int
    bilm: torch.nn.Module
    carried: object

    def embed_batch(self, batch: Sequence[Sequence[str]]) -> list[np.ndarray]: ...

    def embed_many(self, sentences: Sequence[Sequence[str]], rows: int | None = None) -> list[np.ndarray]: ...

    def rows_for(self, batch_size: int | None) -> int: ...

    def window_sentences(self, batch_size: int | None) -> int: ...

    def stream_rows(self, sentences: Sequence[Sequence[str]]) -> int: ...


@dataclass
class EmbedOptions:
    """What to write; see the module docstring for the shapes."""

    output_format: str = "all"  # "all", "top" or "average"
    file_format: str = "hdf5"  # "hdf5" or "npz"
    sentence_vectors: bool = False  # mean over each sentence's tokens instead of per-token arrays
    use_sentence_keys: bool = False  # key by the sentence text instead of the line number
    forget_sentences: bool = False  # no sentence_to_index
    tokenize: bool = False  # Moses-tokenize raw text instead of splitting on whitespace
    lang: str = "en"  # Moses language, with tokenize
    batch_size: int | None = None  # rows of the recurrence (stateful: sentences a batch); None: the engine's choice
    max_length: int = 256  # longer sentences are embedded in overlapping windows of this length
    overlap: int = 32  # context tokens kept on each side of a window's used part
    checkpoint_every: int = 2000  # sentences per segment file (the unit of --resume)

    def __post_init__(self) -> None:
        check_output_format(self.output_format)
        if self.file_format not in FILE_FORMATS:
            raise ValueError(f"file format must be one of {FILE_FORMATS}, got {self.file_format!r}")
        if self.file_format == "parquet" and self.use_sentence_keys:
            raise ValueError("use-sentence-keys names HDF5 datasets or .npz members; a Parquet output keys "
                             "its rows by the `line` column and holds the text in `sentence`: drop it")
        for name in ("batch_size", "checkpoint_every", "max_length", "overlap"):
            value = getattr(self, name)
            if value is None and name == "batch_size":  # the engine's choice
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # a Python caller's: the CLI's are ints
                what = "an int or None (the engine's choice)" if name == "batch_size" else "an int"
                raise TypeError(f"{name} must be {what}, got {value!r}")
            setattr(self, name, int(value))  # a numpy integer too, written as JSON in the progress record
        for name in ("batch_size", "checkpoint_every"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be >= 1, got {getattr(self, name)}")
        check_windows(self.max_length, self.overlap)
        if not isinstance(self.lang, str) or not self.lang.strip():
            raise ValueError(f"lang (--lang) must be a Moses language code such as 'en', got {self.lang!r}")
        if self.tokenize:  # not silently English
            check_lang(self.lang, "lang (--lang)")

    def identity(self) -> dict:
        """The options that change the output (a resumed run must use the same)."""
        record = dataclasses.asdict(self)
        for name in ("batch_size", "checkpoint_every"):  # these change how, not what
            del record[name]
        return record


def check_windows(max_length: int, overlap: int) -> None:
    """ValueError unless a sentence's windows can advance: max_length > 2 x overlap >= 0."""
    if overlap < 0 or max_length <= 2 * overlap:
        raise ValueError(f"max-length ({max_length}) must be more than twice the overlap ({overlap}), and the "
                         f"overlap >= 0")


# ---------------------------------------------------------------------------------------------
# Reading: lines, tokens, fingerprints
# ---------------------------------------------------------------------------------------------
def scan_input(path: Path, use_sentence_keys: bool, file_format: str = "hdf5",
               tokenize: Callable[[str], list[str]] = str.split) -> InputScan:
    """Read the whole input once before anything is written, so that a bad line (or a sentence
    too long to be a .npz key) stops the run at once and leaves nothing behind; count the
    tokens of each line with `tokenize` for the size estimate and the progress bar."""
    n_lines, text_bytes, line_tokens = 0, 0, array.array("I")
    for n_lines, line in enumerate(read_lines(path), start=1):
        line_tokens.append(len(tokenize(line)))
        text_bytes += len(line) + 1
        if use_sentence_keys and file_format == "npz":
            size = len(f"{_key(path, n_lines - 1, line, use_sentence_keys)}.npy".encode("utf-8"))
            if size > NPZ_MAX_NAME_BYTES:
                raise ValueError(f"{path}:{n_lines}: this sentence is too long to be a key of a .npz file "
                                 f"({size:,} bytes as a member name; a zip file allows {NPZ_MAX_NAME_BYTES:,}): "
                                 "write HDF5 (file_format='hdf5'), or key by line number (use_sentence_keys=False)")
    return InputScan(n_lines, line_tokens, text_bytes)


def make_tokenizer(tokenize: bool, lang: str = "en") -> Callable[[str], list[str]]:
    """str -> tokens: whitespace splitting, or `elmokit.tokenize` (Moses, `escape=False`, as
    `elmo prepare` tokenizes) for raw text; MissingExtraError if sacremoses is not installed."""
    if not tokenize:
        return str.split
    require("prepare", "Moses tokenization (--tokenize)", ("sacremoses",))
    return functools.partial(moses_tokens, lang=lang)  # the one Moses tokenizer (elmokit.tokenize)


def input_fingerprint(path: Path) -> dict:
    """Size, mtime and a hash of the first MiB: enough to notice a changed input on --resume."""
    stat = path.stat()
    with open(path, "rb") as handle:
        head = hashlib.sha256(handle.read(1 << 20)).hexdigest()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "head_sha256": head}


def check_input_file(path: Path, what: str = "input") -> None:
    """A readable, non-empty regular file, or an error naming it."""
    if path.is_dir():
        raise IsADirectoryError(f"{what} is a directory, expected a text file: {path}")
    if not path.is_file():
        if path.exists():
            raise CorpusError(f"{what}: {not_a_regular_file(path)}")
        raise FileNotFoundError(f"{what} file not found: {path}")
    if path.stat().st_size == 0:
        raise ValueError(f"{what} file is empty: {path}")


# ---------------------------------------------------------------------------------------------
# Embedding: windows for long sentences, then the requested form
# ---------------------------------------------------------------------------------------------
def split_windows(n_tokens: int, max_length: int, overlap: int) -> list[tuple[int, int, int, int]]:
    """Windows (start, end, keep_from, keep_to) covering a sentence of `n_tokens` tokens.

    Each window holds at most `max_length` tokens; the kept parts tile [0, n_tokens) in order, and
    every kept token has at least `overlap` tokens of context on both sides inside its window
    (fewer only at the sentence's own ends). A short sentence is one window.
    """
    if n_tokens <= max_length:
        return [(0, n_tokens, 0, n_tokens)]
    stride = max_length - 2 * overlap
    starts = [*range(0, n_tokens - max_length, stride), n_tokens - max_length]
    windows, keep_from = [], 0
    for i, start in enumerate(starts):
        keep_to = n_tokens if i == len(starts) - 1 else start + max_length - overlap
        windows.append((start, start + max_length, keep_from, keep_to))
        keep_from = keep_to
    return windows


def embed_sentences(embedder: Embedder, sentences: Iterable[Sequence[str]], batch_size: int | None = None,
                    max_length: int = 256, overlap: int = 32) -> Iterator[np.ndarray]:
    """(L+1, n_i, 2P) float32 per sentence, in order; no sentence is ever longer than `max_length`
    for the model (see `split_windows`). Stateless, a window of `STREAM_WINDOW` batches streams
    through `batch_size` rows of the recurrence (`ElmoEmbedder.embed_many`); stateful, batches
    of `batch_size` consecutive pieces carry the state, as in the original."""
    for group in embed_sentence_groups(embedder, sentences, batch_size, max_length, overlap):
        yield from group


def embed_sentence_groups(embedder: Embedder, sentences: Iterable[Sequence[str]], batch_size: int | None = None,
                          max_length: int = 256, overlap: int = 32) -> Iterator[list[np.ndarray]]:
    """`embed_sentences` as the lists of arrays that are computed at once (a window of batches):
    what a progress bar counts, since the sentences of a group are all done at the same moment.
    `batch_size` None: the engine's choice (`ElmoEmbedder.rows_for`; stateless, the first window's
    `ElmoEmbedder.stream_rows` for every window)."""
    stateful = embedder.carried is not None
    rows = embedder.rows_for(batch_size)
    if stateful:  # the original's batches: `batch_size` consecutive sentences share the carried state
        iterator = iter(sentences)
        batches = iter(lambda: list(itertools.islice(iterator, rows)), [])
    else:
        batches = position_windows(sentences, embedder.window_sentences(batch_size),
                                   embedder.POSITION_BUDGET)
    for batch in batches:
        pieces = [(row, piece) for row, sentence in enumerate(batch)
                  for piece in split_windows(len(sentence), max_length, overlap)]
        texts = [batch[row][start:end] for row, (start, end, _, _) in pieces]
        if stateful:
            layers = [array for first in range(0, len(texts), rows)
                      for array in embedder.embed_batch(texts[first:first + rows])]
        else:
            batch_size = batch_size or embedder.stream_rows(texts)  # one row count for the whole stream
            layers = embedder.embed_many(texts, rows=batch_size)
        kept = [array[:, keep_from - start:keep_to - start]  # (L+1, k, 2P)
                for array, (_, (start, _, keep_from, keep_to)) in zip(layers, pieces)]
        group, first = [], 0
        for row in range(len(batch)):
            last = first
            while last < len(pieces) and pieces[last][0] == row:
                last += 1
            group.append(kept[first] if last - first == 1 else np.concatenate(kept[first:last], axis=1))
            first = last
        yield group


# ---------------------------------------------------------------------------------------------
# Progress of one rank, saved beside its segments
# ---------------------------------------------------------------------------------------------
@dataclass
class RankProgress:
    """What one process has finished: every line < `next_line` that is its own is in `segments`."""

    path: Path
    identity: dict
    next_line: int = 0
    segments: list[str] = field(default_factory=list)
    done: bool = False

    def save(self) -> None:
        record = {"identity": self.identity, "next_line": self.next_line, "segments": self.segments,
                  "done": self.done}
        atomic_write_text(self.path, json.dumps(record, indent=1))

    @classmethod
    def load(cls, path: Path) -> RankProgress:
        """The progress saved at `path`, checked: a file that is not what `save` writes (hand-edited,
        or naming a segment that is not this rank's file in its folder) is a PartialOutputError."""
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as error:
            raise PartialOutputError(f"{path}: not a progress record of elmo embed ({error})") from None
        rank = path.name.removeprefix("progress-rank").removesuffix(".json")
        fields = {"identity": dict, "next_line": int, "segments": list, "done": bool}
        if not isinstance(record, dict) or set(record) != set(fields) or not all(
                isinstance(record[key], kind) and (kind is bool or not isinstance(record[key], bool))
                for key, kind in fields.items()):
            raise PartialOutputError(f"{path}: not a progress record of elmo embed (expected the keys "
                                     f"{', '.join(fields)} with a dict, int, list and bool)")
        segment_name = re.compile(rf"rank{re.escape(rank)}-\d{{5}}\.(h5|npz|parquet)")
        strange = [name for name in record["segments"] if not (isinstance(name, str) and segment_name.fullmatch(name))]
        if strange or record["next_line"] < 0:
            raise PartialOutputError(f"{path}: names {strange[0]!r}, which is not a segment of rank {rank} in "
                                     f"{path.parent}" if strange else f"{path}: next_line is negative")
        return cls(path, record["identity"], record["next_line"], record["segments"], record["done"])


class PartialOutputError(ValueError):
    """The partial output of an earlier run was changed or lost part of its work: it cannot be
    resumed or merged (overwrite=True starts over)."""

    def __init__(self, problem: str):
        super().__init__(f"{problem}; the partial output cannot be resumed: pass overwrite=True to start over")


def partial_dir(output: Path) -> Path:
    return output.with_name(output.name + ".partial")


def prepare_partial(partial: Path, resume: bool, overwrite: bool) -> None:
    """Rank 0, before anyone writes: keep the partial directory to resume, or start afresh, which
    discards an earlier run's work only with `overwrite`."""
    ours = partial.is_dir() and (not any(partial.iterdir()) or any(partial.glob(PROGRESS_GLOB)))
    if partial.exists() and not ours:
        raise ValueError(f"{partial} exists and is not a partial output of `elmo embed`; move it away")
    if partial.exists() and not resume and not overwrite and any(partial.iterdir()):
        raise FileExistsError(f"{partial} holds the unfinished work of an earlier run: continue it with "
                              "resume=True, or pass overwrite=True to discard it and start over")
    if partial.exists() and not resume:
        log.warning(f"discarding the partial output of an earlier run: {partial} (resume=True continues it)")
        shutil.rmtree(partial)
    elif resume and not partial.exists():
        log.warning(f"nothing to resume ({partial} does not exist): starting from the first line")
    partial.mkdir(parents=True, exist_ok=True)


def _precisions(made: dict, now: dict) -> str:
    """What a resume that changes the precision says: the partial's and this run's (dtype)."""
    return f" (the partial's vectors: {made['precision']}; this run's: {now['precision']}, its dtype)"


def start_progress(partial: Path, rank: int, identity: dict, resume: bool) -> RankProgress:
    path = partial / f"progress-rank{rank}.json"
    if resume and path.exists():
        progress = RankProgress.load(path)
        changed = sorted(key for key in identity if identity[key] != progress.identity.get(key))
        if "precision" in changed and "precision" not in progress.identity:  # an older elmokit's: float32 or int8
            changed.remove("precision")
            log.warning(f"resuming {partial}, made by an older elmokit that did not record its precision, in "
                        f"{identity['precision']}: if it was made in another one (--dtype int8 or float32), its "
                        "vectors mix the two; start over with --overwrite to be sure")
        differ = [key for key in changed if key not in ("batch_size", "checkpoint_every")]
        if differ:
            if "precision" in differ and "model" in differ:  # the fingerprint is of the weights in that precision
                differ.remove("model")
            raise ValueError(f"cannot resume {partial}: it was made with a different {', '.join(differ)}"
                             f"{_precisions(progress.identity, identity) if 'precision' in differ else ''}; "
                             f"start over with overwrite=True (elmo embed --overwrite), which deletes its "
                             f"unfinished work, or resume with what it was made with")
        if "checkpoint_every" in changed and "checkpoint_every" in progress.identity:  # (older: not recorded)
            identity["checkpoint_every"] = progress.identity["checkpoint_every"]  # its segments' size: kept
            log.warning(f"resuming {partial} with segments of {identity['checkpoint_every']} sentences "
                        f"(--checkpoint-every), as it was begun")
        if "batch_size" in changed and "batch_size" in progress.identity:  # (older partials did not record it)
            now, then = (f"{size} rows" if size else "the engine's rows" for size in
                         (identity["batch_size"], progress.identity["batch_size"]))
            log.warning(f"resuming {partial} at {now}, where it was made at {then}: the vectors are the same up to "
                        "float32 rounding (products of other shapes round differently, within 2e-6), not bit for bit")
        progress.identity = identity
    else:
        progress = RankProgress(path, identity)
    for stray in partial.glob(f"rank{rank}-*"):  # a segment being written when the run stopped
        if stray.name not in progress.segments:
            stray.unlink()
    progress.save()
    return progress


# ---------------------------------------------------------------------------------------------
# The run: this rank's segments, then (rank 0) the merge
# ---------------------------------------------------------------------------------------------
def embed_file(embedder: Embedder, input_path: str | Path, output_path: str | Path,
               options: EmbedOptions | None = None, *, overwrite: bool = False, resume: bool = False,
               progress: bool = True, rank: int = 0, world_size: int = 1,
               barrier: Callable[[], None] = lambda: None, max_output_bytes: int | None = None) -> int:
    """Embed `input_path` into `output_path` (see the module docstring). Returns the number of
    sentences this process embedded. With several processes, every rank calls this with the same
    arguments and a `barrier` that waits for all of them. An existing output is replaced only
    with `overwrite` (FileExistsError otherwise). `max_output_bytes`: refuse (before
    writing anything) an output estimated larger (`OutputTooLargeError`); see `embed_file_report`."""
    return embed_file_report(embedder, input_path, output_path, options, overwrite=overwrite, resume=resume,
                             progress=progress, rank=rank, world_size=world_size, barrier=barrier,
                             max_output_bytes=max_output_bytes).n_sentences


def embed_file_report(embedder: Embedder, input_path: str | Path, output_path: str | Path,
                      options: EmbedOptions | None = None, *, overwrite: bool = False, resume: bool = False,
                      progress: bool = True, rank: int = 0, world_size: int = 1,
                      barrier: Callable[[], None] = lambda: None,
                      max_output_bytes: int | None = None) -> EmbedReport:
    """`embed_file`, returning an `EmbedReport`. Before anything is written, the output's size
    is estimated (`estimate_output_bytes`) and logged; above `max_output_bytes` the run stops
    with `OutputTooLargeError`; with less free disk space than the run needs (the segments and
    the merged output side by side), a warning is logged."""
    started = time.perf_counter()
    if resume and overwrite:  # as elmo train: continuing a run and replacing it are opposites
        raise ValueError("give resume=True (continue the unfinished run) or overwrite=True (start over), not both")
    options = options or EmbedOptions()
    input_path, output_path = Path(input_path), Path(output_path)
    check_input_file(input_path)
    if options.tokenize:  # before anything is written
        require("prepare", "Moses tokenization (--tokenize)", ("sacremoses",))
    if output_path.is_dir():
        raise IsADirectoryError(f"output is a directory, expected a file name: {output_path}")
    check_replaceable(output_path)  # not a device or a pipe, which the rename would replace
    lock = output_lock(lock_path(output_path), str(output_path)) if rank == 0 else contextlib.nullcontext()
    with lock:  # rank 0 speaks for its run: a second `elmo embed` to this output stops here
        refuse_overwrite([output_path], overwrite)
        scan = scan_input(input_path, options.use_sentence_keys, options.file_format,
                          make_tokenizer(options.tokenize, options.lang))
        if scan.n_lines == 0:
            raise ValueError(f"input file is empty: {input_path}")
        estimate = check_output_size(embedder, scan, options, input_path, output_path, max_output_bytes,
                                     speak=rank == 0)
        partial = partial_dir(output_path)
        if rank == 0:
            prepare_partial(partial, resume, overwrite)
        barrier()
        identity = {"input": input_fingerprint(input_path), "options": options.identity(),
                    "model": model_fingerprint(embedder.bilm), "world_size": world_size,
                    "precision": bilm_precision(embedder.bilm),  # int8 keeps float32 weights: not in the model's
                    "batch_size": options.batch_size,  # rounding only: a resume may change it
                    "checkpoint_every": options.checkpoint_every}  # a resume keeps the partial's
        rank_progress = start_progress(partial, rank, identity, resume)
        options = dataclasses.replace(options, checkpoint_every=rank_progress.identity["checkpoint_every"])
        n_embedded, n_tokens = _embed_rank(embedder, input_path, scan, partial, options, rank_progress, rank,
                                           world_size, show_progress=progress and rank == 0)
        barrier()
        if rank == 0:
            merge_segments(input_path, partial, output_path, options, world_size,
                           show_progress=progress and scan.n_lines >= 10_000)  # a long copy only
        barrier()
    output_bytes = output_path.stat().st_size if rank == 0 else None
    return EmbedReport(n_embedded, n_tokens, time.perf_counter() - started, estimate, output_bytes)


def lock_path(output_path: Path) -> Path:
    """The lock file of an output: OUTPUT.lock beside it."""
    return output_path.with_name(output_path.name + ".lock")


@contextlib.contextmanager
def _writing(path: Path, file_format: str, partial: Path) -> Iterator[Hdf5Segment | NpzSegment]:
    """A new segment file (or the merged output) at `path` to write: on any error it is removed,
    and a failed write (a full disk, a quota) becomes one OSError that says the finished
    segments are kept and how to continue."""
    segment = None
    try:
        segment = SEGMENT_TYPES[file_format](path, "w")
        yield segment
    except BaseException as error:
        if segment is not None:
            segment.abort()
        path.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise OSError(error.errno, f"writing in {partial} failed ({error.strerror or error}); the "
                                       "finished segments are kept there: make room and run again "
                                       "with resume=True") from None
        raise


def _embed_rank(embedder: Embedder, input_path: Path, scan: InputScan, partial: Path, options: EmbedOptions,
                progress: RankProgress, rank: int, world_size: int, show_progress: bool) -> tuple[int, int]:
    """Embed this rank's lines into segments; (sentences, tokens) embedded in this call."""
    tokenize = make_tokenizer(options.tokenize, options.lang)
    own = ((i, line) for i, line in enumerate(read_lines(input_path))
           if i % world_size == rank and i >= progress.next_line)
    done_before = scan.tokens_of(range(rank, min(progress.next_line, scan.n_lines), world_size))
    bar = progress_bar(total=scan.tokens_of(range(rank, scan.n_lines, world_size)), initial=done_before,
                       unit="tokens", unit_scale=True, desc="embedding", enabled=show_progress)
    n_embedded = n_tokens = 0
    with bar:
        while chunk := list(itertools.islice(own, options.checkpoint_every)):
            name = f"rank{rank}-{len(progress.segments):05d}{SEGMENT_TYPES[options.file_format].suffix}"
            token_lists = [tokenize(line) for _, line in chunk]
            rows = iter([(_key(input_path, i, line, options.use_sentence_keys),
                          SentenceRow(i, None if options.forget_sentences else line, tokens))
                         for (i, line), tokens in zip(chunk, token_lists)])
            with _writing(partial / (name + ".tmp"), options.file_format, partial) as segment:
                groups = embed_sentence_groups(embedder, token_lists, options.batch_size,
                                               options.max_length, options.overlap)
                for group in groups:  # the bar moves once a group, when its sentences are done
                    tokens = sum(layers.shape[-2] for layers in group)
                    for layers, (key, row) in zip(group, rows):  # group first: zip takes no row past its end
                        segment.write(key, shape_output(layers, options.output_format, options.sentence_vectors), row)
                    bar.update(tokens)
                    n_tokens += tokens
                    check_stop()  # a SIGTERM whose interrupt was lost (`elmokit.progress.request_stop`)
                segment.close()
                durable_replace(segment.path, partial / name)
                progress.segments.append(name)
                progress.next_line = chunk[-1][0] + 1
                progress.save()
            n_embedded += len(chunk)
    progress.done = True
    progress.save()
    return n_embedded, n_tokens


def _key(input_path: Path, line_index: int, line: str, use_sentence_keys: bool) -> str:
    return sentence_key(line) if use_sentence_keys else str(line_index)


def merge_segments(input_path: Path, partial: Path, output_path: Path, options: EmbedOptions,
                   world_size: int, show_progress: bool = False) -> None:
    """Every rank's segments, copied array by array into one new file with `sentence_to_index`,
    renamed onto `output_path`; then the partial directory is removed (so the disk holds the
    output twice for a moment)."""
    names: list[tuple[int, str]] = []
    for rank in range(world_size):
        progress = RankProgress.load(partial / f"progress-rank{rank}.json")
        if not progress.done:
            raise RuntimeError(f"rank {rank} of {world_size} did not finish; run again with resume=True")
        names += [(rank, name) for name in progress.segments]
    segment_type = SEGMENT_TYPES[options.file_format]
    merged = partial / f"merged{segment_type.suffix}"  # a fresh file: a killed merge can be redone
    bar = progress_bar(total=len(names), desc=f"writing {output_path.name}", unit="segments",
                       enabled=show_progress)
    with bar, _writing(merged, options.file_format, partial) as out:
        expected = {rank: _segment_keys(input_path, rank, world_size, options) for rank in range(world_size)}
        for rank, name in names:
            keys, lines = next(expected[rank], (None, "no line"))
            source = segment_type(partial / name, "r")
            try:
                for key in source.copy_to(out):
                    if keys is not None:
                        keys.discard(key)
            finally:
                source.close()
            if keys is None or keys:  # a segment too many, or one without all of its lines
                raise PartialOutputError(f"{partial / name} does not hold {lines} of {input_path}")
            bar.update(1)
        for rank, rest in expected.items():
            for _, lines in itertools.islice(rest, 1):  # lines that no segment holds
                raise PartialOutputError(f"{lines} of {input_path} (rank {rank}) are in no segment of {partial}")
        if not options.forget_sentences and segment_type.sentence_index:
            index = partial / "sentence_to_index.json"
            write_sentence_index(input_path, options.use_sentence_keys, index)
            out.write_json(INDEX_KEY, index)
        out.close()
        durable_replace(merged, output_path)
    shutil.rmtree(partial)


def _segment_keys(input_path: Path, rank: int, world_size: int,
                  options: EmbedOptions) -> Iterator[tuple[set[str], str]]:
    """The keys each segment of `rank` must hold, in order, and its lines ("lines 1-2000")."""
    own = ((i, line) for i, line in enumerate(read_lines(input_path)) if i % world_size == rank)
    while chunk := list(itertools.islice(own, options.checkpoint_every)):
        yield ({_key(input_path, i, line, options.use_sentence_keys) for i, line in chunk},
               f"lines {chunk[0][0] + 1}-{chunk[-1][0] + 1}")


def write_sentence_index(input_path: Path, use_sentence_keys: bool, json_path: Path) -> None:
    """Write the JSON {sentence text: key} (a repeated sentence once, in its first place, with its
    last line's key), exactly `json.dumps` of that dict, streamed to `json_path`: memory holds an
    8-byte hash per line and the repeated sentences, not the index (which was 5x the input).

    Two passes: hashes find the lines that may repeat (a collision only costs memory); the second
    pass keeps the last key of those lines alone, and writes every other line as it comes."""
    hashes = np.fromiter(map(hash, read_lines(input_path)), dtype=np.int64)
    ordered = np.sort(hashes)
    may_repeat = np.isin(hashes, ordered[1:][ordered[1:] == ordered[:-1]])
    del hashes, ordered
    last_key: dict[str, str | None] = {}
    for i, line in enumerate(read_lines(input_path)):
        if may_repeat[i]:
            last_key[line] = _key(input_path, i, line, use_sentence_keys)
    with open(json_path, "w", encoding="ascii") as out:
        out.write("{")
        for i, line in enumerate(read_lines(input_path)):
            key = last_key.get(line) if may_repeat[i] else _key(input_path, i, line, use_sentence_keys)
            if key is not None:  # None: a repeated sentence, already written
                out.write(f"{', ' if i else ''}{json.dumps(line)}: {json.dumps(key)}")
                if may_repeat[i]:
                    last_key[line] = None
        out.write("}")


def fix_malloc_mmap_threshold(threshold: int = 256 * 2**10) -> bool:
    """Keep a long embedding run's resident memory from creeping up with the input (glibc only).

    glibc raises its mmap threshold each time it frees a large mapped block (up to 32 MB); from
    then on the batches' tensors come from the heap, where blocks of ever-different sizes leave
    free fragments it cannot return: peak RSS grew from 0.64 GB (100k tokens) to 0.99 GB (2M
    tokens). A fixed threshold (which also switches the adjustment off) gives every block above
    it its own mapping, returned to the system when freed: 0.49 GB to 0.58 GB. The price is
    page faults, some 15-20 % of the speed (bench/results/embed_memory.md). A threshold the user
    set (MALLOC_MMAP_THRESHOLD_) is left alone. Returns whether it was set here.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):  # not glibc
        return False
    M_MMAP_THRESHOLD = -3
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, threshold) == 1


def distributed_from_env() -> tuple[int, int, Callable[[], None]]:
    """(rank, world_size, barrier) under torchrun (RANK / WORLD_SIZE set): joins a gloo process
    group so the ranks can wait for each other; (0, 1, no-op) otherwise."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world_size <= 1:
        return 0, 1, lambda: None
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=24))
    return rank, world_size, dist.barrier


def close_distributed() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
