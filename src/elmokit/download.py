"""Model files named by URL: downloaded once into a cache, read from there afterwards.

    fetch(url, check)   -> Path in the cache (downloaded, checked, then renamed into place)
    cache_entries()     -> what the cache holds          remove_entry(path)  -> delete one

The transfer itself is pooch's (`pooch.HTTPDownloader` over requests: a tqdm progress bar,
timeouts, a temporary file moved into place only when complete, `retry_if_failed`); around it
this module adds what pooch leaves to its caller:

* one download when several processes ask at once (a `filelock` lock per file);
* the file checked before it enters the cache (`check`: the options parse, the HDF5 file opens
  with the datasets its options imply), so the cache never holds a partial or broken file;
* a mirror and an offline mode.

Settings (environment variables):
    ELMOKIT_CACHE    the cache folder (default: the user's cache directory, `platformdirs`)
    ELMOKIT_MIRROR   a base URL or a local folder that replaces the scheme and host of a published
                     model's URL, path kept (for users who cannot reach the original host)
    ELMOKIT_OFFLINE  1: never download, read the cache only
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

ENV_CACHE, ENV_MIRROR, ENV_OFFLINE = "ELMOKIT_CACHE", "ELMOKIT_MIRROR", "ELMOKIT_OFFLINE"
TIMEOUT = (10, 60)  # seconds to connect, and between two reads: nothing hangs
RETRIES = 2  # a broken transfer is tried again this many times (pooch waits 1 s, then 2 s)
LOCK_SUFFIX = ".lock"

log = logging.getLogger(__name__)

PUBLISHED_HOSTS = ("allennlp.s3.amazonaws.com", "s3-us-west-2.amazonaws.com")
"""Hosts of the published models (`elmokit.model.published`): `ELMOKIT_MIRROR` replaces them."""
_LEGACY_PREFIX = "https://s3-us-west-2.amazonaws.com/allennlp/"  # the same bucket, path-style
_CANONICAL_PREFIX = "https://allennlp.s3.amazonaws.com/"


def is_url(reference: object) -> bool:
    """An http(s) URL (a str): downloaded into the cache, not read as a path."""
    return isinstance(reference, str) and reference.split("://", 1)[0].lower() in ("http", "https")


def canonical_url(url: str) -> str:
    """One spelling of a published file's URL (the path-style S3 URL becomes the virtual-host one;
    http becomes https), so that both spellings share a cache entry; other URLs unchanged."""
    if url.startswith("http://") and urlsplit(url).hostname in PUBLISHED_HOSTS:
        url = "https://" + url[len("http://"):]
    if url.startswith(_LEGACY_PREFIX):
        return _CANONICAL_PREFIX + url[len(_LEGACY_PREFIX):]
    return url


class DownloadError(OSError):
    """A model file could not be downloaded (and is not in the cache): one line naming the URL
    and the settings that help."""


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """The cache folder: `ELMOKIT_CACHE`, else elmokit's folder in the user's cache directory."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    import platformdirs

    return platformdirs.user_cache_path("elmokit") / "models"


def offline() -> bool:
    return os.environ.get(ENV_OFFLINE, "").strip().lower() not in ("", "0", "false", "no")


def mirrored(url: str) -> str:
    """Where to get `url` from: under `ELMOKIT_MIRROR` (a base URL or a local folder, path kept)
    when it is set and the URL is a published model's; else the URL itself."""
    mirror = os.environ.get(ENV_MIRROR, "").strip()
    parts = urlsplit(url)
    if not mirror or parts.hostname not in PUBLISHED_HOSTS:
        return url
    return mirror.rstrip("/") + parts.path


def _settings() -> str:
    return (f"{ENV_MIRROR}={os.environ.get(ENV_MIRROR, '') or '(unset)'}, "
            f"{ENV_CACHE}={cache_dir()}, {ENV_OFFLINE}={os.environ.get(ENV_OFFLINE, '') or '(unset)'}")


# ---------------------------------------------------------------------------------------------
# The cache: one file a URL, at <cache>/<host>/<path>
# ---------------------------------------------------------------------------------------------
def cache_path(url: str) -> Path:
    """Where the file of `url` lives in the cache (published URLs in their canonical spelling)."""
    parts = urlsplit(canonical_url(url))
    segments = [unquote(segment) for segment in parts.path.split("/") if segment]
    if not parts.hostname or not segments or any(s in (".", "..") or "/" in s or "\\" in s or "\0" in s
                                                 for s in segments):
        raise ValueError(f"not a URL of a file: {url!r}")
    if parts.query:  # the same path with another query is another file
        segments[-1] += "." + hashlib.sha256(parts.query.encode()).hexdigest()[:12]
    host = parts.hostname + (f"_{parts.port}" if parts.port else "")
    return cache_dir().joinpath(host, *segments)


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    url: str
    size: int


def cache_entries() -> list[CacheEntry]:
    """Every file in the cache (not the locks or unfinished downloads), sorted by URL."""
    root = cache_dir()
    if not root.is_dir():
        return []
    entries = []
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if (path.is_file() and not path.name.endswith(LOCK_SUFFIX)
                and not any(part.startswith(".") for part in relative.parts)):
            host, *rest = relative.parts
            host = host.replace("_", ":", 1)
            entries.append(CacheEntry(path, f"https://{host}/" + "/".join(rest), path.stat().st_size))
    return sorted(entries, key=lambda entry: entry.url)


def remove_entry(entry: CacheEntry) -> None:
    """Delete one cached file (under its lock, so no download of it is under way)."""
    import filelock

    with filelock.FileLock(str(entry.path) + LOCK_SUFFIX):
        entry.path.unlink(missing_ok=True)
    Path(str(entry.path) + LOCK_SUFFIX).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Fetching
# ---------------------------------------------------------------------------------------------
def fetch(url: str, check: Callable[[Path], None] | None = None, progress: bool | None = None) -> Path:
    """The local path of `url`'s file: from the cache, or downloaded into it.

    Args:
        url: an http(s) URL (a published one may be fetched from `ELMOKIT_MIRROR`).
        check: raises if a downloaded file is not what it should be (then it never enters the
            cache, and the error names the URL).
        progress: show a progress bar (default: when stderr is a terminal, unless `elmo -q`).

    Raises:
        DownloadError: offline or unreachable and not in the cache, or the file failed `check`.
    """
    import filelock

    target = cache_path(url)
    if target.is_file():
        return target
    if offline():
        raise DownloadError(f"{url} is not in the cache and {ENV_OFFLINE} is set ({_settings()}); "
                            "fill the cache with `elmo download` where there is a network")
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(target) + LOCK_SUFFIX)
    try:
        lock.acquire(timeout=1)
    except filelock.Timeout:
        log.warning("waiting for another process that is downloading %s", url)
        lock.acquire()
    try:
        if target.is_file():  # the other process finished it
            return target
        source = mirrored(canonical_url(url))
        if progress is None:  # elmokit.progress's policy: a bar on a terminal, none under `elmo -q`
            from elmokit.progress import quiet, stderr_is_terminal

            progress = stderr_is_terminal() and not quiet()
        staged = _transfer(url, source, target, progress)
        try:
            if check is not None:
                check(staged)
            os.replace(staged, target)
        except Exception as error:
            raise DownloadError(f"{url} (from {source}) is not a valid model file: {error}") from error
        finally:
            staged.unlink(missing_ok=True)
            shutil.rmtree(staged.parent, ignore_errors=True)
    finally:
        lock.release()
    return target


def _transfer(url: str, source: str, target: Path, progress: bool) -> Path:
    """Copy or download `source` to a new staging file beside `target` (same file system, so the
    final rename is atomic) and return its path; raises DownloadError naming the source."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    staged = staging / target.name
    try:
        if is_url(source):
            _download(url, source, staged, progress)
        else:  # a mirror folder (or file:// URL)
            local = Path(unquote(urlsplit(source).path) if source.startswith("file://") else source)
            if not local.is_file():
                raise DownloadError(f"{local} not found in the mirror folder ({_settings()})")
            shutil.copyfile(local, staged)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staged


def _download(url: str, source: str, destination: Path, progress: bool) -> None:
    import pooch
    import requests

    pooch.get_logger().setLevel(logging.WARNING)  # its "Downloading ..." line: our log says it
    log.info("downloading %s", source)
    fetcher = pooch.create(path=destination.parent, base_url="", registry={destination.name: None},
                           urls={destination.name: source}, retry_if_failed=RETRIES)
    started = time.monotonic()
    try:
        fetcher.fetch(destination.name, downloader=pooch.HTTPDownloader(progressbar=progress, timeout=TIMEOUT))
    except requests.exceptions.RequestException as error:
        cause = re.search(r"Caused by (\w+)", str(error))  # urllib3's reason, e.g. NameResolutionError
        reason = type(error).__name__ + (f" ({cause.group(1)})" if cause else "")
        origin = f" from {source}" if source != url else ""
        raise DownloadError(f"cannot download {url}{origin} ({reason}; after {time.monotonic() - started:.0f} s, "
                            f"{1 + RETRIES} tries) and it is not in the cache; set {ENV_MIRROR} to a "
                            f"mirror (base URL or folder), or fill the cache with `elmo download` on a "
                            f"machine with a network ({_settings()})") from None
