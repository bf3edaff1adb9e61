# Why this file is long: one pipeline (raw text -> sentences -> tokens -> shards) and the checks a
# trainer makes of its output (the shards prepare.json lists), documented below in that order.
"""Raw text -> tokenized shards, one sentence per line (`elmo prepare`); the file helpers every
corpus reader shares (globs, gzip or plain, UTF-8 errors with file:line) are `elmokit.textfiles`.

The pipeline, in the order text travels:

    input files (plain or .gz, one document or paragraph per line)
      -> lines, decoded as strict UTF-8            (`read_raw_lines`; bad bytes: error or skip)
      -> chunks of lines, on all cores              (`multiprocessing.Pool`, order kept)
      -> sentences                                  (sentencex, rule-based, no model download)
      -> Moses tokens                               (sacremoses, `escape=False`; Chinese: jieba words)
      -> "tok tok tok" lines in OUT/shard-00000.txt.gz, ...   (`ShardWriter`, atomic per shard)

Pre-tokenized input (e.g. PTB: one sentence per line, tokens split by spaces) only has its
whitespace normalised; it is detected automatically when neither `raw` nor `pretokenized` is
forced (see `looks_pretokenized`).
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import itertools
import json
import os
import re
import shutil
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
import multiprocessing
from pathlib import Path
from typing import IO

from elmokit.extras import require
from elmokit.io import atomic_path, atomic_write_text
from elmokit.textfiles import CorpusError, expand_paths, is_gzip, open_binary, text_size
from elmokit.tokenizer import check_lang

CHUNK_LINES = 256  # raw lines per task sent to a worker


# ---------------------------------------------------------------------------------------------
# Files: whole corpora (the file helpers are elmokit.textfiles', shared with inference)
# ---------------------------------------------------------------------------------------------

def require_finished_shards(paths: Sequence[Path], what: str) -> None:
    """CorpusError for a shard (named as `elmo prepare` names them) of a folder whose prepare.json
    says its run did not finish, or does not list it. `elmo prepare` writes prepare.json first as
    unfinished (`"finished": false`), then the shards, then the record of what it wrote: shards
    of an interrupted run would be a corpus cut short without a word. Files named like shards in
    a folder without prepare.json are someone's own, and taken as they are."""
    listed: dict[Path, set[str] | None] = {}
    for path in paths:
        folder = path.parent
        record = folder / PREPARE_RECORD
        if not SHARD_NAME.fullmatch(path.name) or not record.exists():
            continue
        if folder not in listed:
            try:
                saved = json.loads(record.read_text(encoding="utf-8"))
                shards = saved.get("shards") if saved.get("finished", True) is True else None
            except (OSError, ValueError, AttributeError):
                shards = None
            names_only = isinstance(shards, list) and all(isinstance(name, str) for name in shards)
            listed[folder] = set(shards) if names_only else None
        if listed[folder] is None or path.name not in listed[folder]:
            problem = "says the run did not finish, or is unreadable" if listed[folder] is None else "does not list it"
            raise CorpusError(f"{what}: {path} is a shard of an `elmo prepare` that did not finish ({record} "
                              f"{problem}); run elmo prepare again with --overwrite")


def count_targets(paths: Sequence[Path], max_sentences: int | None = None) -> int:
    """About the targets per direction in `paths` (words + one per non-blank line), counted by
    bytes (spaces and newlines), fast enough to be a progress bar's total: exact for files with
    single spaces between tokens, which `elmo prepare` writes."""
    total = lines = 0
    for path in paths:
        with open_binary(path) as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                newlines = block.count(b"\n")
                if max_sentences is not None and lines + newlines >= max_sentences:
                    head = b"\n".join(block.split(b"\n")[:max_sentences - lines])
                    return total + head.count(b" ") + 2 * (max_sentences - lines)
                total += block.count(b" ") + 2 * newlines
                lines += newlines
    return total


def require_tokens(paths: Sequence[Path], what: str) -> None:
    """CorpusError unless some line of `paths` holds a token: an empty or blank-only corpus
    would train nothing (yet save a model) or score nothing (yet print a perplexity of 1).
    Reads up to the first non-blank line. Shards of an `elmo prepare` that did not finish are
    refused too (`require_finished_shards`)."""
    require_finished_shards(paths, what)
    for path in paths:
        try:
            with open_binary(path) as handle:
                if any(line.decode("utf-8", "replace").split() for line in handle):
                    return
        except (OSError, EOFError) as error:  # a corrupt .gz
            raise CorpusError(f"{what}: cannot read {path} ({error})") from None
    names = ", ".join(map(str, paths[:3])) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    raise CorpusError(f"{what} has no tokens: {names} {'is' if len(paths) == 1 else 'are'} empty or blank; "
                      "expected one tokenized sentence a line")


def read_raw_lines(path: Path, skip_bad_lines: bool, stats: PrepareStats) -> Iterator[str]:
    """Non-blank lines of one raw input file, stripped, as str.

    A line that is not valid UTF-8 raises CorpusError naming file:line, or, with
    `skip_bad_lines`, is dropped and counted in `stats.bad_lines`.
    """
    try:
        with open_binary(path) as handle:
            for line_number, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode("utf-8").strip()
                except UnicodeDecodeError as error:
                    where = f"{path}:{line_number}: invalid UTF-8 byte 0x{raw[error.start]:02x}"
                    if not skip_bad_lines:
                        raise CorpusError(f"{where}; fix the file or pass skip_bad_lines=True") from None
                    stats.bad_lines += 1
                    stats.first_bad_line = stats.first_bad_line or where
                    continue
                stats.input_lines += 1
                if line:
                    yield line
    except (EOFError, gzip.BadGzipFile, OSError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise CorpusError(f"{path}: cannot read as {'gzip' if is_gzip(path) else 'text'}: {error}") from None


# ---------------------------------------------------------------------------------------------
# Sentence splitting and Moses tokenization (run inside the worker processes)
# ---------------------------------------------------------------------------------------------

_worker_lang: str = "en"
_worker_moses = None  # the tokenizer of each process: sacremoses.MosesTokenizer, or Chinese words


def is_chinese(lang: str) -> bool:
    """`--lang zh` (or zh-cn, zh_Hans, ...): words come from a Chinese segmenter, not Moses."""
    return lang.lower().replace("_", "-").split("-")[0] == "zh"


class ChineseWords:
    """Chinese word segmentation with jieba (accurate mode, its bundled dictionary: nothing is
    downloaded), in MosesTokenizer's `tokenize(text, escape=False)` shape."""

    def __init__(self):
        import jieba

        jieba.setLogLevel(60)  # no "Building prefix dict" messages on stderr
        self._tokenizer = jieba.Tokenizer()

    def tokenize(self, text: str, escape: bool = False) -> list[str]:
        return self._tokenizer.lcut(text)


def _init_worker(lang: str) -> None:
    global _worker_lang, _worker_moses
    _worker_lang = lang
    if is_chinese(lang):
        _worker_moses = ChineseWords()
    else:
        from sacremoses import MosesTokenizer

        _worker_moses = MosesTokenizer(lang=lang)


def tokenize_paragraphs(paragraphs: Sequence[str]) -> list[str]:
    """Raw paragraphs -> tokenized sentences, each "tok tok tok" (single spaces, never empty)."""
    import sentencex

    if _worker_moses is None:
        _init_worker(_worker_lang)
    sentences = []
    for paragraph in paragraphs:
        paragraph = unicodedata.normalize("NFC", paragraph)  # as elmokit.tokenize: composed accents
        for sentence in sentencex.segment(_worker_lang.split("-")[0].split("_")[0], paragraph):
            tokens = _worker_moses.tokenize(sentence, escape=False)
            line = " ".join(" ".join(tokens).split())  # tokens never hold Unicode spaces
            if line:
                sentences.append(line)
    return sentences


def normalise_pretokenized(lines: Sequence[str]) -> list[str]:
    """Already tokenized sentences: only whitespace runs become single spaces."""
    return [" ".join(line.split()) for line in lines]


_ATTACHED_PUNCTUATION = re.compile(r"\w[,;:!?\"”’)\]]$|^[\"“‘(\[]\w")


def looks_pretokenized(lines: Sequence[str], lang: str = "en") -> bool:
    """True when a sample of lines reads like tokenized text (PTB, 1B Word Benchmark).

    Raw prose has punctuation glued to words ("world," "(see"); tokenized text has it split off.
    The sample is taken as pre-tokenized when under 0.5 % of its tokens carry glued punctuation
    (a trailing "." is ignored: "mr." and "u.s." stay whole in tokenized text). Chinese is written
    without spaces: segmented Chinese has words of a few characters (under 4 on average; the
    raw text's space-separated runs are whole clauses).
    """
    tokens = list(itertools.chain.from_iterable(map(str.split, lines)))
    if not tokens:
        return False
    if is_chinese(lang):
        return sum(map(len, tokens)) < 4 * len(tokens)
    glued = sum(map(bool, map(_ATTACHED_PUNCTUATION.search, tokens)))
    return glued < 0.005 * len(tokens)


# ---------------------------------------------------------------------------------------------
# Output: numbered shards, each written atomically
# ---------------------------------------------------------------------------------------------

SHARD_PATTERN = "shard-{index:05d}.txt{suffix}"
SHARD_NAME = re.compile(r"shard-\d{5,}\.txt(\.gz)?")
PREPARE_RECORD = "prepare.json"  # first UNFINISHED, at the end the record of the shards written
UNFINISHED = {"finished": False, "note": "elmo prepare is writing the shards of this folder, or was stopped"}


class ShardWriter:
    """Writes sentences to OUT/shard-00000.txt[.gz], OUT/shard-00001..., `shard_size` per shard.

    Each shard goes to a temporary file renamed into place when the shard is complete, so a
    killed run leaves only whole shards.
    """

    def __init__(self, out_dir: Path, shard_size: int, compress: bool):
        if shard_size < 1:
            raise ValueError(f"shard_size must be at least 1, got {shard_size}")
        self.out_dir, self.shard_size, self.compress = out_dir, shard_size, compress
        self.paths: list[Path] = []
        self._context = None  # the atomic_path context of the open shard
        self._handle: IO[str] | None = None
        self._lines_in_shard = 0

    def write(self, sentences: Iterable[str]) -> None:
        for sentence in sentences:
            if self._handle is None:
                self._open_next()
            self._handle.write(sentence + "\n")
            self._lines_in_shard += 1
            if self._lines_in_shard == self.shard_size:
                self._commit()

    def close(self) -> None:
        if self._handle is not None:
            self._commit()

    def abort(self) -> None:
        """Drop the shard being written (its temporary file is removed)."""
        if self._handle is not None:
            self._handle.close()
            self._context.__exit__(CorpusError, CorpusError("aborted"), None)
            self._handle = self._context = None

    def _open_next(self) -> None:
        suffix = ".gz" if self.compress else ""
        path = self.out_dir / SHARD_PATTERN.format(index=len(self.paths), suffix=suffix)
        self._context = atomic_path(path)
        tmp = self._context.__enter__()
        self._handle = (gzip.open(tmp, "wt", encoding="utf-8", compresslevel=6) if self.compress
                        else open(tmp, "w", encoding="utf-8"))
        self.paths.append(path)
        self._lines_in_shard = 0

    def _commit(self) -> None:
        self._handle.close()
        self._context.__exit__(None, None, None)
        self._handle = self._context = None


# ---------------------------------------------------------------------------------------------
# The whole pipeline
# ---------------------------------------------------------------------------------------------

@dataclass
class PrepareStats:
    """What `prepare_corpus` read and wrote (saved as OUT/prepare.json)."""

    input_files: list[str] = field(default_factory=list)
    pretokenized: bool = False
    input_lines: int = 0  # decoded lines, blank ones included
    bad_lines: int = 0  # undecodable lines skipped (only with skip_bad_lines)
    first_bad_line: str | None = None  # "path:line: ..." of the first one skipped
    sentences: int = 0
    tokens: int = 0  # words, without sentence boundaries
    shards: list[str] = field(default_factory=list)


def _chunks(lines: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(lines)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def _all_lines(paths: Sequence[Path], skip_bad_lines: bool, stats: PrepareStats) -> Iterator[str]:
    for path in paths:
        yield from read_raw_lines(path, skip_bad_lines, stats)


def prepare_corpus(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    shard_size: int = 100_000,
    workers: int | None = None,
    pretokenized: bool | None = None,
    lang: str = "en",
    compress: bool = True,
    skip_bad_lines: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> PrepareStats:
    """Tokenize raw text files into one-sentence-per-line shards in `out_dir`.

    Args:
        inputs: files or globs, plain or .gz, one document or paragraph per line.
        shard_size: sentences per output shard.
        workers: processes for sentence splitting and tokenization (default: all cores).
        pretokenized: True passes lines through (whitespace normalised), False splits and
            tokenizes, None decides from the first lines (`looks_pretokenized`).
        skip_bad_lines: skip and count undecodable lines instead of stopping at the first.
        overwrite: remove existing shard files in `out_dir` first (else they are an error).

    Returns:
        the counts, also written to `out_dir/prepare.json`.

    Raises:
        MissingExtraError: raw input and sacremoses or sentencex not installed (the `prepare` extra;
            for Chinese, `lang="zh"`, jieba or sentencex: the `zh` extra).
    """
    from elmokit.progress import progress_bar

    paths = expand_paths(inputs)
    out_dir = Path(out_dir)
    stats = PrepareStats(input_files=list(map(str, paths)))
    if pretokenized is None:
        pretokenized = looks_pretokenized(list(itertools.islice(
            _all_lines(paths, True, PrepareStats()), 200)), lang)
    if not pretokenized:  # checked here, before old shards are removed and workers start
        if is_chinese(lang):
            require("zh", f"elmo prepare --lang {lang}")
        else:
            require("prepare", "elmo prepare")
            check_lang(lang, "lang (--lang)")  # sacremoses takes an unknown code as English, silently
    writer = ShardWriter(out_dir, shard_size, compress)  # checks shard_size before anything is touched
    total = sum(map(text_size, paths))  # reads the inputs' sizes (a corrupt .gz fails here) before too
    made = not out_dir.exists()
    _clear_old_shards(out_dir, overwrite)
    stats.pretokenized = pretokenized
    workers = max(1, workers or os.cpu_count() or 1)
    read = [0]  # characters of the input read so far (its lines, as the progress bar counts them)

    def counted(lines: Iterator[str]) -> Iterator[str]:
        for line in lines:
            read[0] += len(line) + 1
            yield line

    chunks = _chunks(counted(_all_lines(paths, skip_bad_lines, stats)), CHUNK_LINES)
    bar = progress_bar(total=total, unit="B", unit_scale=True, enabled=progress, desc="prepare")
    try:
        with contextlib.closing(_sentence_chunks(chunks, pretokenized, workers, lang)) as results:
            for sentences in results:
                writer.write(sentences)
                stats.sentences += len(sentences)
                stats.tokens += sum(map(len, map(str.split, sentences)))
                bar.update(read[0] - bar.n)  # read ahead of the results by the chunks in flight
                bar.set_postfix(sentences=f"{stats.sentences:,}", refresh=False)
        writer.close()
    except BaseException:  # an error or Ctrl-C: nothing half-made is left (a SIGKILL leaves the record "unfinished")
        writer.abort()
        for path in [*writer.paths, out_dir / PREPARE_RECORD]:
            path.unlink(missing_ok=True)
        if made:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    finally:
        bar.close()
    stats.shards = [path.name for path in writer.paths]
    atomic_write_text(out_dir / PREPARE_RECORD, json.dumps({**asdict(stats), "finished": True}, indent=2) + "\n")
    return stats


def _sentence_chunks(chunks: Iterator[list[str]], pretokenized: bool, workers: int,
                     lang: str) -> Iterator[list[str]]:
    """Lists of tokenized sentences, one list per chunk of lines, in input order.

    With several workers, at most 4 chunks per worker are in flight (`Pool.imap` would read
    the whole input ahead into its task queue); results are taken in submission order.
    """
    if pretokenized:
        yield from map(normalise_pretokenized, chunks)
        return
    if workers == 1:
        _init_worker(lang)
        yield from map(tokenize_paragraphs, chunks)
        return
    # spawned, not forked: a fork copies the locks other threads hold (torch's, a server's) into a
    # child that then waits on them forever
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(lang,)) as pool:
        in_flight: collections.deque = collections.deque()
        for chunk in chunks:
            in_flight.append(pool.apply_async(tokenize_paragraphs, (chunk,)))
            if len(in_flight) >= 4 * workers:
                yield in_flight.popleft().get()
        while in_flight:
            yield in_flight.popleft().get()


def _clear_old_shards(out_dir: Path, overwrite: bool) -> None:
    old = sorted(out_dir.glob("shard-*.txt*")) if out_dir.is_dir() else []
    if old and not overwrite:
        raise CorpusError(f"{out_dir} already holds {len(old)} shard files ({old[0].name}, ...); "
                          "pass overwrite=True to replace them or choose another output directory")
    stray = sorted(out_dir.glob(".shard-*.tmp")) if out_dir.is_dir() else []  # a killed run's shard in the making
    # first: from here until the record of the new shards, nothing in this folder is a finished corpus
    atomic_write_text(out_dir / PREPARE_RECORD, json.dumps(UNFINISHED) + "\n")
    for path in [*old, *stray]:
        path.unlink()
