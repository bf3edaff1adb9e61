"""`elmo download` (fill the model cache ahead, for machines that go offline) and `elmo cache`
(list and remove what it holds). The cache and its settings: `elmokit.sources.download`."""

from __future__ import annotations

import argparse
import fnmatch

from urllib.parse import urlsplit

from elmokit.sources.cache import (ENV_CACHE, cache_dir, cache_entries, listed_url, partial_leftovers, remove_entry,
                                   remove_leftover)
from elmokit.sources.download import (ENV_MAX_GB, ENV_MIRROR, ENV_OFFLINE, ENV_STALL_BYTES, ENV_STALL_SECONDS,
                                      OPTIONS_MAX_BYTES, is_url)
from elmokit.model.config import read_options
from elmokit.sources.loading import load_model, resolve_file, weight_file_cap
from elmokit.sources.published import PUBLISHED, published_model
from elmokit.model.weights import check_weight_file

SETTINGS = (f"Settings: {ENV_CACHE} (the cache folder), {ENV_MIRROR} (a base URL or folder replacing the "
            f"published host), {ENV_OFFLINE}=1 (cache only), {ENV_MAX_GB} (the cap where no size is published), "
            f"{ENV_STALL_SECONDS} and {ENV_STALL_BYTES} (the stall rule: less than 1 MB in 60 s ends a download).")


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "download", help="download published models into the cache (for offline use)",
        description="Download models into the cache, checked before they enter it, so that later loads "
                    "(and machines without a network, with ELMOKIT_OFFLINE=1) read them from there. "
                    f"Published names: {', '.join(PUBLISHED)}; also TF-Hub ELMo handles, and URLs "
                    f"(an options JSON URL and its weight file URL as a pair). {SETTINGS}")
    parser.add_argument("models", nargs="+", metavar="NAME|URL",
                        help="a published name, a TF-Hub handle, or an options URL followed by its weights URL")
    parser.set_defaults(func=run_download)

    parser = subcommands.add_parser(
        "cache", help="list or remove cached model files",
        description=f"List the files in the model cache and the unfinished downloads a killed process left "
                    f"there, or remove some. {SETTINGS}")
    parser.add_argument("--remove", nargs="+", metavar="NAME|PATTERN",
                        help="remove the files (and unfinished downloads) of these published names, or whose URL "
                             "matches these shell patterns (e.g. '*5.5B*'; '*' removes all)")
    parser.set_defaults(func=run_cache)


def download_requests(references: list[str]) -> list[tuple[str, str | None]]:
    """(options, weights) pairs to fetch: a name or handle gives its pair; URLs come as pairs (an
    options URL, then its weights URL); a lone URL is fetched as it is (weights None)."""
    pairs: list[tuple[str, str | None]] = []
    queue = list(references)
    while queue:
        reference = queue.pop(0)
        published = published_model(reference)
        if published is not None:
            pairs.append((published.options_url, published.weight_url))
        elif is_url(reference):
            weights = _is_weights(reference)
            following = queue[0] if queue and is_url(queue[0]) and published_model(queue[0]) is None else None
            if not weights and following and (reference.split("?")[0].endswith(".json") or _is_weights(following)):
                pairs.append((reference, queue.pop(0)))  # options, then its weights
            elif weights:  # checked against its options before it is cached, or not downloaded
                raise ValueError(f"{reference}: a weight file is downloaded after its options URL, which it is checked "
                                 f"against: elmo download OPTIONS_URL {reference}")
            else:
                pairs.append((reference, None))
        else:
            raise ValueError(f"{reference!r} is neither a published name ({', '.join(PUBLISHED)}), a TF-Hub "
                             "ELMo handle nor an http(s) URL")
    return pairs


def _is_weights(url: str) -> bool:
    """An HDF5 weight file's URL (by its name)."""
    return urlsplit(url).path.endswith((".hdf5", ".h5"))


def run_download(args: argparse.Namespace) -> int:
    """Download each model, or check its cached files again and replace a broken one, then load it."""
    for options_url, weights_url in download_requests(args.models):
        if weights_url is None:
            is_options = urlsplit(options_url).path.endswith(".json")
            path = resolve_file(options_url, read_options if is_options else None,
                                max_bytes=OPTIONS_MAX_BYTES if is_options else None, repair=True)
            print(f"{options_url}\n  -> {path}")
            continue
        options_path = resolve_file(options_url, read_options, max_bytes=OPTIONS_MAX_BYTES, repair=True)
        config = read_options(options_path)
        resolve_file(weights_url, lambda path: check_weight_file(path, config, options_url),
                     max_bytes=weight_file_cap(config), repair=True)
        model = load_model(options_url, weights_url)  # both cached and sound now: loads once
        print(f"{options_url}\n{weights_url}\n  -> {resolve_file(weights_url).parent} "
              f"({model.n_parameters:,} parameters, loads)")
    return 0


def run_cache(args: argparse.Namespace) -> int:
    entries, leftovers = cache_entries(), partial_leftovers()
    if args.remove:
        patterns = []
        for reference in args.remove:
            published = published_model(reference)
            urls = [published.options_url, published.weight_url] if published else []
            # a published name: its files, and the copies a mirror served (cached under the mirror's URL)
            patterns += urls + ["*://*" + urlsplit(url).path for url in urls] if published else [reference]
            if not published and is_url(reference) and not any(char in reference for char in "*?["):
                patterns.append(listed_url(reference))  # the cache lists '@' as %40: the URL as written matches too
        matches = lambda entry: any(fnmatch.fnmatchcase(entry.url, pattern) for pattern in patterns)  # noqa: E731
        chosen = [entry for entry in entries if matches(entry)]
        for entry in chosen:
            remove_entry(entry)
            print(f"removed {entry.url} ({entry.size / 1e6:,.1f} MB)")
        unfinished = [leftover for leftover in leftovers if matches(leftover)]
        for leftover in unfinished:
            remove_leftover(leftover)
            print(f"removed an unfinished download of {leftover.url} ({leftover.size / 1e6:,.1f} MB, {leftover.path})")
        if not chosen and not unfinished:
            print(f"nothing in {cache_dir()} matches {' '.join(args.remove)}")
        return 0
    print(f"cache: {cache_dir()}")
    for entry in entries:
        print(f"{entry.size / 1e6:>10,.1f} MB  {entry.url}")
    print(f"{len(entries)} file(s), {sum(entry.size for entry in entries) / 1e6:,.1f} MB")
    if leftovers:
        print(f"unfinished downloads (left by a process that was stopped; `elmo cache --remove PATTERN` removes them):")
        for leftover in leftovers:
            print(f"{leftover.size / 1e6:>10,.1f} MB  {leftover.url}  ({leftover.path})")
    return 0
