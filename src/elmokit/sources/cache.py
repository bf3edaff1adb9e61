"""elmokit's download cache: where a URL's file lives, what the cache holds, and its locks.

    cache_path(url)        -> <cache>/<host[:port]>/<path>, every name percent-encoded
    cache_entries()        -> every cached file, with its URL      remove_entry(entry) -> delete one
    partial_leftovers()    -> unfinished downloads a killed process left behind
    file_lock(target)      -> the lock one download of `target` holds

The cache folder is `ELMOKIT_CACHE`, else elmokit's folder in the user's cache directory
(`platformdirs`). Hidden names (a leading '.') are the cache's own: locks, their owner files,
unfinished downloads (`.<name>.<random>.partial` folders). How files get there:
`elmokit.sources.download`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from elmokit.cachedir import ENV_CACHE, cache_dir  # noqa: F401 (the cache folder: its one definition)

LOCK_SUFFIX, OWNER_SUFFIX, PARTIAL_SUFFIX = ".lock", ".owner", ".partial"
PUBLISHED_HOSTS = ("allennlp.s3.amazonaws.com", "s3-us-west-2.amazonaws.com")
"""Hosts of the published models (`elmokit.sources.published`): `ELMOKIT_MIRROR` replaces them."""
_LEGACY_PREFIX = "https://s3-us-west-2.amazonaws.com/allennlp/"  # the same bucket, path-style
_CANONICAL_PREFIX = "https://allennlp.s3.amazonaws.com/"
MIRROR_SCHEMES = ("http", "https", "file")


def canonical_url(url: str) -> str:
    """One spelling of a published file's URL (the path-style S3 URL becomes the virtual-host one;
    http becomes https), so that both spellings share a cache entry; other URLs unchanged."""
    if url.startswith("http://") and urlsplit(url).hostname in PUBLISHED_HOSTS:
        url = "https://" + url[len("http://"):]
    if url.startswith(_LEGACY_PREFIX):
        return _CANONICAL_PREFIX + url[len(_LEGACY_PREFIX):]
    return url


def _name(text: str) -> str:
    """A file name for one URL component: percent-encoded (no '/', '\\', ':' or NUL survives), a
    leading '.' encoded too (hidden names are the cache's own: locks, owners, unfinished
    downloads), and a long name cut and made unique by a hash."""
    name = quote(text, safe="")
    return _cut("%2E" + name[1:] if name.startswith(".") else name)


def _cut(name: str) -> str:
    """A name short enough for any file system: cut, and made unique by a hash after a '!' (which
    `quote` always encodes, so no URL gives it)."""
    return name if len(name) <= 200 else name[:150] + "!" + hashlib.sha256(name.encode()).hexdigest()[:16]


def cache_path(url: str) -> Path:
    """Where the file of `url` lives in the cache (published URLs in their canonical spelling):
    `<cache>/<host[:port]>/<path>` for https, `<scheme>+<host[:port]>/<path>` for http and
    `file+/<path>` for file:// URLs; a query makes another file (`name#query`). Whatever the URL,
    the path is inside the cache, or ValueError."""
    parts = urlsplit(canonical_url(url))
    scheme = parts.scheme.lower()
    try:
        host, port = parts.hostname or "", parts.port
    except ValueError:  # a port that is not a number, or out of range
        raise ValueError(f"not a URL of a file: {url!r} (its port)") from None
    segments = [unquote(segment) for segment in parts.path.split("/") if segment]
    if scheme not in MIRROR_SCHEMES or (not host and scheme != "file") or host in (".", "..") or not segments:
        raise ValueError(f"not a URL of a file: {url!r}")
    if any(segment in (".", "..") for segment in segments):
        raise ValueError(f"not a URL of a file: {url!r} (a '.' or '..' in its path)")
    names = [_name(segment) for segment in segments]
    if parts.query:  # the same path with another query is another file
        names[-1] = _cut(names[-1] + "#" + quote(parts.query, safe=""))  # `quote` encodes '#': no clash
    folder = _name(host + (f":{port}" if port else ""))
    if scheme != "https":
        folder = f"{scheme}+{folder}"  # '+' is encoded in a host's name: no clash
    return cache_dir().joinpath(folder, *names)


def listed_url(url: str) -> str:
    """`url` as `cache_entries` lists its file (each path segment percent-encoded: '@' as %40)."""
    return url_of(cache_path(url).relative_to(cache_dir()))


def url_of(relative: Path) -> str:
    """The URL a cache path stands for (the inverse of `cache_path`, up to a cut long name)."""
    folder, *names = relative.parts
    scheme, _, host = folder.rpartition("+") if "+" in folder else ("https", "", folder)
    *folders, last = names
    last, _, query = last.partition("#")
    path = "/".join(quote(unquote(name), safe="") for name in (*folders, last))
    return f"{scheme}://{unquote(host)}/{path}" + (f"?{unquote(query)}" if query else "")


@dataclass(frozen=True)
class CacheEntry:
    path: Path
    url: str
    size: int


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def cache_entries() -> list[CacheEntry]:
    """Every file in the cache (not the locks or unfinished downloads), sorted by URL."""
    root = cache_dir()
    if not root.is_dir():
        return []
    entries = [CacheEntry(path, url_of(path.relative_to(root)), path.stat().st_size)
               for path in root.rglob("*") if path.is_file() and not _hidden(path.relative_to(root))]
    return sorted(entries, key=lambda entry: entry.url)


def download_lock_path(target: Path, suffix: str = LOCK_SUFFIX) -> Path:
    return target.parent / f".{target.name}{suffix}"


def file_lock(target: Path):
    import filelock

    return filelock.FileLock(str(download_lock_path(target)))


def remove_entry(entry: CacheEntry) -> None:
    """Delete one cached file (under its lock, so no download of it is under way)."""
    with file_lock(entry.path):
        entry.path.unlink(missing_ok=True)
    download_lock_path(entry.path).unlink(missing_ok=True)


def partial_leftovers() -> list[CacheEntry]:
    """Unfinished downloads that no process is writing (a killed download's staging folders):
    each as the staging folder, the URL it was for and the bytes it holds."""
    import filelock

    root = cache_dir()
    if not root.is_dir():
        return []
    leftovers = []
    for staging in root.rglob(f".*{PARTIAL_SUFFIX}"):
        if not staging.is_dir():
            continue
        target = staging.parent / staging.name[1:].rsplit(".", 2)[0]  # .<name>.<random>.partial
        lock = file_lock(target)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:  # a download is under way: not a leftover
            continue
        lock.release()
        size = sum(path.stat().st_size for path in staging.rglob("*") if path.is_file())
        leftovers.append(CacheEntry(staging, url_of(target.relative_to(root)), size))
    return sorted(leftovers, key=lambda entry: entry.url)


def remove_leftover(leftover: CacheEntry) -> None:
    shutil.rmtree(leftover.path, ignore_errors=True)
