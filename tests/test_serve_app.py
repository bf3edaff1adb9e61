"""`elmo serve`'s app in this process, with the test in the place of the model's process (on the
batcher's own pipes): what runs off the event loop, /explore's limits, one shape for every error,
and a client that hangs up just as its answer arrives."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import threading
import types

import numpy as np
import pytest

pytest.importorskip("starlette", reason="elmo serve needs the serve extra: pip install 'elmokit[serve]'")
pytest.importorskip("prometheus_client", reason="elmo serve needs the serve extra: pip install 'elmokit[serve]'")

from elmokit import ElmoEmbedder  # noqa: E402  (after the serve extra's check)
from elmokit.serve import explore as explore_module  # noqa: E402
from elmokit.serve.app import ClientGone, Service, build_app  # noqa: E402
from elmokit.serve.inputs import Limits  # noqa: E402

KEY = "test-key-51c2"
STATS = {"batches": [], "answer_seconds": [], "steps": 1, "row_steps": 1, "computed_row_steps": 1}
WAIT = 10.0  # seconds a gate waits for the event loop before it gives up (only on a failure)


class ModelStandIn:
    """The model's process, played here: it holds the other ends of the batcher's pipes. `serve()`
    answers every job in a thread (random layers (L+1, n, 2P)); or `job()` and `answer()` by hand."""

    def __init__(self, service: Service):
        batcher = service.batcher
        self.jobs, batcher._jobs = multiprocessing.Pipe(duplex=False)
        batcher._connection, self.answers = multiprocessing.Pipe(duplex=False)
        batcher._process = types.SimpleNamespace(is_alive=lambda: True, exitcode=None)
        self.shape = (service.n_layers, service.info["shape"]["dim"])

    def job(self) -> tuple[int, list[list[str]]]:
        """The next job's id and sentences (a cancel message before it fails the test)."""
        assert self.jobs.poll(WAIT), "no job came"
        kind, job_id, sentences, *_ = self.jobs.recv()
        assert kind == "job", kind
        return job_id, sentences

    def answer(self, job_id: int, sentences: list[list[str]]) -> None:
        rng = np.random.default_rng(job_id)
        layers = [rng.standard_normal((self.shape[0], len(s), self.shape[1])).astype(np.float32) for s in sentences]
        self.answers.send(("answers", [(job_id, layers, None)], STATS))

    def serve(self) -> None:
        def answer_all():
            try:
                while True:
                    message = self.jobs.recv()
                    if message[0] == "job":
                        self.answer(message[1], message[2])
            except (EOFError, OSError):
                pass

        threading.Thread(target=answer_all, daemon=True).start()


@pytest.fixture
def service(tiny_model):
    served = Service(ElmoEmbedder(module=tiny_model), "tiny", Limits(max_wait_ms=0), str.split, "split", KEY,
                     rows=4)
    served.stand_in = ModelStandIn(served)
    yield served
    served.batcher._jobs.close()  # the stand-in's thread, if any, reads the end of its pipe and returns
    served.batcher._connection.close()


async def call(app, method: str, path: str, body=None, *, key: str | None = KEY,
               hang_up: asyncio.Event | None = None) -> tuple[int, dict]:
    """One request through the ASGI app: (status, its JSON). The client hangs up once `hang_up`
    is set (by default once the answer has come)."""
    raw = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080)}
    pending = [{"type": "http.request", "body": raw, "more_body": False}]
    answered = asyncio.Event()
    status, chunks = 0, []

    async def receive():
        if pending:
            return pending.pop()
        await (hang_up or answered).wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    answered.set()
    return status, json.loads(b"".join(chunks) or b"null")


# ---------------------------------------------------------------------------------------------
# What runs off the event loop
# ---------------------------------------------------------------------------------------------
def gate(function, events: list[str], loop_ran: threading.Event, wanted=lambda *args: True):
    """`function`, which on its first wanted call says so and waits (up to WAIT s) for the event
    loop to answer /health before it goes on: on the loop it would wait in vain."""
    started = threading.Event()

    def gated(*args, **kwargs):
        if started.is_set() or not wanted(*args):
            return function(*args, **kwargs)
        events.append("answer started")
        started.set()
        loop_ran.wait(WAIT)
        events.append("answer built")
        return function(*args, **kwargs)

    gated.started = started
    return gated


PLAY = " ".join(["They", "play", "chess", "."] * 16)  # 64 tokens, 16 occurrences of "play"
LARGE = [("/embed_all", {"inputs": [["w"] * 512] * 8}, "dumps"),
         ("/explore", {"query": "I play", "word": "play", "sentences": [PLAY] * 8}, "pca_2d")]


@pytest.mark.parametrize("path, body, where", LARGE, ids=["embed_all", "explore"])
def test_health_answers_while_a_large_answer_is_built(service, monkeypatch, path, body, where):
    """/embed_all's layers are encoded, and /explore's pictures computed, in a worker thread: the
    gate in the middle of each waits for /health to be answered, which happens in between (on
    the event loop, the gate would wait in vain and /health would come after the answer)."""
    import orjson

    events, loop_ran = [], threading.Event()
    if where == "dumps":  # the JSON of the layers (not /health's small one)
        gated = gate(orjson.dumps, events, loop_ran, lambda content, *_: isinstance(content, dict) and "data" in content)
        monkeypatch.setattr(orjson, "dumps", gated)
    else:
        gated = gate(explore_module.pca_2d, events, loop_ran)
        monkeypatch.setattr(explore_module, "pca_2d", gated)
    service.stand_in.serve()

    async def scenario():
        app = build_app(service)
        service.batcher.start()
        large = asyncio.ensure_future(call(app, "POST", path, body))
        while not gated.started.is_set() and not large.done():
            await asyncio.sleep(0.01)
        health = await call(app, "GET", "/health")
        events.append("health answered")
        loop_ran.set()
        answer = await large
        events.append("answer sent")
        return health, answer

    health, (status, answer) = asyncio.run(scenario())
    assert health == (200, {"status": "ok"})
    assert status == 200, answer
    assert events == ["answer started", "health answered", "answer built", "answer sent"]


# ---------------------------------------------------------------------------------------------
# /explore's limits
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sentences, message", [
    ([" ".join(["play"] * 300)], "'play' occurs 300 times in the sentences, more than the limit of 256 occurrences"),
    ([" ".join(["w"] * 500)] * 9 + ["they play"], "have 4503 tokens, more than the limit of 4096 tokens")])
def test_explore_refuses_what_is_past_its_limits_before_computing(service, sentences, message):
    """Within --max-inputs and --max-input-tokens, but past what the page computes and pictures:
    one 422 naming the limit, and nothing sent to the model. Just within both, a 200."""
    service.stand_in.serve()
    sent = []
    real_submit = service.batcher.submit
    service.batcher.submit = lambda chosen, *args: sent.append(chosen) or real_submit(chosen, *args)

    async def scenario():
        app = build_app(service)
        service.batcher.start()
        refused = await call(app, "POST", "/explore", {"query": "play", "word": "play", "sentences": sentences})
        within = {"query": "play", "word": "play",  # 256 occurrences, 1 + 256 + 7 x 512 + 255 = 4096 tokens
                  "sentences": [" ".join(["play"] * 256)] + [" ".join(["w"] * 512)] * 7 + [" ".join(["w"] * 255)]}
        return refused, await call(app, "POST", "/explore", within)

    (status, answer), (ok, explored) = asyncio.run(scenario())
    assert status == 422 and message in answer["error"]["message"], answer
    assert len(sent) == 1 and ok == 200 and explored["n_occurrences"] == 256, explored


# ---------------------------------------------------------------------------------------------
# One shape for every error
# ---------------------------------------------------------------------------------------------
def test_every_error_has_a_string_code(service):
    """400, 401, 404 (route and model), 405, 413, 415 and 422: {"error": {"message", "type",
    "code"}}, `code` a string each time: OpenAI's ("model_not_found") or the status ("422")."""
    too_big = b'{"input": "' + b"x" * service.limits.max_body_bytes + b'"}'
    requests = [("POST", "/embed", b"not json", KEY, 400), ("POST", "/embed", {"inputs": "hi"}, None, 401),
                ("GET", "/nowhere", None, KEY, 404), ("GET", "/embed", None, KEY, 405),
                ("POST", "/embed", too_big, KEY, 413), ("POST", "/embed", {"inputs": 5}, KEY, 422),
                ("POST", "/v1/embeddings", {"input": "hi", "model": "gpt"}, KEY, 404)]

    async def scenario():
        app = build_app(service)
        return [await call(app, method, path, body, key=key) for method, path, body, key, _ in requests]

    answers = asyncio.run(scenario())
    assert [status for status, _ in answers] == [expected for *_, expected in requests]
    for (status, answer), (_, path, *_) in zip(answers, requests):
        assert set(answer["error"]) == {"message", "type", "code"}, answer
        expected = "model_not_found" if path == "/v1/embeddings" else str(status)
        assert answer["error"]["code"] == expected, (status, answer)


# ---------------------------------------------------------------------------------------------
# A client that hangs up as its answer arrives
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("answer_first", [True, False], ids=["answer-then-hang-up", "hang-up-then-answer"])
@pytest.mark.parametrize("turns", [0, 1, 2, 3, 4])
def test_a_client_hanging_up_as_its_answer_arrives_leaves_the_server_serving(service, answer_first, turns):
    """The answer reaches the server's reader and the client hangs up in the same turn of the
    event loop (turns=0) or a few turns apart, in either order: no error in any callback
    (InvalidStateError for a result set on a cancelled future), the request answered or dropped,
    the queue empty, and the next request answered."""
    stand_in, errors = service.stand_in, []

    async def scenario():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        service.batcher.start()
        hang_up = asyncio.Event()
        request = types.SimpleNamespace(receive=lambda: hang_up.wait())  # `client_gone` reads a disconnect
        asked = asyncio.ensure_future(service.embed(request, [["They", "play"]]))
        job_id, sentences = await asyncio.to_thread(stand_in.job)
        answer = lambda: stand_in.answer(job_id, sentences)  # noqa: E731  in the pipe on return
        first, second = (answer, hang_up.set) if answer_first else (hang_up.set, answer)
        first()
        for _ in range(turns):
            await asyncio.sleep(0)
        second()
        try:
            outcome = "answered" if len(await asked) == 1 else "wrong"
        except ClientGone:
            outcome = "dropped"
        stand_in.serve()  # the next request is answered by the stand-in's thread
        following = await asyncio.wait_for(service.embed(types.SimpleNamespace(receive=asyncio.Event().wait),
                                                         [["a", "b", "c"]]), WAIT)
        return outcome, following

    outcome, following = asyncio.run(scenario())
    assert errors == [], errors
    assert outcome in ("answered", "dropped")
    assert service.batcher.queue == {} and service.batcher.queued_tokens == 0
    assert len(following) == 1 and following[0].shape == (3, 3, 12)
