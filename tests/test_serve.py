"""`elmo serve` as a real process on 127.0.0.1: the numbers against `ElmoEmbedder`, every class of
bad input (a 4xx and a JSON error, never a 5xx), the API key, /info and /metrics, dynamic batching,
a full queue, and SIGTERM with requests in flight."""

from __future__ import annotations

import base64
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elmokit import ElmoEmbedder
from elmokit.inference.files import make_tokenizer
from elmokit.model.int8 import int8_native
from elmokit.sources.loading import load_model
from elmokit.serve.recurrence import Recurrence, token_layer
from tests.serving import START_LIMIT, Server, save_tiny_model

KEY = "test-key-7f3a"
TEXTS = ["I like to eat apple.", "I like apple products, don't you?", "They play football on Sundays."]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def embedder(model):
    return ElmoEmbedder(module=load_model(str(model)))


@pytest.fixture(scope="module")
def server(model):
    """The API key on, small limits to reach them cheaply."""
    served = Server(model, "--max-body-bytes", "20000", "--max-inputs", "8", "--max-input-tokens", "40",
                    api_key=KEY)
    yield served
    assert served.stop() == 0


@pytest.fixture(scope="module")
def slow_server(model):
    """Waits 1.5 s for more requests to batch with the first, and queues 50 tokens at most: what
    arrives together lands in one batch, and requests stay in flight long enough to catch."""
    served = Server(model, "--max-wait-ms", "1500", "--max-batch-tokens", "10000", "--max-queue-tokens", "50",
                    "--max-input-tokens", "40")
    yield served
    served.stop()


def tokens_of(text: str) -> list[str]:
    return make_tokenizer(True)(text)


# ---------------------------------------------------------------------------------------------
# The numbers
# ---------------------------------------------------------------------------------------------
def test_openai_route_gives_the_embedders_numbers(server, embedder):
    status, answer, _ = server.call("POST", "/v1/embeddings", {"input": TEXTS, "model": server.model_name})
    assert status == 200 and answer["object"] == "list" and answer["model"]
    n_tokens = sum(len(tokens_of(text)) for text in TEXTS)
    assert answer["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    for i, (text, item) in enumerate(zip(TEXTS, answer["data"], strict=True)):  # one vector per text
        expected = embedder.embed_sentence(tokens_of(text)).mean(axis=0).mean(axis=0)  # (2P,)
        assert item["object"] == "embedding" and item["index"] == i
        np.testing.assert_allclose(item["embedding"], expected, atol=1e-6, rtol=1e-5)
    status, single, _ = server.call("POST", "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})
    vector = np.frombuffer(base64.b64decode(single["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vector, answer["data"][0]["embedding"], atol=1e-6)


def test_tei_embed_is_unit_length_unless_asked(server, embedder):
    status, vectors, _ = server.call("POST", "/embed", {"inputs": TEXTS[:2]})
    assert status == 200 and len(vectors) == 2
    raw = embedder.embed_sentence(tokens_of(TEXTS[1])).mean(axis=0).mean(axis=0)
    np.testing.assert_allclose(vectors[1], raw / np.linalg.norm(raw), atol=1e-5)
    _, plain, _ = server.call("POST", "/embed", {"inputs": TEXTS[1], "normalize": False})
    np.testing.assert_allclose(plain[0], raw, atol=1e-6)


def test_embed_all_layers_one_layer_and_a_mix(server, embedder):
    sentence = ["The", "cat", "sat", "."]
    expected = embedder.embed_sentence(sentence)  # (L+1, n, 2P)
    status, answer, _ = server.call("POST", "/embed_all", {"inputs": [sentence, TEXTS[0]]})
    assert status == 200 and answer["data"][0]["tokens"] == sentence
    assert answer["data"][1]["tokens"] == tokens_of(TEXTS[0])
    assert answer["data"][0]["shape"] == list(expected.shape)
    np.testing.assert_allclose(answer["data"][0]["embedding"], expected, atol=1e-6)
    _, one, _ = server.call("POST", "/embed_all", {"inputs": [sentence], "layers": 2, "encoding": "base64"})
    decoded = np.frombuffer(base64.b64decode(one["data"][0]["embedding"]), "<f4").reshape(one["data"][0]["shape"])
    np.testing.assert_allclose(decoded, expected[2], atol=1e-6)
    weights = [0.5, 0.25, 2.0]
    _, mix, _ = server.call("POST", "/embed_all", {"inputs": [sentence], "layers": {"weights": weights}})
    np.testing.assert_allclose(mix["data"][0]["embedding"], np.tensordot(weights, expected, axes=1), atol=1e-5)


def test_requests_batched_together_get_their_own_vectors(slow_server, embedder):
    """Five requests in one batch (the queue waits 1.5 s): each gets what it gets alone."""
    sentences = [["a"], ["the", "big", "dog", "ran", "home", "."], ["play"], ["I", "play", "chess"], ["x"] * 9]
    before_batches = slow_server.metric("elmo_batch_sentences_count")
    threads, answers = ask_each_at_once(slow_server, sentences)
    for thread in threads:
        thread.join()
    assert slow_server.metric("elmo_batch_sentences_count") == before_batches + 1  # one batch for all five
    assert_each_as_alone(sentences, answers, embedder)


@pytest.mark.parametrize("numpy_views", [True, False], ids=["cpu-numpy-views", "torch-as-on-a-gpu"])
def test_sentences_joining_the_recurrence_at_any_step_get_their_own_vectors(embedder, numpy_views):
    """The server's recurrence (continuous batching): sentences start at random steps in whichever
    row is free, rows are reused, the ring of steps wraps; each sentence gets what `embed_many`
    gives it alone (the tiny model's clips bind, so the clipped path runs too). Without the numpy
    views of the rings, admission and reading back go through torch, as on a GPU."""
    rng = random.Random(0)
    words = ["a", "the", "play", "chess", "They", "run", ".", "home", "dog"]
    sentences = [[rng.choice(words) for _ in range(rng.randint(1, 9))] for _ in range(60)]
    expected = embedder.embed_many(sentences)
    recurrence = Recurrence(embedder.bilm, rows=5, max_positions=11)  # 9 tokens + 2 boundaries
    if not numpy_views:
        recurrence._host_inputs = recurrence._host_outputs = None
    pending, got, sentence_in = list(range(len(sentences))), {}, {}
    while pending or recurrence.busy:
        admit_some(recurrence, embedder, sentences, pending, sentence_in, rng.randint(0, 3))
        ended = recurrence.step()
        vectors = rng.random() < 0.5  # read back as sentence vectors (/v1/embeddings) or layers (/embed_all)
        for row, result in zip(ended, recurrence.take(ended, sentence_vectors=vectors) if ended else []):
            got[sentence_in.pop(row)] = result
    assert recurrence.step_number > 2 * recurrence.horizon  # the ring wrapped
    assert_each_read_back_as_alone(sentences, got, expected)
    assert {result.ndim for result in got.values()} == {1, 3}
    with pytest.raises(ValueError, match="12 positions does not fit the recurrence's 11"):
        recurrence.admit(token_layer(embedder, [["a"] * 10]), [12])


@pytest.mark.parametrize("numpy_views", [True, False], ids=["cpu-numpy-views", "torch-as-on-a-gpu"])
def test_compacting_the_recurrence_moves_sentences_down_without_changing_their_vectors(embedder, numpy_views):
    """`Recurrence.compact` (the model's process calls it before every step): the sentences in the
    highest rows move into the idle rows below them, mid-sentence and across the ring's wrap, so a
    step computes only as many rows as are busy; each sentence still gets what `embed_many` gives it
    alone. Sentences end at random (long and short ones mixed), leaving holes that no admission fills."""
    rng = random.Random(1)
    words = ["a", "the", "play", "chess", "They", "run", ".", "home", "dog"]
    sentences = [[rng.choice(words) for _ in range(rng.choice([1, 2, 9]))] for _ in range(60)]
    expected = embedder.embed_many(sentences)
    recurrence = Recurrence(embedder.bilm, rows=6, max_positions=11)
    if not numpy_views:
        recurrence._host_inputs = recurrence._host_outputs = None
    pending, got, sentence_in, moved = list(range(len(sentences))), {}, {}, 0
    while pending or recurrence.busy:
        admit_some(recurrence, embedder, sentences, pending, sentence_in, rng.randint(0, 2))
        moves = recurrence.compact()
        sentence_in = {moves.get(row, row): i for row, i in sentence_in.items()}
        moved += len(moves)
        assert recurrence.span == len(recurrence.busy) == len(sentence_in)  # no idle row is computed
        ended = recurrence.step()
        for row, result in zip(ended, recurrence.take(ended, sentence_vectors=rng.random() < 0.5) if ended else []):
            got[sentence_in.pop(row)] = result
    assert moved > 10 and recurrence.step_number > 2 * recurrence.horizon  # moves happened, the ring wrapped
    assert_each_read_back_as_alone(sentences, got, expected)


def admit_some(recurrence: Recurrence, embedder, sentences: list[list[str]], pending: list[int],
               sentence_in: dict[int, int], count: int) -> None:
    """Start up to `count` of the `pending` sentences (as many as rows are free); `sentence_in`
    maps each one's row to its index."""
    starting = [pending.pop(0) for _ in range(min(count, len(pending), len(recurrence.free)))]
    if starting:
        chosen = [sentences[i] for i in starting]
        rows = recurrence.admit(token_layer(embedder, chosen), [len(s) + 2 for s in chosen])
        sentence_in.update(zip(rows, starting))


def assert_each_read_back_as_alone(sentences: list[list[str]], got: dict, expected: list[np.ndarray]) -> None:
    """Each sentence's layers (L+1, n, 2P), or its vector (2P,): the mean over layers and tokens of
    what `embed_many` gave it alone."""
    for i, sentence in enumerate(sentences):
        wanted = expected[i] if got[i].ndim == 3 else expected[i].mean(axis=0).mean(axis=0)
        np.testing.assert_allclose(got[i], wanted, atol=1e-6, err_msg=" ".join(sentence))


def ask_each_at_once(served: Server, sentences: list[list[str]]) -> tuple[list[threading.Thread], list]:
    """One `/embed_all` request per sentence, each in a started thread; `answers[i]` is filled
    with sentence i's (status, JSON, headers) once its thread is joined."""
    answers = [None] * len(sentences)

    def ask(i):
        answers[i] = served.call("POST", "/embed_all", {"inputs": [sentences[i]]})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(sentences))]
    for thread in threads:
        thread.start()
    return threads, answers


def assert_each_as_alone(sentences: list[list[str]], answers: list, embedder) -> None:
    """Every answer is a 200 with what the embedder gives its sentence alone."""
    for sentence, (status, answer, _) in zip(sentences, answers, strict=True):
        assert status == 200
        np.testing.assert_allclose(answer["data"][0]["embedding"], embedder.embed_sentence(sentence), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Bad input: a 4xx and a JSON error that says what was wrong
# ---------------------------------------------------------------------------------------------
TOO_LONG = " ".join(["word"] * 41)
HUGE = b"1" + b"0" * 400  # a valid JSON integer (401 digits) past float's range
BAD = [  # (route, body: an object is sent as JSON, bytes as they are; status; part of the message)
    ("/v1/embeddings", b"{\"input\": ", 400, "not valid JSON"),
    ("/v1/embeddings", b"\xff\xfe{}", 400, "not valid JSON"),
    ("/v1/embeddings", b"", 400, "body is empty"),
    ("/v1/embeddings", b"[\"a\"]", 400, "must be a JSON object, got a JSON array"),
    ("/v1/embeddings", b"{\"input\": NaN}", 400, "NaN is not JSON"),
    ("/v1/embeddings", b"[" * 5000 + b"]" * 5000, 400, "nested too deeply"),
    ("/embed_all", b'{"inputs": ["a \\ud800 b"]}', 400, "lone surrogate"),
    ("/v1/embeddings", {"inputs": "hi"}, 422, "missing field 'input'"),
    ("/v1/embeddings", {"input": 5}, 422, "'input' must be a string, a list of strings"),
    ("/v1/embeddings", {"input": None}, 422, "got a JSON null"),
    ("/v1/embeddings", {"input": [1]}, 422, "input[0] must be a string"),
    ("/v1/embeddings", {"input": []}, 422, "empty list"),
    ("/v1/embeddings", {"input": ""}, 422, "'input' is empty"),
    ("/v1/embeddings", {"input": ["ok", "   "]}, 422, "input[1] is empty"),
    ("/v1/embeddings", {"input": ["a"] * 9}, 422, "9 inputs, more than the limit of 8 (--max-inputs)"),
    ("/v1/embeddings", {"input": TOO_LONG}, 422, "41 tokens, more than the limit of 40 (--max-input-tokens)"),
    ("/v1/embeddings", {"input": "x" * 3000}, 422, "3000 characters, more than the limit of 2560 characters"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "hex"}, 422, "'encoding_format' must be one of"),
    ("/v1/embeddings", {"input": "hi", "model": 3}, 422, "'model' must be a string"),
    ("/v1/embeddings", {"input": "x " * 12_000}, 413, "more than the limit of 20000 (--max-body-bytes)"),
    ("/embed", {"inputs": "hi", "normalize": "yes"}, 422, "'normalize' must be true or false"),
    ("/embed", {"inputs": [["a", "b"]]}, 200, None),
    ("/embed_all", {"inputs": [["a", 1]]}, 422, "inputs[0][1] must be a token string"),
    ("/embed_all", {"inputs": [["a b"]]}, 422, "must be one token"),
    ("/embed_all", {"inputs": [[""]]}, 422, "must be one token"),
    ("/embed_all", {"inputs": [[]]}, 422, "inputs[0] is empty"),
    ("/embed_all", {"inputs": "hi", "layers": 3}, 422, "layers 0 to 2"),
    ("/embed_all", {"inputs": "hi", "layers": True}, 422, "'layers' must be"),
    ("/embed_all", {"inputs": "hi", "layers": {"weights": [1, 2]}}, 422, "a list of 3 numbers"),
    ("/embed_all", {"inputs": "hi", "layers": {"weights": [1, 2, "3"]}}, 422, "a list of 3 numbers"),
    ("/embed_all", b'{"inputs": "hi", "layers": {"weights": [1, 2, 1e400]}}', 422, "finite"),  # 1e400: inf
    ("/embed_all", b'{"inputs": [["a"]], "layers": {"weights": [%s, 0, 0]}}' % HUGE, 422, "finite"),  # no float
    ("/embed_all", b'{"inputs": [["a"]], "layers": -%s}' % HUGE, 422, "does not exist"),
    ("/v1/embeddings", b'{"input": "hi", "dimensions": %s}' % HUGE, 400, "'dimensions'"),
    ("/v1/embeddings", {"input": "hi", "dimensions": True}, 400, "'dimensions'"),
    ("/embed", b'{"inputs": "hi", "normalize": %s}' % HUGE, 422, "'normalize' must be true or false"),
    ("/embed_all", b'{"inputs": "hi", "encoding": %s}' % HUGE, 422, "'encoding' must be one of"),
    ("/embed_all", {"inputs": "hi", "encoding": 1}, 422, "'encoding' must be one of"),
    ("/explore", {"query": "They play chess", "word": "run", "sentences": ["a"]}, 422, "not a token of the query"),
    ("/explore", {"query": "They play chess", "word": "play", "sentences": ["a b"]}, 422, "does not occur"),
    ("/explore", {"query": ["They"], "word": "They", "sentences": ["a"]}, 422, "'query' must be one string"),
    ("/explore", {"query": "They play", "word": 1, "sentences": ["a"]}, 422, "'word' must be"),
    ("/explore", {"query": "They play", "word": "play", "sentences": ["play"] * 8}, 422,
     "'sentences' has 8 inputs and 1 other in the request, more than the limit of 8 (--max-inputs)"),
]


@pytest.mark.parametrize("route, body, status, message", BAD)
def test_bad_input_gets_a_4xx_that_says_why(server, route, body, status, message):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, answer, _ = server.call("POST", route, raw=raw)
    assert got == status, answer
    if message is not None:
        assert answer["error"]["code"] == str(status) and message in answer["error"]["message"], answer


def test_explore_checks_the_word_before_computing_anything(server):
    """A word missing from the query or the sentences is refused before the model runs: no token
    is counted as embedded; query + sentences at --max-inputs together are answered."""
    tokens = server.metric("elmo_tokens_total")
    for word in ("zebra", "chess"):  # in neither; in the query only
        body = {"query": "I play chess", "word": word, "sentences": ["they play football"] * 7}
        assert server.call("POST", "/explore", body)[0] == 422
    assert server.metric("elmo_tokens_total") == tokens
    status, answer, _ = server.call("POST", "/explore", {"query": "I play chess", "word": "play",
                                                         "sentences": ["they play football"] * 7})
    assert status == 200 and answer["n_occurrences"] == 7, answer
    assert server.metric("elmo_tokens_total") == tokens + 3 + 7 * 3


def test_a_compressed_body_gets_415_naming_the_encoding(server):
    import gzip

    status, answer, _ = server.call("POST", "/embed", raw=gzip.compress(b'{"inputs": "hi"}'),
                                    headers={"Content-Encoding": "gzip"})
    assert status == 415 and "Content-Encoding: gzip" in answer["error"]["message"], answer
    assert server.call("POST", "/embed", {"inputs": "hi"}, headers={"Content-Encoding": "identity"})[0] == 200


def test_a_client_that_hangs_up_mid_body_is_counted_as_abandoned(server):
    """Status 499 and `elmo_abandoned_total`, as a client that hangs up after its body (docs/serve.md)."""
    abandoned = server.metric("elmo_abandoned_total")
    hung_up = server.metric('elmo_requests_total{route="/embed",status="499"}')
    with socket.create_connection((server.host, server.port), timeout=10) as connection:
        connection.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"inputs\": ")
        time.sleep(0.3)  # the handler is reading the body
    deadline = time.monotonic() + 30
    while server.metric("elmo_abandoned_total") == abandoned and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric("elmo_abandoned_total") == abandoned + 1
    assert server.metric('elmo_requests_total{route="/embed",status="499"}') == hung_up + 1


def test_a_large_body_is_tokenized_off_the_event_loop():
    """Past OFF_LOOP_BYTES the texts are tokenized in a worker thread: here the tokenizer waits
    until a coroutine has run on the event loop, which it could not while the loop itself was
    tokenizing (it would wait in vain, and say so). A small body is tokenized on the loop."""
    import asyncio

    from elmokit.serve.inputs import OFF_LOOP_BYTES, Limits, read_inputs_async

    loop_ran, threads = threading.Event(), []

    def tokenize(text):
        threads.append(threading.current_thread())
        if not loop_ran.wait(timeout=10):
            raise AssertionError("the event loop did not run while the text was tokenized")
        return text.split()

    async def read(body_bytes):
        reading = asyncio.ensure_future(read_inputs_async({"input": ["a b", "c"]}, "input", Limits(), tokenize,
                                                          body_bytes))
        await asyncio.sleep(0.05)  # the loop runs on while the worker tokenizes
        loop_ran.set()
        return await reading

    assert asyncio.run(read(OFF_LOOP_BYTES + 1)) == [["a", "b"], ["c"]]
    assert threading.main_thread() not in threads
    threads.clear()
    assert asyncio.run(read(OFF_LOOP_BYTES)) == [["a", "b"], ["c"]]  # loop_ran is set: no wait
    assert threads == [threading.main_thread()] * 2


def test_sigterm_while_the_model_loads_exits_0():
    """SIGTERM as soon as the port accepts (the built-in model still loading, or its process
    starting): the server stops, exit 0, with its message, not an interrupt's 130."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, ELMOKIT_OFFLINE="1")
    env.pop("ELMOKIT_API_KEY", None)
    process = subprocess.Popen([sys.executable, "-m", "elmokit", "serve", "--port", str(port), "--threads", "1"],
                               stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    stderr = process.communicate(timeout=120)[1]
    assert process.returncode == 0, stderr
    assert "interrupted" not in stderr and "stopped" in stderr, stderr


def test_wrong_routes_methods_and_chunked_bodies(server):
    assert server.call("GET", "/v1/embeddings")[:2] == (405, {"error": {
        "message": "GET is not allowed on /v1/embeddings", "type": "invalid_request_error", "code": "405"}})
    assert server.call("POST", "/nowhere", {"input": "a"})[0] == 404
    too_big = json.dumps({"input": "x " * 12_000}).encode()  # no Content-Length: counted as it streams
    status, answer, _ = server.call("POST", "/v1/embeddings", raw=too_big, chunked=True)
    assert status == 413 and "--max-body-bytes" in answer["error"]["message"]
    assert server.call("POST", "/v1/embeddings", raw=b'{"input": "fine"}', chunked=True)[0] == 200


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=20)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(["/v1/embeddings", "/embed", "/embed_all", "/explore"]),
       field=st.sampled_from(["input", "inputs", "query", "layers", "weird"]), value=json_values,
       junk=st.binary(max_size=40))
def test_random_bodies_never_get_a_5xx(server, route, field, value, junk):
    status, answer, _ = server.call("POST", route, {field: value, "word": "a", "sentences": ["a"]})
    assert 200 <= status < 500 and (status == 200 or "message" in answer["error"]), answer
    assert 200 <= server.call("POST", route, raw=junk)[0] < 500


def test_numbers_of_any_size_in_any_field_never_get_a_5xx(server):
    """Integers past float's range (a JSON 1 with 400 zeros, either sign), infinity (1e400) and
    booleans wherever a number might go, on every route: a 4xx that says why, or a 200, never a 500."""
    for route in ("/v1/embeddings", "/embed", "/embed_all"):
        for field in ("layers", "weights", "dimensions", "normalize", "encoding", "encoding_format"):
            for value in (HUGE, b"-" + HUGE, b"1e400", b"true", b"false"):
                sent = b'{"weights": [0, %s, 0]}' % value if field == "weights" else value
                raw = b'{"input": "hi", "inputs": [["a"]], "%s": %s}' % (field.replace("weights", "layers").encode(),
                                                                         sent)
                status, answer, _ = server.call("POST", route, raw=raw)
                assert 200 <= status < 500 and (status == 200 or "message" in answer["error"]), (raw[:80], answer)


# ---------------------------------------------------------------------------------------------
# The key, /health, /info, /metrics
# ---------------------------------------------------------------------------------------------
def test_the_api_key_is_required_except_for_health_and_the_page(server):
    for key in (None, "wrong", KEY + "x"):
        status, answer, headers = server.call("POST", "/v1/embeddings", {"input": "hi"}, key=key)
        assert status == 401 and answer["error"]["type"] == "authentication_error"
        assert headers["www-authenticate"] == "Bearer"
    assert server.call("GET", "/metrics", key=None)[0] == 401
    assert server.call("POST", "/v1/embeddings", {"input": "hi"}, headers={"Authorization": KEY})[0] == 401
    assert server.call("GET", "/health", key=None)[:2] == (200, {"status": "ok"})
    assert server.call("GET", "/", key=None)[0] == 200
    assert server.call("GET", "/static/explore.js", key=None)[0] == 200


def test_info_says_the_model_shape_and_limits(server):
    status, info, _ = server.call("GET", "/info")
    assert status == 200
    assert info["shape"]["layers"] == 3 and info["shape"]["dim"] == 12 and info["shape"]["projection_dim"] == 6
    assert info["limits"]["max_inputs"] == 8 and info["limits"]["max_input_tokens"] == 40
    assert info["api_key_required"] is True and info["tokenizer"] == "moses" and info["version"]
    assert info["dtype"] == "float32" and info["device"] == "cpu"  # --dtype's name, not torch's


def start_serve(model, *arguments: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`elmo serve` started bare (no waiting for /health, unlike `Server`): the process, and the
    address of its `listening on` line once printed (else the whole of stderr, the process ended)."""
    env = dict(os.environ, ELMOKIT_OFFLINE="1", **(env or {}))
    env.pop("ELMOKIT_API_KEY", None)
    process = subprocess.Popen([sys.executable, "-m", "elmokit", "serve", "--model", str(model), "--port", "0",
                                "--threads", "1", *arguments], stderr=subprocess.PIPE, text=True, env=env)
    said = []
    watchdog = threading.Timer(START_LIMIT, process.kill)  # a server stuck before `listening on` fails a test
    watchdog.start()  # instead of hanging it: killed, its stderr ends
    try:
        for line in process.stderr:
            said.append(line)
            if line.startswith("listening on http://"):
                return process, line.split()[2]
    finally:
        watchdog.cancel()
    process.wait(timeout=60)
    return process, "".join(said)


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("int8", marks=pytest.mark.skipif(
    not int8_native(), reason="int8 needs a CPU with VNNI or AMX-INT8"))])
def test_listening_means_answering_and_info_says_the_dtype_asked(model, dtype):
    """`listening on` is printed once the model's process has the model: /health answers 200 at
    once, without polling; /info says the dtype by --dtype's name (float32: the `server` fixture)."""
    process, url = start_serve(model, "--dtype", dtype)
    try:
        assert url.startswith("http://"), url
        host, port = url.removeprefix("http://").rsplit(":", 1)
        answers = {}
        for path in ("/health", "/info"):
            connection = http.client.HTTPConnection(host, int(port), timeout=30)
            connection.request("GET", path)
            response = connection.getresponse()
            answers[path] = (response.status, json.loads(response.read()))
            connection.close()
        assert answers["/health"] == (200, {"status": "ok"})
        assert answers["/info"][0] == 200 and answers["/info"][1]["dtype"] == dtype
    finally:
        process.terminate()
        process.wait(timeout=60)
        process.stderr.close()


def test_a_model_process_that_dies_loading_never_says_listening(model, tmp_path):
    """`listening on` waits for the model's process: one that dies as it starts (a sitecustomize
    that exits in multiprocessing's spawned children only) means no such line, and a failure."""
    exit_if_spawned = 'import sys\nif "--multiprocessing-fork" in sys.argv:\n    sys.exit(7)\n'
    (tmp_path / "sitecustomize.py").write_text(exit_if_spawned)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    process, said = start_serve(model, env={"PYTHONPATH": path})
    if said.startswith("http://"):
        process.terminate()
        process.wait(timeout=60)
    process.stderr.close()
    assert not said.startswith("http://"), "listening on was printed before the model's process had the model"
    assert process.returncode != 0 and "the model's process exited while loading" in said, said


def test_rings_larger_than_memory_are_refused_before_listening(model):
    """--rows 1 with 10^12 tokens a text: rings of 3 x (10^12 + 2) x 2 x 1 x 6 float32 (134 TiB),
    refused as an argument error naming both flags, before the model's process starts."""
    huge = str(10**12)
    process, said = start_serve(model, "--rows", "1", "--max-input-tokens", huge, "--max-queue-tokens", huge)
    assert process.returncode not in (0, None) and "listening on" not in said, said
    assert f"--max-input-tokens {huge} with --rows 1" in said and "GiB" in said and "Traceback" not in said, said


def test_the_rows_are_the_engines_choice_for_the_batch_tokens_unless_given(model, server, slow_server):
    """Without --rows the recurrence has the rows `embed_sentences` would choose for a call of
    --max-batch-tokens positions: about 128 positions a row, a power of two, at least 32."""
    assert server.call("GET", "/info")[1]["rows"] == 128  # 16384 positions (the default)
    assert slow_server.call("GET", "/info")[1]["rows"] == 64  # 10000 / 128 = 78: 64 the nearest
    given = Server(model, "--rows", "3")
    try:
        assert given.call("GET", "/info")[1]["rows"] == 3
    finally:
        assert given.stop() == 0
    for rows in ("0", "4097"):
        refused = subprocess.run([sys.executable, "-m", "elmokit", "serve", "--rows", rows, "--port", "0"],
                                 capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0 and f"--rows must be from 1 to 4096, got {rows}" in refused.stderr


def test_metrics_count_requests_tokens_batches_and_latency(server):
    before = server.metric('elmo_requests_total{route="/v1/embeddings",status="200"}')
    tokens = server.metric("elmo_tokens_total")
    assert server.call("POST", "/v1/embeddings", {"input": ["one two three", "four"]})[0] == 200
    assert server.call("POST", "/v1/embeddings", {"input": 7})[0] == 422
    status, text, headers = server.call("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert server.metric('elmo_requests_total{route="/v1/embeddings",status="200"}') == before + 1
    assert server.metric("elmo_tokens_total") == tokens + 4
    for name in ("elmo_request_seconds_bucket", "elmo_batch_sentences_bucket", "elmo_batch_tokens_bucket",
                 "elmo_queue_seconds_bucket", "elmo_inference_seconds_bucket", "elmo_queue_tokens",
                 "elmo_recurrence_steps", "elmo_recurrence_busy_row_steps",
                 'elmo_requests_total{route="/v1/embeddings",status="422"}'):
        assert name in text


def test_a_dead_model_process_gets_503_not_a_hang(model):
    """The model runs in a process of its own: should it die, requests get 503 and /health says so."""
    served = Server(model)
    try:
        assert served.call("POST", "/v1/embeddings", {"input": "hi"})[0] == 200
        children = [int(pid) for task in Path(f"/proc/{served.process.pid}/task").iterdir()
                    for pid in (task / "children").read_text().split()]
        model_process = [pid for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(model_process) == 1  # (the other child is multiprocessing's resource tracker)
        os.kill(model_process[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while served.call("GET", "/health")[0] == 200:
            assert time.monotonic() < deadline, "/health never noticed"
            time.sleep(0.05)
        status, answer, _ = served.call("GET", "/health")
        assert status == 503 and "model's process has stopped" in answer["error"]["message"]
        status, answer, _ = served.call("POST", "/v1/embeddings", {"input": "hi"})
        assert status == 503 and answer["error"]["type"] == "unavailable"
        refused = [line for line in served.call("GET", "/metrics")[1].splitlines()
                   if line.startswith("elmo_refused_total")]
        assert refused == ['elmo_refused_total{reason="503"} 1.0'], refused  # counted once, by its status
    finally:
        assert served.stop() == 0
    said = "".join(served.stderr)  # a clean stop that says what happened, and no false "every request answered"
    assert "Traceback" not in said and "shutdown failed" not in said, said
    assert "the model's process had died while serving (exit code -9)" in said, said
    assert "every accepted request was answered" not in said, said


# ---------------------------------------------------------------------------------------------
# A full queue, and SIGTERM with requests in flight (the slow server; SIGTERM last)
# ---------------------------------------------------------------------------------------------
def wait_for_queue(served: Server, n_requests: int) -> None:
    deadline = time.monotonic() + 30
    while served.metric("elmo_queue_requests") < n_requests:
        assert time.monotonic() < deadline, "the requests never reached the queue"
        time.sleep(0.02)


def test_a_full_queue_answers_429(slow_server):
    first = {}
    thread = threading.Thread(target=lambda: first.update(answer=slow_server.call(
        "POST", "/embed_all", {"inputs": [["w"] * 30]})))
    thread.start()
    wait_for_queue(slow_server, 1)
    refused = slow_server.metric('elmo_refused_total{reason="429"}')
    status, answer, headers = slow_server.call("POST", "/embed_all", {"inputs": [["w"] * 30]})
    assert status == 429 and "--max-queue-tokens" in answer["error"]["message"] and headers["retry-after"] == "1"
    thread.join()
    assert first["answer"][0] == 200  # the one already queued is answered
    text = slow_server.call("GET", "/metrics")[1]
    assert slow_server.metric('elmo_refused_total{reason="429"}') == refused + 1  # once, and by one name only
    assert "queue_full" not in text and "model_failed" not in text


def test_a_request_larger_than_the_queue_gets_413_not_429_nor_200(slow_server):
    """60 tokens, the queue's limit 50: it could never be queued, even alone, so 'try again' (429)
    would be a lie and a 200 would break the limit; 413 says so, with both numbers."""
    status, answer, headers = slow_server.call("POST", "/embed_all", {"inputs": [["w"] * 30, ["w"] * 30]})
    assert status == 413 and "retry-after" not in headers, answer
    assert "60 tokens" in answer["error"]["message"] and "--max-queue-tokens 50" in answer["error"]["message"]
    assert slow_server.call("POST", "/embed", {"inputs": [["w"] * 30, ["w"] * 20]})[0] == 200  # 50: exactly the limit


def test_at_the_defaults_the_largest_request_the_limits_admit_fits_the_queue():
    """--max-inputs texts of --max-input-tokens tokens each pass the queue's check at the defaults
    (a 413 there would refuse a request every other limit admits); one token more is TooLarge."""
    import asyncio

    from elmokit.serve.batching import Batcher, ModelFailed, TooLarge
    from elmokit.serve.inputs import Limits

    limits = Limits()
    batcher = Batcher(None, 4, limits.max_input_tokens + 2, limits.max_batch_tokens, 0.002, limits.max_queue_tokens,
                      lambda *_: None, lambda *_: None)  # never launched: past the queue's checks, "not alive"
    largest = [["w"] * limits.max_input_tokens] * limits.max_inputs
    with pytest.raises(ModelFailed):
        asyncio.run(batcher.submit(largest))
    with pytest.raises(TooLarge):
        asyncio.run(batcher.submit([*largest, ["w"]]))


def test_sigterm_finishes_the_accepted_requests_and_exits_0(slow_server, embedder):
    sentences = [["one"], ["two", "words"], ["and", "three", "more"]]
    threads, answers = ask_each_at_once(slow_server, sentences)
    wait_for_queue(slow_server, len(sentences))  # accepted, waiting for their batch
    slow_server.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(timeout=60)
    assert_each_as_alone(sentences, answers, embedder)
    assert slow_server.process.wait(timeout=60) == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((slow_server.host, slow_server.port), timeout=5)
