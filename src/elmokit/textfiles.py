"""Reading text files, the one way every reader of elmokit does (embedding, training, tasks):
plain or gzip, strict UTF-8, errors that name the file and the line.

    expand_paths          globs -> files, with errors naming what matched nothing
    open_binary/open_text a plain or .gz file as bytes or as UTF-8 text
    read_lines            the stripped lines of a file, lazily
    locate_decode_error   'path:LINE: invalid UTF-8 ...' for the first bad line
    text_size             the bytes of text, for a progress bar

A leaf module: it imports nothing of elmokit, so inference and training read files through it
without importing each other.
"""

from __future__ import annotations

import glob
import gzip
import io
import os
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO


class CorpusError(ValueError):
    """A corpus file that cannot be read as asked; the message names the file and line."""


def expand_paths(patterns: Iterable[str | Path]) -> list[Path]:
    """Files named by `patterns` (paths or globs), each pattern's matches sorted, duplicates dropped.

    Raises FileNotFoundError naming the pattern that matched nothing or the directory given.
    """
    paths: list[Path] = []
    for pattern in map(str, patterns):
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise FileNotFoundError(f"no file matches {pattern!r}")
        for match in matches:
            path = Path(match)
            if path.is_dir():
                raise IsADirectoryError(f"{path} is a directory; give files or a glob such as '{path}/*.gz'")
            if not path.is_file():
                if path.exists():
                    raise CorpusError(not_a_regular_file(path))
                raise FileNotFoundError(f"no such file: {path}")
            paths.append(path)
    return list(dict.fromkeys(paths))


def same_files(a: Iterable[str | Path], b: Iterable[str | Path]) -> bool:
    """Whether two lists of paths name the same files in the same order, however spelt (relative to
    the working folder, `~`, `..`, symbolic links)."""
    def real(paths: Iterable[str | Path]) -> list[str]:
        return [os.path.realpath(os.path.expanduser(str(path))) for path in paths]
    return real(a) == real(b)


def not_a_regular_file(path: Path) -> str:
    """The message for a pipe, socket or device given as an input file: elmokit reads its inputs
    more than once (a scan before writing anything, a resume, an epoch), which a pipe cannot do."""
    return (f"{path} is not a regular file (a pipe, or a device such as /dev/stdin): inputs are read "
            "more than once, so save it to a file first")


def is_gzip(path: Path) -> bool:
    return path.suffix == ".gz"


class GzipReader(gzip.GzipFile):
    """A .gz file read as bytes, whose reads turn the errors of a fake, corrupt or truncated
    file (gzip's BadGzipFile, zlib's error, EOFError) into a CorpusError naming the file."""

    def _checked(self, read, *args):
        try:
            return read(*args)
        except (EOFError, gzip.BadGzipFile, zlib.error) as error:
            raise CorpusError(f"{self.name}: corrupt, truncated or not a gzip file ({error})") from None

    def read(self, size: int = -1) -> bytes:
        return self._checked(super().read, size)

    def read1(self, size: int = -1) -> bytes:
        return self._checked(super().read1, size)

    def readline(self, size: int = -1) -> bytes:
        return self._checked(super().readline, size)

    def peek(self, n: int) -> bytes:
        return self._checked(super().peek, n)


UTF8_BOM = b"\xef\xbb\xbf"  # what Notepad and others put first in a "UTF-8 with BOM" file
MAX_LINE_BYTES = 1 << 23  # 8 MiB: a long paragraph is a few KB; ELMOKIT_MAX_LINE_BYTES raises it


class LineTooLongError(CorpusError):
    """A line longer than the limit: one sentence (or paragraph) a line is expected, and a line
    is held in memory whole (several times over, once escaped and tokenized)."""


def max_line_bytes() -> int:
    """The longest line any reader takes, in bytes: ELMOKIT_MAX_LINE_BYTES, else MAX_LINE_BYTES."""
    value = os.environ.get("ELMOKIT_MAX_LINE_BYTES", "")
    if not value:
        return MAX_LINE_BYTES
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"ELMOKIT_MAX_LINE_BYTES must be a positive number of bytes, got {value!r}")
    return int(value)


class TextBytes(io.RawIOBase):
    """The bytes of a plain or .gz text file as every reader sees them: a leading UTF-8 byte
    order mark dropped (it is not text: kept, it would glue itself to the first token), and a
    line longer than `max_line_bytes()` stopped with LineTooLongError naming file:line before it
    is read whole (a 2 GB line of NULs, from a gzip bomb, would fill the memory)."""

    def __init__(self, path: Path):
        self.name = str(path)
        self._limit = max_line_bytes()
        self._inner = GzipReader(path, "rb") if is_gzip(path) else open(path, "rb", buffering=0)
        self._started = False
        self._line_number = 1  # of the line being read
        self._line_bytes = 0  # read of it so far

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        size = min(len(view), self._limit)  # no whole line past the limit fits in one read
        if not self._started:
            self._started = True
            head = self._read_fully(len(UTF8_BOM))
            head = b"" if head == UTF8_BOM else head
            data = head + self._inner.read(max(size - len(head), 0))
        else:
            data = self._inner.read(size)
        self._count_lines(data)
        view[:len(data)] = data
        return len(data)

    def _count_lines(self, data: bytes) -> None:
        first = data.find(b"\n")
        if self._line_bytes + (len(data) if first < 0 else first) > self._limit:
            raise LineTooLongError(
                f"{self.name}:{self._line_number}: a line longer than {self._limit:,} bytes; the input must hold "
                "one sentence (or paragraph) a line (ELMOKIT_MAX_LINE_BYTES raises the limit)")
        if first < 0:
            self._line_bytes += len(data)
        else:
            self._line_number += data.count(b"\n")
            self._line_bytes = len(data) - data.rfind(b"\n") - 1

    def _read_fully(self, size: int) -> bytes:
        data = b""
        while len(data) < size and (more := self._inner.read(size - len(data))):
            data += more
        return data

    def close(self) -> None:
        if not self.closed:
            self._inner.close()
        super().close()


def open_binary(path: Path) -> IO[bytes]:
    """A plain or .gz file as bytes, without a leading byte order mark (`TextBytes`)."""
    return io.BufferedReader(TextBytes(path), buffer_size=1 << 16)


def open_text(path: Path) -> IO[str]:
    """Open a plain or gzip file as strict UTF-8 text (universal newlines)."""
    return io.TextIOWrapper(open_binary(path), encoding="utf-8", errors="strict")


def text_size(path: Path) -> int:
    """The bytes of text in a plain or .gz file, for a progress bar's total: a gzip member's
    trailer holds its size modulo 2**32 (a larger file, or several members: an estimate)."""
    size = path.stat().st_size
    if not is_gzip(path) or size < 18:
        return size
    with open(path, "rb") as handle:
        handle.seek(-4, os.SEEK_END)
        stored = int.from_bytes(handle.read(4), "little")
    return stored if stored >= size else 4 * size  # wrapped past 4 GiB: text compresses about 4x


def locate_decode_error(path: Path) -> str:
    """'path:LINE: invalid UTF-8 ...' for the first undecodable line of `path` (a re-scan)."""
    with open_binary(path) as handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as error:
                return (f"{path}:{line_number}: invalid UTF-8 byte 0x{raw[error.start]:02x} at byte "
                        f"{error.start} of the line")
    return f"{path}: invalid UTF-8 (the file ends inside a multi-byte character)"


def read_lines(path: Path) -> Iterator[str]:
    """The stripped lines of a UTF-8 file (plain or .gz), lazily; a line that is not UTF-8 raises
    CorpusError naming the file, the line and the byte."""
    with open_binary(path) as handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                yield raw.decode("utf-8").strip()
            except UnicodeDecodeError as error:
                raise CorpusError(f"{path}:{line_number}: invalid UTF-8 byte 0x{raw[error.start]:02x} "
                                  f"at byte {error.start} of the line; the input must be UTF-8") from None
