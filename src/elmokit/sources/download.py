"""Model files named by URL: downloaded once into the cache (`elmokit.sources.cache`: where a
URL's file lives, what the cache holds), read from there afterwards.

    fetch(url, check, expected)  -> Path in the cache (downloaded, checked, then renamed into place)

Why this file is long: the transfer loop, its retries, the stall rule and the lock among processes
are one story, how a file gets into the cache; split, a reader would hold several files to see what
one download does and when it gives up.

The transfer is a streaming loop over requests (`_transfer_once`): each download is capped (the
published file's size where it is known, else `ELMOKIT_MAX_DOWNLOAD_GB`), any content encoding is
decoded under the same cap, and the stall rule below ends it. Around it:

* one download when several processes ask at once (a `filelock` lock per file); a process that
  waits says for whom (the pid in the owner file beside the lock) and gives up by the stall rule;
* the file checked before it enters the cache (`expected`: its published size and SHA-256 where
  known; `check`: the options parse, the HDF5 file opens with the datasets its options imply), so
  the cache never holds a partial or broken file; a cached file is checked again when used;
* a mirror and an offline mode. A file from a mirror enters the cache under the published URL
  only when its SHA-256 is pinned and matches; otherwise it is cached under the mirror's own
  URL, so a mirror never stands in for the published file for users who do not use it.

Settings (environment variables):
    ELMOKIT_CACHE            the cache folder (default: the user's cache directory, `platformdirs`)
    ELMOKIT_MIRROR           an http(s) base URL, a file:// URL or a local folder that replaces the
                             scheme and host of a published model's URL, path kept
    ELMOKIT_OFFLINE          1: never download, read the cache only
    ELMOKIT_MAX_DOWNLOAD_GB  the cap on a download whose size is not published (default 4)
    ELMOKIT_STALL_SECONDS    the stall rule: a download (retries included) that receives less than
    ELMOKIT_STALL_BYTES      STALL_BYTES in STALL_SECONDS is abandoned (default 1 MB in 60 s)
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlsplit

from elmokit.sources.cache import (ENV_CACHE, MIRROR_SCHEMES, OWNER_SUFFIX, PARTIAL_SUFFIX, PUBLISHED_HOSTS,
                                   cache_dir, cache_path, canonical_url, file_lock, download_lock_path, url_of)

ENV_MIRROR, ENV_OFFLINE = "ELMOKIT_MIRROR", "ELMOKIT_OFFLINE"
ENV_MAX_GB, ENV_STALL_SECONDS, ENV_STALL_BYTES = "ELMOKIT_MAX_DOWNLOAD_GB", "ELMOKIT_STALL_SECONDS", "ELMOKIT_STALL_BYTES"
DEFAULT_MAX_GB, DEFAULT_STALL_SECONDS, DEFAULT_STALL_BYTES = 4.0, 60.0, 1_000_000
CONNECT_TIMEOUT = 10.0  # seconds to connect (at most the stall window)
RETRIES = 2  # a broken transfer is tried again this many times (after 1 s, then 2 s), within the stall rule
OPTIONS_MAX_BYTES = 1_000_000  # an options JSON is a few hundred bytes: the cap on one whose size is not published
CHUNK = 16 * 1024  # bytes read at once (a gzip body decodes to at most ~1000x this before the cap is checked)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Expected:
    """What a file is known to be: its size in bytes and SHA-256 (hex), each None where unknown,
    and where these figures come from."""

    size: int | None = None
    sha256: str | None = None
    source: str = ""


class DownloadError(OSError):
    """A model file could not be downloaded (and is not in the cache): one line naming the URL
    and the settings that help."""


def is_url(reference: object) -> bool:
    """An http(s) URL (a str): downloaded into the cache, not read as a path."""
    return isinstance(reference, str) and reference.split("://", 1)[0].lower() in ("http", "https")


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


def offline() -> bool:
    return os.environ.get(ENV_OFFLINE, "").strip().lower() not in ("", "0", "false", "no")


def _positive_setting(name: str, default: float) -> float:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise DownloadError(f"{name}={text!r}: expected a positive number")
    return value


def max_download_bytes() -> int:
    """The cap on a download whose size is not published: `ELMOKIT_MAX_DOWNLOAD_GB` (default 4)."""
    return int(_positive_setting(ENV_MAX_GB, DEFAULT_MAX_GB) * 1e9)


def mirrored(url: str) -> str:
    """Where to get `url` from: under `ELMOKIT_MIRROR` (an http(s) or file:// base URL or a local
    folder, path kept) when it is set and the URL is a published model's; else the URL itself."""
    mirror = os.environ.get(ENV_MIRROR, "").strip()
    parts = urlsplit(url)
    if not mirror or parts.hostname not in PUBLISHED_HOSTS:
        return url
    if "://" in mirror and mirror.split("://", 1)[0].lower() not in MIRROR_SCHEMES:
        raise DownloadError(f"{ENV_MIRROR}={mirror}: the scheme {mirror.split('://', 1)[0]!r} is not supported "
                            "(an http:// or https:// base URL, a file:// URL or a local folder)")
    return mirror.rstrip("/") + parts.path


def _settings() -> str:
    return (f"{ENV_MIRROR}={os.environ.get(ENV_MIRROR, '') or '(unset)'}, "
            f"{ENV_CACHE}={cache_dir()}, {ENV_OFFLINE}={os.environ.get(ENV_OFFLINE, '') or '(unset)'}")


# ---------------------------------------------------------------------------------------------
# The cache: one file a URL, at <cache>/<host>/<path>, every name percent-encoded
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# The stall rule
# ---------------------------------------------------------------------------------------------
class StallWatch:
    """The stall rule: less than `min_bytes` received in a window of `seconds` ends a download
    (its retries included), and a wait on another process's download."""

    def __init__(self, seconds: float | None = None, min_bytes: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.seconds = _positive_setting(ENV_STALL_SECONDS, DEFAULT_STALL_SECONDS) if seconds is None else seconds
        self.min_bytes = _positive_setting(ENV_STALL_BYTES, DEFAULT_STALL_BYTES) if min_bytes is None else min_bytes
        self.clock = clock
        self.started = self.window_start = clock()
        self.window_bytes = 0

    def add(self, n: int) -> None:
        self.window_bytes += n

    def stalled(self) -> bool:
        """Whether the window that just ended received too little (a window with enough opens the next)."""
        now = self.clock()
        if now - self.window_start < self.seconds:
            return False
        if self.window_bytes < self.min_bytes:
            return True
        self.window_start, self.window_bytes = now, 0
        return False

    def left(self) -> float:
        """Seconds until the current window ends."""
        return max(0.0, self.window_start + self.seconds - self.clock())

    def rule(self) -> str:
        return (f"less than {self.min_bytes:,.0f} bytes in {self.seconds:g} s ({ENV_STALL_BYTES}, "
                f"{ENV_STALL_SECONDS})")


# ---------------------------------------------------------------------------------------------
# Fetching
# ---------------------------------------------------------------------------------------------
def fetch(url: str, check: Callable[[Path], object] | None = None, progress: bool | None = None,
          expected: Expected | None = None, max_bytes: int | None = None, repair: bool = False) -> Path:
    """The local path of `url`'s file: from the cache, or downloaded into it.

    Args:
        url: an http(s) URL (a published one may be fetched from `ELMOKIT_MIRROR`).
        check: raises if a file is not what it should be: a downloaded file that fails it never
            enters the cache, a cached one that fails it is reported as a broken cache entry.
        progress: show a progress bar (default: when stderr is a terminal, unless `elmo -q`).
        expected: the file's published size and SHA-256, where known (`elmokit.sources.published`).
        max_bytes: the cap where no size is published (default: `ELMOKIT_MAX_DOWNLOAD_GB`).
        repair: a cached file that fails its checks is downloaded again (`elmo download`).

    Raises:
        DownloadError: offline or unreachable and not in the cache, too large, stalled, or the file
            failed its checks.
    """
    canonical = canonical_url(url)
    source = mirrored(canonical)
    trusted = source == canonical or (expected is not None and expected.sha256 is not None)
    identity = canonical if trusted else _identity(source)
    target = cache_path(identity)
    if target.is_dir():
        raise DownloadError(f"{target} is a folder where the cached download of {url} belongs; remove it "
                            f"({ENV_CACHE}={cache_dir()})")
    if target.is_file():
        broken = _broken(target, check, expected, hash_it=repair)
        if broken is None:
            return target
        if not repair:
            raise DownloadError(f"{target} is the cached download of {identity} and it is broken ({broken}); "
                                f"remove it with `elmo cache --remove '{url_of(target.relative_to(cache_dir()))}'`, "
                                "or replace it with `elmo download`")
    if offline():
        raise DownloadError(f"{url} is not in the cache and {ENV_OFFLINE} is set ({_settings()}); "
                            "fill the cache with `elmo download` where there is a network")
    _make_folder(target.parent)
    lock = _acquire(target, url)
    try:
        if target.is_file():
            if _broken(target, check, expected) is None:  # the other process finished it
                return target
            log.warning("replacing the broken cached download %s", target)
        if progress is None:  # elmokit.progress's policy: a bar on a terminal, none under `elmo -q`
            from elmokit.progress import quiet, stderr_is_terminal

            progress = stderr_is_terminal() and not quiet()
        if expected is not None and expected.size:
            cap = Cap(expected.size, "the published file's size")
        elif max_bytes == OPTIONS_MAX_BYTES:
            cap = Cap(max_bytes, "an options file's limit: a few hundred bytes are expected")
        elif max_bytes:
            cap = Cap(max_bytes, "the most a weight file of its options' shapes can need")
        else:
            cap = Cap(max_download_bytes(), f"{ENV_MAX_GB}={max_download_bytes() / 1e9:g}")
        staged = _transfer(url, source, target, progress, cap)
        try:
            problem = _broken(staged, check, expected, hash_it=True)
            if problem is not None:
                raise DownloadError(f"{url} (from {source}) is not a valid model file: {problem}")
            os.replace(staged, target)
        finally:
            shutil.rmtree(staged.parent, ignore_errors=True)
    finally:
        download_lock_path(target, OWNER_SUFFIX).unlink(missing_ok=True)
        lock.release()
    return target


def _identity(source: str) -> str:
    """The URL a mirror's file is cached under: the mirror's own (a folder as a file:// URL)."""
    if "://" in source:
        return source
    return Path(source).expanduser().resolve().as_uri()


def _broken(path: Path, check: Callable[[Path], object] | None, expected: Expected | None,
            hash_it: bool = False) -> str | None:
    """Why the file at `path` is not the file it should be, or None."""
    size = path.stat().st_size
    if expected is not None and expected.size is not None and size != expected.size:
        return f"{size:,} bytes where the published file has {expected.size:,} ({expected.source})"
    if hash_it and expected is not None and expected.sha256 is not None:
        digest = _sha256(path)
        if digest != expected.sha256:
            return f"SHA-256 {digest} where the published file's is {expected.sha256} ({expected.source})"
    if check is not None:
        try:
            check(path)
        except Exception as error:  # the check's own message names what is wrong
            return str(error)
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".probe.")
        probe.close()
    except OSError as error:  # a file in the way, a read-only folder
        raise DownloadError(f"cannot write the model cache at {folder} ({error.strerror or error}); set "
                            f"{ENV_CACHE} to a writable folder ({ENV_CACHE}={cache_dir()})") from None


def _acquire(target: Path, url: str):
    """Take the file's lock; while another process holds it, wait, saying for whom, until that
    process's download breaks the stall rule."""
    import filelock

    lock = file_lock(target)
    try:
        lock.acquire(timeout=0.2)
    except filelock.Timeout:
        owner = download_lock_path(target, OWNER_SUFFIX)
        holder = owner.read_text(errors="replace").strip() if owner.is_file() else "another process"
        log.warning("waiting for %s, which is downloading %s", holder, url)
        watch, seen = StallWatch(), _partial_bytes(target)
        while True:
            try:
                lock.acquire(timeout=min(0.5, watch.seconds / 4))
                break
            except filelock.Timeout:
                now_seen = _partial_bytes(target)
                watch.add(max(0, now_seen - seen))
                seen = now_seen
                if watch.stalled():
                    raise DownloadError(f"gave up waiting for {holder}, which is downloading {url}: its download "
                                        f"received {watch.rule()}; stop that process, or try again") from None
    download_lock_path(target, OWNER_SUFFIX).write_text(f"pid {os.getpid()} on {socket.gethostname()}\n")
    return lock


def _partial_bytes(target: Path) -> int:
    pattern = str(target.parent / glob.escape(f".{target.name}.")) + f"*{PARTIAL_SUFFIX}"
    return sum(path.stat().st_size for staging in glob.glob(pattern) for path in Path(staging).glob("*")
               if path.is_file())


def _not_transient() -> tuple[type[BaseException], ...]:
    import requests

    errors = requests.exceptions
    return (errors.TooManyRedirects, errors.InvalidSchema, errors.InvalidURL, errors.MissingSchema,
            errors.InvalidHeader, errors.SSLError)


class Cap(NamedTuple):
    """The most bytes a download may bring, and why (said when it brings more)."""

    size: int
    reason: str


def _transfer(url: str, source: str, target: Path, progress: bool, cap: Cap) -> Path:
    """Copy or download `source` to a new staging file beside `target` (same file system, so the
    final rename is atomic) and return its path; raises DownloadError naming the source."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=PARTIAL_SUFFIX, dir=target.parent))
    staged = staging / target.name
    try:
        if is_url(source):
            _download(url, source, staged, progress, cap)
        else:  # a mirror folder (or file:// URL)
            local = Path(unquote(urlsplit(source).path) if source.startswith("file://") else source)
            if not local.is_file():
                raise DownloadError(f"{local} not found in the mirror folder ({_settings()})")
            if local.stat().st_size > cap.size:
                raise DownloadError(f"{local} has {local.stat().st_size:,} bytes, more than the {cap.size:,} allowed "
                                    f"({cap.reason})")
            shutil.copyfile(local, staged)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staged


class _Retry(Exception):
    """A transfer that broke off (a reset connection, a short body, a 5xx): tried again."""


def _download(url: str, source: str, destination: Path, progress: bool, cap: Cap) -> None:
    """Download `source` to `destination` from the start, again after a broken transfer (at most
    RETRIES times), until the stall rule ends it."""
    log.info("downloading %s", source)
    origin = f" from {source}" if source != url else ""
    watch, tries = StallWatch(), 0
    while True:
        tries += 1
        try:
            _transfer_once(url, source, destination, progress, cap, watch)
            return
        except _Retry as error:
            reason = str(error)
        if watch.stalled():
            raise DownloadError(f"cannot download {url}{origin}: it received {watch.rule()} ({reason}; "
                                f"{tries} tries)") from None
        if tries > RETRIES:
            raise DownloadError(f"cannot download {url}{origin} ({reason}; after {time.monotonic() - watch.started:.0f} s, "
                                f"{tries} tries) and it is not in the cache; set {ENV_MIRROR} to a mirror (base URL "
                                f"or folder), or fill the cache with `elmo download` on a machine with a network "
                                f"({_settings()})") from None
        time.sleep(min(2.0 ** (tries - 1), watch.left()))


def _transfer_once(url: str, source: str, destination: Path, progress: bool, cap: Cap, watch: StallWatch) -> None:
    import requests
    import urllib3

    from elmokit.progress import progress_bar

    origin = f" from {source}" if source != url else ""
    timeout = (min(CONNECT_TIMEOUT, watch.seconds), watch.seconds)
    try:
        response = requests.get(source, stream=True, timeout=timeout, headers={"Accept-Encoding": "identity"})
    except _not_transient() as error:  # no retry mends these: said at once, with requests' own words (where to)
        raise DownloadError(f"cannot download {url}{origin}: {type(error).__name__}: {str(error)[:300]}") from None
    except requests.exceptions.RequestException as error:
        raise _Retry(_reason(error)) from None
    with response:
        if response.status_code >= 500:
            raise _Retry(f"HTTP {response.status_code} {response.reason}")
        if response.status_code != 200:
            raise DownloadError(f"cannot download {url}{origin}: HTTP {response.status_code} {response.reason}")
        length = response.headers.get("Content-Length", "")
        encoded = response.headers.get("Content-Encoding", "identity").lower() not in ("", "identity")
        if length.isdigit() and int(length) > cap.size and not encoded:
            raise DownloadError(f"cannot download {url}{origin}: it announces {int(length):,} bytes, more than the "
                                f"{cap.size:,} allowed ({cap.reason})")
        written = 0
        total = int(length) if length.isdigit() and not encoded else None
        with open(destination, "wb", buffering=0) as out, progress_bar(total=total, desc=destination.name, unit="B",
                                                          unit_scale=True, enabled=progress) as bar:
            while True:
                try:
                    chunk = response.raw.read1(CHUNK, decode_content=True)
                except (urllib3.exceptions.ReadTimeoutError, TimeoutError, socket.timeout):
                    raise DownloadError(f"cannot download {url}{origin}: it received {watch.rule()} "
                                        "(nothing arrived)") from None
                except (urllib3.exceptions.HTTPError, OSError) as error:
                    raise _Retry(_reason(error)) from None
                if not chunk:  # the end (urllib3 decodes until data comes or the body ends)
                    break
                written += len(chunk)
                if written > cap.size:
                    raise DownloadError(f"cannot download {url}{origin}: more than the {cap.size:,} bytes allowed "
                                        f"({cap.reason})")
                out.write(chunk)
                bar.update(len(chunk))
                watch.add(len(chunk))
                if watch.stalled():
                    raise DownloadError(f"cannot download {url}{origin}: it received {watch.rule()} "
                                        f"({written:,} bytes in {time.monotonic() - watch.started:.0f} s)")


def _reason(error: BaseException) -> str:
    import re

    cause = re.search(r"Caused by (\w+)", str(error))  # urllib3's reason, e.g. NameResolutionError
    return type(error).__name__ + (f" ({cause.group(1)})" if cause else "")
