"""The client of `elmo serve` behind the LangChain and LlamaIndex classes
(`elmokit.integrations.texts.SentenceVectors`) against servers on 127.0.0.1 that misbehave: a key
never follows a redirect to another origin, no redirect leaves http(s), an answer must hold one
finite vector of one width per text sent, answers are read to a bounded size, and `timeout` bounds
the whole request however slowly the server sends it."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("sacremoses", reason="the texts are Moses-tokenized (the langchain extra)")

import torch  # noqa: E402

from elmokit import BiLM, save_pretrained, tokenize  # noqa: E402
from elmokit.integrations.texts import MAX_WIDTH, SentenceVectors, answer_max_bytes, check_base_url  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402
from tests.hostile_http import WIDTH, HostileServer, Request, embeddings_answer, encoded, token_vector  # noqa: E402

KEY = "the-servers-key"
TEXTS = ["Cats eat fish.", "Dogs bark at night, don't they?"]


def client(url: str, **settings) -> SentenceVectors:
    settings.setdefault("timeout", 30.0)
    return SentenceVectors(base_url=check_base_url(url), api_key=KEY, **settings)


def expected(texts: list[str]) -> np.ndarray:
    """What `embeddings_answer` gives for `texts`, computed here from elmokit.tokenize."""
    return np.stack([token_vector(tokenize(text)) for text in texts])


def test_an_honest_server_and_a_base_url_ending_in_v1():
    """OpenAI clients' base_url ends in /v1: the request still goes to /v1/embeddings."""
    with HostileServer(embeddings_answer) as server:
        vectors = client(server.url + "/v1/", batch_size=1)(TEXTS + [""])
    np.testing.assert_array_equal(vectors, np.concatenate([expected(TEXTS), np.zeros((1, WIDTH))]))
    assert [(r.method, r.path, r.headers["authorization"]) for r in server.requests] == [
        ("POST", "/v1/embeddings", f"Bearer {KEY}")] * 2


@pytest.mark.parametrize("status", [302, 307])
def test_a_redirect_to_another_origin_is_followed_without_the_key(status):
    """A redirect within the origin keeps the key; one to another origin drops it (and it stays
    dropped). 307 repeats the POST of the texts; 302 is followed as a GET (here of /info)."""
    with HostileServer(embeddings_answer) as other:
        def moving(request: Request) -> None:
            if request.path.startswith("/moved"):
                request.send(status, {}, {"Location": other.url + request.path.removeprefix("/moved")})
            else:
                request.send(status, {}, {"Location": "/moved" + request.path})

        with HostileServer(moving) as first:
            texts = TEXTS if status == 307 else ["  "]  # no token: the client asks GET /info for the width
            vectors = client(first.url)(texts)
    assert [r.headers.get("authorization") for r in first.requests] == [f"Bearer {KEY}"] * 2
    assert [(r.path, r.headers.get("authorization")) for r in other.requests] == [
        ("/v1/embeddings" if status == 307 else "/info", None)]
    np.testing.assert_array_equal(vectors, expected(TEXTS) if status == 307 else np.zeros((1, WIDTH)))


@pytest.mark.parametrize("target", ["ftp://127.0.0.1:1/info", "file:///etc/passwd"])
def test_a_redirect_out_of_http_is_refused(target):
    with HostileServer(lambda request: request.send(302, {}, {"Location": target})) as server:
        with pytest.raises(RuntimeError, match=rf"redirected to '{target}': only redirects to http\(s\) addresses"):
            client(server.url)(["  "])


def answering(items) -> callable:
    """A server answering /v1/embeddings with `items(tokens of each text sent)` as its data."""
    return lambda request: request.send(200, {"data": items([tokens for tokens in request.json()["input"]])})


def vector_of(tokens: list[str], index: int) -> dict:
    return {"index": index, "embedding": encoded(token_vector(tokens))}


@pytest.mark.parametrize("items, message", [
    (lambda sent: [vector_of(sent[0], 0)], r"answered 1 vectors for 2 texts"),
    (lambda sent: [vector_of(sent[0], 0)] * 3, r"answered 3 vectors for 2 texts"),
    (lambda sent: [vector_of(sent[0], 0), vector_of(sent[1], 0)], r"the indices \[0, 0\]: expected each of 0 to 1"),
    (lambda sent: [vector_of(sent[0], 0), vector_of(sent[1], 2)], r"the indices \[0, 2\]: expected each of 0 to 1"),
    (lambda sent: [vector_of(sent[0], 0), vector_of(sent[1], "1")], r"the indices \[0, '1'\]"),
    (lambda sent: [vector_of(sent[0], 0), {"index": 1, "embedding": encoded([1.0, float("nan"), 0.0, 0.0])}],
     r"vector for texts\[1\] holds NaN or infinity"),
    (lambda sent: [vector_of(sent[0], 0), {"index": 1, "embedding": encoded([1.0, 2.0, 3.0])}],
     r"vectors of widths \[3, 4\]: expected one width"),
    (lambda sent: [vector_of(sent[0], 0), {"index": 1, "embedding": encoded(np.zeros(MAX_WIDTH + 1))}],
     rf"vector for texts\[1\]'s width is {MAX_WIDTH + 1}: expected a vector width from 1 to"),
    (lambda sent: [vector_of(sent[0], 0), {"index": 1, "embedding": "AAAA#"}], r"vector for texts\[1\] is not base64"),
])
def test_an_answer_must_hold_one_finite_vector_of_one_width_per_text(items, message):
    with HostileServer(answering(items)) as server:
        with pytest.raises(RuntimeError, match=message):
            client(server.url)(TEXTS)


def test_every_request_of_a_call_must_give_the_same_width():
    widths = iter([4, 3])
    with HostileServer(answering(lambda sent: [{"index": 0, "embedding": encoded(np.ones(next(widths)))}])) as server:
        with pytest.raises(RuntimeError, match=r"widths \[3, 4\] to the requests of one call"):
            client(server.url, batch_size=1)(TEXTS)


@pytest.mark.parametrize("dim", [2_000_000_000, 0, -1, "12", 12.0])
def test_the_width_from_info_is_bounded(dim):
    """A text without tokens is zeros of the server's width: a width of 2e9 would be an 8 GB row."""
    with HostileServer(lambda request: request.send(200, {"shape": {"dim": dim}})) as server:
        with pytest.raises(RuntimeError, match=rf"/info's shape.dim is {dim!r}: expected a vector width from 1 to "
                                               rf"{MAX_WIDTH:,}"):
            client(server.url)(["", "  "])


def test_no_text_is_an_empty_array_of_the_width_in_process_and_served(tmp_path):
    """(0, 2P), as `ElmoEmbedder.sentence_vectors([])` gives, not (0, 0)."""
    torch.manual_seed(0)
    save_pretrained(BiLM(tiny_config()).eval(), tmp_path / "model")
    here = SentenceVectors(model=str(tmp_path / "model"))([])
    assert here.shape == (0, 2 * tiny_config().lstm.projection_dim) and here.dtype == np.float32
    with HostileServer(embeddings_answer) as server:
        served = client(server.url)([])
    assert served.shape == (0, WIDTH) and served.dtype == np.float32
    assert [r.path for r in server.requests] == ["/info"]


def endless(request: Request) -> None:
    """A right answer, then blanks (valid JSON still) until the client hangs up, or 64 MiB."""
    request.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
    request.write(json.dumps({"data": [vector_of(tokens, i) for i, tokens in enumerate(request.json()["input"])]})
                  .encode())
    for _ in range(1024):
        request.write(b" " * 65536)


def announced(request: Request) -> None:
    """Headers announcing a terabyte, and nothing more."""
    request.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n")


@pytest.mark.parametrize("answer, message", [
    (endless, rf"sent an answer longer than the {answer_max_bytes(2):,} bytes expected at most"),
    (announced, rf"announced an answer of 1,000,000,000,000 bytes: more than the {answer_max_bytes(2):,}"),
])
def test_an_answer_is_read_to_a_bounded_size(answer, message):
    assert answer_max_bytes(2) < 64 << 20  # the endless answer passes the bound long before it stops
    with HostileServer(answer) as server:
        with pytest.raises(RuntimeError, match=message):
            client(server.url)(TEXTS)


def test_timeout_bounds_the_whole_request_not_each_read():
    """The answer comes a byte every 0.2 s: each read waits far less than `timeout`, the whole
    answer far more (about 30 s)."""
    import time

    def dripping(request: Request) -> None:
        body = json.dumps({"data": [vector_of(tokens, i) for i, tokens in enumerate(request.json()["input"])]})
        whole = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        for byte in whole.encode():
            request.write(bytes([byte]))
            time.sleep(0.2)

    with HostileServer(dripping) as server:
        with pytest.raises(TimeoutError, match=r"gave no whole answer to /v1/embeddings within timeout=1.0 s"):
            client(server.url, timeout=1.0)(TEXTS[:1])
