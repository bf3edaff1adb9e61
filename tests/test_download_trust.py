"""The download cache tried as a hostile user or server would (issue 38, point 1): cache paths that
stay inside the cache whatever the URL, mirrors that cannot stand in for a published file, a cap on
every download (gzip included), the stall rule (the transfer, its retries and a process waiting on
the lock), and the errors of a broken or misplaced cache. Servers run on 127.0.0.1 only."""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock
from urllib.parse import urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elmokit.cli import main
from elmokit.sources.download import DownloadError, fetch
from elmokit.sources.cache import cache_dir, cache_entries, cache_path, partial_leftovers
from elmokit.sources.loading import load_model
from elmokit.sources.published import PUBLISHED, PUBLISHED_FILES, expected_file
from tests.conftest import FIXTURE, REPO, one_error_line
from tests.http_mirror import MirrorServer, pin
from tests.test_loading import mirror_path, publish, same_weights
from tests.test_task_portable import ner_files  # noqa: F401  (a fixture)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ELMOKIT_CACHE", str(tmp_path / "cache"))
    for name in ("ELMOKIT_MIRROR", "ELMOKIT_OFFLINE", "ELMOKIT_MAX_DOWNLOAD_GB", "ELMOKIT_STALL_SECONDS",
                 "ELMOKIT_STALL_BYTES"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache"


# ---------------------------------------------------------------------------------------------
# Cache paths
# ---------------------------------------------------------------------------------------------
def test_a_host_of_dot_dot_is_refused_and_nothing_is_made_outside(cache, tmp_path):
    before = sorted(path.name for path in tmp_path.iterdir())
    for url in ("http://../x.json", "http://./x.json", "https://../../etc/passwd"):
        with pytest.raises(ValueError, match="not a URL of a file"):
            cache_path(url)
        with pytest.raises(ValueError, match="not a URL of a file"):
            fetch(url)
    assert sorted(path.name for path in tmp_path.iterdir()) == before  # no folder, no lock made beside it


HOSTILE = ["..", ".", "%2e%2e", "%2E", "%2F", "%2f..", "\\", "..\\..", "%00", "%5C", "a", ".lock", ".x.partial",
           "~", "%", "#", "?", ":", "con", "a" * 300]


@st.composite
def hostile_urls(draw) -> str:
    scheme = draw(st.sampled_from(["http", "https", "HTTPS", "file", "ftp"]))
    host = draw(st.sampled_from(HOSTILE[:12] + ["127.0.0.1", "example.org", "[::1]", "", "a.b..c"])
                | st.text(min_size=0, max_size=8))
    port = draw(st.sampled_from(["", ":80", ":0", ":99999", ":x", ":"]))
    segments = draw(st.lists(st.sampled_from(HOSTILE) | st.text(max_size=6), max_size=4))
    query = draw(st.sampled_from(["", "?v=1", "?..", "?/../../x", "?%2e%2e/"]) | st.text(max_size=6).map(lambda q: "?" + q))
    return f"{scheme}://{host}{port}/" + "/".join(segments) + query


@settings(max_examples=400, deadline=None)
@given(url=hostile_urls())
def test_every_cache_path_is_inside_the_cache(url):
    root = Path("/tmp/elmokit-cache-property")
    try:
        with mock.patch.dict(os.environ, {"ELMOKIT_CACHE": str(root)}):
            path = cache_path(url)
    except ValueError:
        return
    relative = path.relative_to(root)  # raises if the path is elsewhere
    assert os.path.normpath(path) == str(path)  # no '..' left to resolve
    assert all(part not in ("", ".", "..") and not part.startswith(".") and "/" not in part and "\\" not in part
               and "\0" not in part and len(part.encode()) <= 255 for part in relative.parts), relative
    assert len(relative.parts) >= 2  # a host folder and a file: never the cache folder itself


@settings(max_examples=200, deadline=None)
@given(path=st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=3), a=st.text(max_size=5),
       b=st.text(max_size=5))
def test_the_query_is_part_of_the_cache_key(path, a, b):
    from urllib.parse import quote

    base = "https://example.org/" + "/".join(quote(segment, safe="") for segment in path)
    if any(segment in (".", "..") for segment in path):
        return
    with mock.patch.dict(os.environ, {"ELMOKIT_CACHE": "/tmp/elmokit-cache-property"}):
        first, second = cache_path(f"{base}?{quote(a)}"), cache_path(f"{base}?{quote(b)}")
        assert (first == second) == (a == b)
        assert cache_path(base) != cache_path(base + "?v=1") and cache_path(base + "#x") == cache_path(base)


def test_two_queries_download_two_files(cache, tmp_path):
    routes = {"/notes.txt?v=1": (200, {}, b"first"), "/notes.txt?v=2": (200, {}, b"second")}
    with MirrorServer(tmp_path, routes=routes) as server:
        one, two = fetch(f"{server.url}/notes.txt?v=1"), fetch(f"{server.url}/notes.txt?v=2")
        assert (one.read_bytes(), two.read_bytes()) == (b"first", b"second")
        assert fetch(f"{server.url}/notes.txt?v=1").read_bytes() == b"first"  # from the cache
        assert len(server.requests) == 2
    assert sorted(entry.url for entry in cache_entries()) == [f"{server.url}/notes.txt?v=1",
                                                              f"{server.url}/notes.txt?v=2"]


# ---------------------------------------------------------------------------------------------
# Mirrors and the published files
# ---------------------------------------------------------------------------------------------
def test_a_mirror_without_a_pinned_hash_never_stands_in_for_the_published_file(cache, tmp_path, monkeypatch):
    model = publish(tmp_path / "mirror", "small")
    assert expected_file(PUBLISHED["small"].weight_url) is None  # nothing published about small
    with MirrorServer(tmp_path / "mirror") as server:  # plain http
        monkeypatch.setenv("ELMOKIT_MIRROR", server.url)
        assert same_weights(model, load_model("small"))
    urls = sorted(entry.url for entry in cache_entries())
    assert urls == sorted(server.url + urlsplit(url).path for url in (PUBLISHED["small"].options_url,
                                                                        PUBLISHED["small"].weight_url))
    assert not cache_path(PUBLISHED["small"].weight_url).exists()
    monkeypatch.delenv("ELMOKIT_MIRROR")
    monkeypatch.setenv("ELMOKIT_OFFLINE", "1")  # without the mirror, `small` is not in the cache
    with pytest.raises(DownloadError, match="not in the cache"):
        load_model("small")


def test_a_mirror_file_whose_hash_differs_is_refused(cache, tmp_path, monkeypatch):
    publish(tmp_path / "mirror", "small")
    pin(monkeypatch, tmp_path / "mirror", "small")
    publish(tmp_path / "mirror", "small", seed=1)  # the mirror now serves other weights of the same size
    with MirrorServer(tmp_path / "mirror") as server:
        monkeypatch.setenv("ELMOKIT_MIRROR", server.url)
        with pytest.raises(DownloadError, match="SHA-256 .* where the published file's is"):
            load_model("small")
    assert [entry.url for entry in cache_entries()] == [PUBLISHED["small"].options_url]  # the same options: they match


def test_the_pinned_sizes_refuse_a_stand_in_for_original(cache, tmp_path, monkeypatch):
    assert PUBLISHED_FILES[PUBLISHED["original"].weight_url].size == 374_434_792
    assert PUBLISHED_FILES[PUBLISHED["original"].options_url].size == 336
    publish(tmp_path / "mirror", "original")  # a tiny model under original's names
    monkeypatch.setenv("ELMOKIT_MIRROR", str(tmp_path / "mirror"))
    with pytest.raises(DownloadError, match="336 allowed|published file has 336"):
        load_model("original")
    assert cache_entries() == []


# ---------------------------------------------------------------------------------------------
# Caps
# ---------------------------------------------------------------------------------------------
def test_a_gzip_bomb_stops_at_the_cap(cache, tmp_path, monkeypatch):
    bomb = gzip.compress(bytes(50_000_000), compresslevel=9)  # 49 KB that decode to 50 MB
    routes = {"/x.hdf5": (200, {"Content-Encoding": "gzip"}, bomb)}
    monkeypatch.setenv("ELMOKIT_MAX_DOWNLOAD_GB", "0.001")
    with MirrorServer(tmp_path, routes=routes) as server:
        with pytest.raises(DownloadError, match="more than the 1,000,000 bytes allowed.*ELMOKIT_MAX_DOWNLOAD_GB"):
            fetch(f"{server.url}/x.hdf5")
    assert cache_entries() == [] and partial_leftovers() == []
    assert not [path for path in cache.rglob("*") if path.is_file() and path.stat().st_size > 1_000_000]


def test_an_options_file_is_capped_and_a_long_announcement_refused_unread(cache, tmp_path, monkeypatch):
    routes = {"/big_options.json": (200, {}, b"{" + b" " * 2_000_000 + b"}"),
              "/w.hdf5": (200, {"Content-Length": str(10**13)}, b"")}
    with MirrorServer(tmp_path, routes=routes) as server:
        with pytest.raises(DownloadError, match="big_options.json: it announces 2,000,002 bytes, more than the "
                                                 r"1,000,000 allowed \(an options file's limit"):
            load_model(f"{server.url}/big_options.json", f"{server.url}/w.hdf5")
        with pytest.raises(DownloadError, match="announces 10,000,000,000,000 bytes"):
            fetch(f"{server.url}/w.hdf5")


# ---------------------------------------------------------------------------------------------
# The stall rule: the transfer, and a process waiting on the lock
# ---------------------------------------------------------------------------------------------
def test_a_dribbling_server_ends_the_command_by_the_stall_rule(cache, tmp_path, monkeypatch, capsys):
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "x.json").write_text("{}" * 100)
    monkeypatch.setenv("ELMOKIT_STALL_SECONDS", "1")
    with MirrorServer(tmp_path / "files", dribble=0.3) as server:  # a byte every 0.3 s, forever
        started = time.monotonic()
        assert main(["-q", "download", f"{server.url}/x.json"]) == 2
        elapsed = time.monotonic() - started
    assert elapsed < 3
    one_error_line(capsys, "cannot download", "less than 1,000,000 bytes in 1 s", "ELMOKIT_STALL_SECONDS")
    assert len(server.requests) <= 1  # no retry after a stall


DOWNLOADER = """
import sys
from elmokit.sources.download import fetch
fetch(sys.argv[1], progress=False)
"""


def test_a_waiting_process_names_the_downloader_gives_up_and_the_leftover_is_removed(cache, tmp_path, monkeypatch,
                                                                                     capsys):
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "x.bin").write_bytes(bytes(10_000))
    with MirrorServer(tmp_path / "files", dribble=0.05) as server:
        url = f"{server.url}/x.bin"
        env = {**os.environ, "ELMOKIT_STALL_SECONDS": "600", "ELMOKIT_STALL_BYTES": "1",
               "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        downloader = subprocess.Popen([sys.executable, "-c", DOWNLOADER, url], env=env)
        try:
            deadline = time.monotonic() + 60
            while not list(cache.rglob("*.partial")) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert list(cache.rglob("*.partial")), "the downloader never started"
            monkeypatch.setenv("ELMOKIT_STALL_SECONDS", "1")  # 20 bytes/s is less than 1 MB in 1 s
            started = time.monotonic()
            with pytest.raises(DownloadError, match=f"gave up waiting for pid {downloader.pid} on .*less than"):
                fetch(url)
            assert time.monotonic() - started < 4
            assert partial_leftovers() == []  # a download under way is not a leftover
        finally:
            downloader.send_signal(signal.SIGKILL)
            downloader.wait(timeout=30)
    leftovers = partial_leftovers()
    assert [leftover.url for leftover in leftovers] == [url] and leftovers[0].size > 0
    capsys.readouterr()
    assert main(["cache"]) == 0
    assert "unfinished downloads" in capsys.readouterr().out
    assert main(["cache", "--remove", "*x.bin"]) == 0
    assert "removed an unfinished download" in capsys.readouterr().out
    assert partial_leftovers() == [] and not list(cache.rglob("*.partial"))


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
def test_a_broken_cache_entry_names_itself_and_elmo_download_replaces_it(cache, tmp_path, monkeypatch, capsys):
    model = publish(tmp_path / "mirror", "small")
    pin(monkeypatch, tmp_path / "mirror", "small")
    monkeypatch.setenv("ELMOKIT_MIRROR", str(tmp_path / "mirror"))
    load_model("small")
    weights = cache_path(PUBLISHED["small"].weight_url)
    weights.write_bytes(weights.read_bytes()[:1000])  # a disk error, an interrupted copy
    assert main(["info", "small"]) == 2
    one_error_line(capsys, str(weights), "cached download of " + PUBLISHED["small"].weight_url, "elmo cache --remove",
                   "elmo download")
    assert main(["download", "small"]) == 0
    assert same_weights(model, load_model("small"))


def test_http_errors_name_the_status_code(cache, tmp_path, capsys):
    routes = {"/gone.json": (404, {}, b"not here"), "/secret.json": (403, {}, b"")}
    with MirrorServer(tmp_path, routes=routes) as server:
        for path, status in (("/gone.json", "HTTP 404 Not Found"), ("/secret.json", "HTTP 403 Forbidden")):
            assert main(["-q", "download", server.url + path]) == 2
            one_error_line(capsys, status, server.url + path)
        assert len(server.requests) == 2  # a 4xx is not retried
    routes = {"/busy.json": (503, {}, b"")}
    with MirrorServer(tmp_path, routes=routes) as server:
        assert main(["-q", "download", server.url + "/busy.json"]) == 2
        one_error_line(capsys, "HTTP 503 Service Unavailable", "3 tries")
        assert len(server.requests) == 3  # a 5xx is retried twice


def test_a_cache_that_is_a_file_names_elmokit_cache(tmp_path, monkeypatch, capsys):
    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("ELMOKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ELMOKIT_MIRROR", str(tmp_path))
    assert main(["info", "small"]) == 2
    one_error_line(capsys, "ELMOKIT_CACHE", str(tmp_path / "cache"))


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_cache_names_elmokit_cache(cache, tmp_path, monkeypatch, capsys):
    cache.mkdir()
    cache.chmod(0o500)
    monkeypatch.setenv("ELMOKIT_MIRROR", str(tmp_path))
    try:
        assert main(["info", "small"]) == 2
        one_error_line(capsys, "ELMOKIT_CACHE", "writable")
    finally:
        cache.chmod(0o700)


def test_a_folder_in_the_entrys_place_is_refused_before_the_transfer(cache, tmp_path):
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "x.json").write_text("{}")
    with MirrorServer(tmp_path / "files") as server:
        cache_path(f"{server.url}/x.json").mkdir(parents=True)
        with pytest.raises(DownloadError, match="is a folder where the cached download of"):
            fetch(f"{server.url}/x.json")
        assert server.requests == []


@pytest.mark.parametrize("mirror", ["ftp://mirror.example.org/elmo", "sftp://host/x", "gopher://host"])
def test_a_mirror_of_another_scheme_is_refused_by_name(cache, monkeypatch, capsys, mirror):
    monkeypatch.setenv("ELMOKIT_MIRROR", mirror)
    assert main(["download", "small"]) == 2
    one_error_line(capsys, f"ELMOKIT_MIRROR={mirror}", repr(mirror.split("://")[0]), "not supported")
    assert not cache_dir().exists()


# ---------------------------------------------------------------------------------------------
# A task run's edited bilm record: what can be checked is checked before a download
# ---------------------------------------------------------------------------------------------
ORIGINAL_OPTIONS = {"lstm": {"use_skip_connections": True, "projection_dim": 512, "cell_clip": 3, "proj_clip": 3,
                             "dim": 4096, "n_layers": 2},
                    "char_cnn": {"activation": "relu", "n_highway": 2, "embedding": {"dim": 16}, "n_characters": 262,
                                 "max_characters_per_token": 50,
                                 "filters": [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256], [6, 512], [7, 1024]]}}


def test_an_edited_bilm_record_is_refused_before_the_weights_are_downloaded(cache, tmp_path, monkeypatch, tiny_model,
                                                                            ner_files):
    import json

    import elmokit.tasks
    from elmokit import save_pretrained
    from elmokit.sources import published
    from elmokit.tasks.bilm_ref import BiLMMismatchError
    from tests.test_task_portable import train

    save_pretrained(tiny_model, tmp_path / "bilm")
    train(tmp_path / "run", ner_files, model=str(tmp_path / "bilm"))
    config_path = tmp_path / "run" / "task_config.json"
    saved = json.loads(config_path.read_text())
    options = mirror_path(tmp_path / "mirror", PUBLISHED["original"].options_url)
    options.parent.mkdir(parents=True)
    options.write_text(json.dumps(ORIGINAL_OPTIONS))  # original's shape; its weights are nowhere
    monkeypatch.setattr(published, "PUBLISHED_FILES", {})  # this stand-in's options are not 336 bytes
    with MirrorServer(tmp_path / "mirror") as server:
        monkeypatch.setenv("ELMOKIT_MIRROR", server.url)
        # a fingerprint that no model has: refused before anything is fetched
        config_path.write_text(json.dumps(saved | {"bilm": {"name": "original", "fingerprint": "not-hex"}}))
        with pytest.raises(BiLMMismatchError, match="fingerprint must be 16 hex digits"):
            elmokit.tasks.load(tmp_path / "run")
        assert server.requests == []
        # the record names original (1024-dim vectors) for a task model that reads the tiny model's
        config_path.write_text(json.dumps(saved | {"bilm": {"name": "original",
                                                            "fingerprint": saved["bilm"]["fingerprint"]}}))
        with pytest.raises(BiLMMismatchError, match="'original' its record names cannot be.*weights were not downloaded"):
            elmokit.tasks.load(tmp_path / "run")
        assert [path for path, _, _ in server.requests] == [urlsplit(PUBLISHED["original"].options_url).path]


def test_a_weight_file_is_capped_by_the_size_its_options_imply(cache, tmp_path, monkeypatch):
    """`small` has no published size: its weights are capped at 4 bytes a parameter its options imply
    (+1 MB), so a mirror's gzip bomb stops there, far below ELMOKIT_MAX_DOWNLOAD_GB."""
    from elmokit.model.config import read_options
    from elmokit.sources.loading import weight_file_cap

    publish(tmp_path / "mirror", "small")
    options = mirror_path(tmp_path / "mirror", PUBLISHED["small"].options_url)
    cap = weight_file_cap(read_options(options))
    bomb = gzip.compress(bytes(cap + 1_000_000), compresslevel=9)
    routes = {urlsplit(PUBLISHED["small"].weight_url).path: (200, {"Content-Encoding": "gzip"}, bomb)}
    with MirrorServer(tmp_path / "mirror", routes=routes) as server:
        monkeypatch.setenv("ELMOKIT_MIRROR", server.url)
        with pytest.raises(DownloadError, match=f"more than the {cap:,} bytes allowed"):
            load_model("small")
    # the real `original`: its options imply 374,403,456 bytes of values, its file has 374,434,792
    options = tmp_path / "original_options.json"
    options.write_text(__import__("json").dumps(ORIGINAL_OPTIONS))
    assert 374_434_792 <= weight_file_cap(read_options(options)) < 374_434_792 + 1_000_000


@pytest.mark.parametrize("name, value", [("ELMOKIT_STALL_SECONDS", "0"), ("ELMOKIT_STALL_BYTES", "-1"),
                                         ("ELMOKIT_MAX_DOWNLOAD_GB", "lots"), ("ELMOKIT_STALL_SECONDS", "inf")])
def test_a_bad_setting_is_named(cache, tmp_path, monkeypatch, capsys, name, value):
    (tmp_path / "x.txt").write_text("{}")
    monkeypatch.setenv(name, value)
    with MirrorServer(tmp_path) as server:
        assert main(["-q", "download", f"{server.url}/x.txt"]) == 2
    one_error_line(capsys, f"{name}={value!r}", "a positive number")


# The second audit (2026-11-27)
def test_a_redirect_loop_is_said_at_once_not_retried_as_a_network_failure(cache, tmp_path, capsys):
    routes = {"/loop.json": (302, {"Location": "/loop.json"}, b"")}
    with MirrorServer(tmp_path, routes=routes) as server:
        assert main(["-q", "download", server.url + "/loop.json"]) == 2
        message = one_error_line(capsys, "TooManyRedirects", server.url + "/loop.json")
        assert "tries" not in message and "network" not in message
        assert len(server.requests) == 31  # one try: requests' 30 redirects, not three tries of them


def test_a_weight_file_alone_is_refused_not_cached_unchecked(cache, tmp_path, capsys):
    with MirrorServer(tmp_path) as server:
        assert main(["-q", "download", server.url + "/weights.hdf5"]) == 2
        one_error_line(capsys, "a weight file is downloaded after its options URL", "elmo download OPTIONS_URL")
        assert server.requests == [] and not cache_entries()


def test_the_cap_names_what_set_it(cache, tmp_path, monkeypatch):
    """A weight file past the size its options imply is refused naming the options as the reason,
    not ELMOKIT_MAX_DOWNLOAD_GB (which a user would raise in vain), even with that setting unreadable."""
    fixture = FIXTURE  # the copy in tests/fixtures: every clone runs this
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "options.json").write_bytes((fixture / "options.json").read_bytes())
    (tmp_path / "m" / "weights.hdf5").write_bytes((fixture / "lm_weights.hdf5").read_bytes() + bytes(2_000_000))
    monkeypatch.setenv("ELMOKIT_MAX_DOWNLOAD_GB", "abc")
    with MirrorServer(tmp_path) as server:
        with pytest.raises(DownloadError, match=r"allowed \(the most a weight file of its options' shapes can need"):
            load_model(server.url + "/m/options.json", server.url + "/m/weights.hdf5")


def test_cache_remove_takes_a_url_as_written(cache, tmp_path, capsys):
    """'@' in a URL is listed %40 in the cache; `elmo cache --remove` takes the URL as written."""
    fixture = FIXTURE  # the copy in tests/fixtures: every clone runs this
    (tmp_path / "v@1").mkdir()
    (tmp_path / "v@1" / "options.json").write_bytes((fixture / "options.json").read_bytes())
    with MirrorServer(tmp_path) as server:
        url = server.url + "/v@1/options.json"
        assert main(["-q", "download", url]) == 0 and len(cache_entries()) == 1
    capsys.readouterr()
    assert main(["cache", "--remove", url]) == 0
    assert "removed" in capsys.readouterr().out and not cache_entries()


def test_download_pairs_an_options_url_of_any_name_with_its_weights():
    from elmokit.commands.download import download_requests

    assert download_requests(["http://x/opts", "http://x/w.hdf5"]) == [("http://x/opts", "http://x/w.hdf5")]
    assert download_requests(["http://x/o.json", "http://x/w.bin"]) == [("http://x/o.json", "http://x/w.bin")]
    assert download_requests(["http://x/vocab.txt"]) == [("http://x/vocab.txt", None)]
    with pytest.raises(ValueError, match="a weight file is downloaded after its options URL"):
        download_requests(["http://x/w.hdf5", "http://x/o.json"])
