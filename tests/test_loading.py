"""Published models by name, URL and TF-Hub handle: the download into the cache (through a real
HTTP server on 127.0.0.1 set as ELMOKIT_MIRROR), its lock, its check, the mirror folder, offline
mode and the errors; `elmo download` and `elmo cache`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

from elmokit import BiLM, ElmoEmbedder, load_model, save_original
from elmokit.cli import main
from elmokit.sources.download import DownloadError, fetch
from elmokit.sources.cache import cache_entries, cache_path
from elmokit.sources.cache import canonical_url
from elmokit.sources.published import PUBLISHED, published_model
from tests.conftest import REPO, one_error_line, tiny_config
from tests.http_mirror import MirrorServer, pin


def mirror_path(root: Path, url: str) -> Path:
    return root / urlsplit(url).path.lstrip("/")


def publish(root: Path, name: str, seed: int = 0) -> BiLM:
    """A tiny model written where the mirror serves the published `name`'s two files."""
    torch.manual_seed(seed)
    model = BiLM(tiny_config()).eval()
    published = PUBLISHED[name]
    options = mirror_path(root, published.options_url)
    options.parent.mkdir(parents=True, exist_ok=True)
    save_original(model, options, mirror_path(root, published.weight_url))
    return model


def same_weights(a: BiLM, b: BiLM) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ELMOKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ELMOKIT_MIRROR", raising=False)
    monkeypatch.delenv("ELMOKIT_OFFLINE", raising=False)
    return tmp_path / "cache"


# ---------------------------------------------------------------------------------------------
# Names, handles, spellings
# ---------------------------------------------------------------------------------------------
def test_names_and_handles_resolve_to_the_published_files():
    assert PUBLISHED["original"].weight_url == ("https://allennlp.s3.amazonaws.com/models/elmo/2x4096_512_2048cnn_"
                                                "2xhighway/elmo_2x4096_512_2048cnn_2xhighway_weights.hdf5")
    assert PUBLISHED["small"].options_url.endswith("2x1024_128_2048cnn_1xhighway/elmo_2x1024_128_2048cnn_1xhighway_options.json")
    for handle in ("https://tfhub.dev/google/elmo/1", "https://tfhub.dev/google/elmo/2", "https://tfhub.dev/google/elmo/3/",
                   "http://tfhub.dev/google/elmo/3"):
        assert published_model(handle) is PUBLISHED["original"], handle
    assert published_model("Original-5.5b") is PUBLISHED["original-5.5B"] is published_model("large")
    assert published_model("https://tfhub.dev/google/elmo/4") is None and published_model("gutenberg-en") is None
    legacy = "https://s3-us-west-2.amazonaws.com/allennlp/models/elmo/x/y_weights.hdf5"
    assert canonical_url(legacy) == "https://allennlp.s3.amazonaws.com/models/elmo/x/y_weights.hdf5"
    assert cache_path(legacy) == cache_path("http://allennlp.s3.amazonaws.com/models/elmo/x/y_weights.hdf5")


def test_a_url_that_escapes_the_cache_is_refused(cache):
    for url in ("https://host.org/../../etc/passwd", "https://host.org/", "https://host.org/a/%2e%2e/b"):
        with pytest.raises(ValueError, match="not a URL of a file"):
            cache_path(url)


# ---------------------------------------------------------------------------------------------
# Downloads through the mirror
# ---------------------------------------------------------------------------------------------
def test_a_broken_download_is_retried_and_only_the_whole_file_enters_the_cache(cache, tmp_path, monkeypatch):
    model = publish(tmp_path / "mirror", "small")
    pin(monkeypatch, tmp_path / "mirror", "small")  # the mirror's files are the published ones
    with MirrorServer(tmp_path / "mirror", break_first=(".hdf5",)) as server:
        monkeypatch.setenv("ELMOKIT_MIRROR", server.url)
        loaded = load_model("small")
        weights = [entry for entry in server.requests if entry[0].endswith(".hdf5")]
    size = mirror_path(tmp_path / "mirror", PUBLISHED["small"].weight_url).stat().st_size
    assert [sent for _, _, sent in weights] == [size // 2, size]  # broken off halfway, then whole
    assert same_weights(model, loaded)
    files = sorted(entry.url for entry in cache_entries())
    assert files == sorted([PUBLISHED["small"].options_url, PUBLISHED["small"].weight_url])
    leftovers = [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")
                 and p not in {cache_path(url) for url in files}]
    assert leftovers == []
    # the server is gone: the cache serves the same model, also under the legacy spelling
    again = load_model(PUBLISHED["small"].options_url.replace("https://allennlp.s3.amazonaws.com/",
                                                              "https://s3-us-west-2.amazonaws.com/allennlp/"),
                       PUBLISHED["small"].weight_url)
    assert same_weights(model, again)


def test_a_file_that_fails_its_check_never_enters_the_cache(cache, tmp_path, monkeypatch):
    publish(tmp_path / "mirror", "medium")
    weights = mirror_path(tmp_path / "mirror", PUBLISHED["medium"].weight_url)
    weights.write_bytes(b"<html>an error page, not HDF5</html>")
    pin(monkeypatch, tmp_path / "mirror", "medium")
    with MirrorServer(tmp_path / "mirror") as server:
        monkeypatch.setenv("ELMOKIT_MIRROR", server.url)
        with pytest.raises(DownloadError, match="not a valid model file.*not a readable HDF5"):
            load_model("medium")
    assert not cache_path(PUBLISHED["medium"].weight_url).exists()
    assert cache_path(PUBLISHED["medium"].options_url).is_file()  # the options were fine


def test_a_mirror_folder_replaces_the_host(cache, tmp_path, monkeypatch):
    model = publish(tmp_path / "mirror", "pubmed")
    pin(monkeypatch, tmp_path / "mirror", "pubmed")
    monkeypatch.setenv("ELMOKIT_MIRROR", str(tmp_path / "mirror"))
    assert same_weights(model, load_model("pubmed"))


def test_processes_asking_at_once_download_once(cache, tmp_path, monkeypatch):
    publish(tmp_path / "mirror", "small")
    with MirrorServer(tmp_path / "mirror", delay=1.0) as server:
        monkeypatch.setenv("ELMOKIT_MIRROR", server.url)
        code = "import sys; from elmokit import load_model; load_model('small'); print('ok')"
        processes = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
                     for _ in range(3)]
        outputs = [process.communicate(timeout=120)[0] for process in processes]
        paths = [path for path, status, _ in server.requests if status == 200]
    assert outputs == ["ok\n"] * 3
    assert sorted(paths) == sorted(urlsplit(url).path for url in (PUBLISHED["small"].options_url,
                                                                   PUBLISHED["small"].weight_url))


# ---------------------------------------------------------------------------------------------
# Offline and unreachable: one line naming the URL and the settings
# ---------------------------------------------------------------------------------------------
def test_offline_reads_the_cache_only(cache, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ELMOKIT_OFFLINE", "1")
    assert main(["info", "original"]) == 2
    one_error_line(capsys, PUBLISHED["original"].options_url, "ELMOKIT_OFFLINE", "ELMOKIT_MIRROR", "ELMOKIT_CACHE")


def test_an_unreachable_host_fails_within_a_minute_naming_the_url(cache, tmp_path, monkeypatch, capsys):
    with MirrorServer(tmp_path) as server:
        url = server.url
    monkeypatch.setenv("ELMOKIT_MIRROR", url)  # a port nobody listens on any more
    started = time.monotonic()
    # -q: the error alone (without it, "downloading URL" comes first, as a message)
    assert main(["-q", "embed", "--model", "small", str(tmp_path / "in.txt"), str(tmp_path / "out.hdf5")]) == 2
    assert time.monotonic() - started < 60
    one_error_line(capsys, "cannot download", PUBLISHED["small"].options_url, "ELMOKIT_MIRROR", "elmo download")
    assert cache_entries() == []


# ---------------------------------------------------------------------------------------------
# elmo download, elmo cache
# ---------------------------------------------------------------------------------------------
def test_download_then_offline_then_cache_remove(cache, tmp_path, monkeypatch, capsys):
    model = publish(tmp_path / "mirror", "small")
    pin(monkeypatch, tmp_path / "mirror", "small")
    with MirrorServer(tmp_path / "mirror") as server:
        monkeypatch.setenv("ELMOKIT_MIRROR", server.url)
        assert main(["download", "small"]) == 0
    assert "loads" in capsys.readouterr().out
    monkeypatch.setenv("ELMOKIT_OFFLINE", "1")
    embedder = ElmoEmbedder("small")
    reference = ElmoEmbedder(module=model)
    assert (embedder.embed_sentence(["a", "b"]) == reference.embed_sentence(["a", "b"])).all()
    assert main(["cache"]) == 0
    listing = capsys.readouterr().out
    assert PUBLISHED["small"].weight_url in listing and "2 file(s)" in listing
    assert main(["cache", "--remove", "small"]) == 0
    assert cache_entries() == []
    with pytest.raises(DownloadError, match="not in the cache"):
        load_model("small")


def test_download_refuses_what_is_not_a_model(cache, capsys):
    assert main(["download", "not-a-model"]) == 2
    one_error_line(capsys, "not-a-model", "published name")


def test_fetch_of_a_plain_url_without_check(cache, tmp_path, monkeypatch):
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "notes.txt").write_text("hello")
    with MirrorServer(tmp_path / "files") as server:
        path = fetch(f"{server.url}/notes.txt")
    assert path.read_text() == "hello" and path.is_relative_to(cache)
    assert (REPO / "src").is_dir()  # the repo layout the fixtures assume


def test_a_server_that_stalls_times_out(cache, tmp_path, monkeypatch):
    """A transfer that stops sending breaks the stall rule (nothing in ELMOKIT_STALL_SECONDS): one
    error, no retry, never hung on."""
    publish(tmp_path / "mirror", "small")
    monkeypatch.setenv("ELMOKIT_STALL_SECONDS", "1")
    with MirrorServer(tmp_path / "mirror", delay=4.0) as server:  # headers at once, the body 4 s later
        monkeypatch.setenv("ELMOKIT_MIRROR", server.url)
        started = time.monotonic()
        with pytest.raises(DownloadError, match="cannot download .*received less than 1,000,000 bytes in 1 s"):
            load_model("small")
        assert time.monotonic() - started < 3.5
    assert cache_entries() == []


def test_paths_under_home_given_with_a_tilde_load_as_a_shell_reads_them(tiny_model, model_dir, tmp_path,
                                                                         monkeypatch):
    """`~/...` for a native folder, and for an options file with its weight file: the files under
    $HOME, as for a TF-Hub module; a saved pipeline keeps the absolute path."""
    from elmokit.sources.loading import saved_reference

    save_original(tiny_model, tmp_path / "options.json", tmp_path / "weights.hdf5")
    monkeypatch.setenv("HOME", str(tmp_path))
    expected = tiny_model.state_dict()
    for loaded in (load_model(f"~/{model_dir.name}"), load_model("~/options.json", "~/weights.hdf5")):
        assert all(torch.equal(loaded.state_dict()[name], tensor) for name, tensor in expected.items())
    assert saved_reference(f"~/{model_dir.name}") == str(model_dir.resolve())
