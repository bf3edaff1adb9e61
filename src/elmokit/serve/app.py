"""The HTTP service of `elmo serve`: a Starlette app around one `ElmoEmbedder` and its `Batcher`.

Routes (docs/serve.md has examples):

    POST /v1/embeddings  OpenAI's: one vector per input, the mean over its tokens of the
                         equal-weight average of all layers (TF-Hub's `default`)
    POST /embed          TEI's: the same vectors, a bare list, unit length unless "normalize": false
    POST /embed_all      token-level vectors (all layers, one, or a weighted mix), the tokens beside
    POST /explore        the page's nearest occurrences and PCA picture
    GET  /health, /info, /metrics, / (the page) and /static/...

Every refusal is JSON {"error": {"message", "type", "code"}} with a 4xx status; with an API key,
every route but /health and the page needs `Authorization: Bearer KEY` (the scheme in any case).

A request whose client hangs up before its answer is cancelled, in the model's process too (its
sentences leave the queue and the recurrence); a body must arrive within `--body-timeout` (408).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import time
from importlib.resources import files
from pathlib import Path

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from elmokit import __version__
from elmokit.inference.elmo import bilm_precision
from elmokit.inference.embedder import ElmoEmbedder
from elmokit.serve.batching import Batcher, ModelFailed, QueueFull, TooLarge
from elmokit.serve.explore import examples, explore, locate
from elmokit.serve.inputs import (
    BadRequest,
    Limits,
    Tokenizer,
    parse_json_async,
    read_bool,
    read_choice,
    read_inputs_async,
    read_layers,
)
from elmokit.serve.metrics import ServeMetrics
from elmokit.serve.recurrence import check_rings_fit
from elmokit.serve.responses import JSONResponse, answer_off_loop, encode, error_response

STATIC = Path(str(files("elmokit") / "serve" / "static"))


class ClientGone(Exception):
    """The client closed its connection before its answer: the work was dropped, nobody reads a reply."""


async def client_gone(request: Request) -> None:
    """Return once the client has closed the connection (the body has been read: what the server
    receives next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0)


class Service:
    """What the routes share: the batcher (and through it the model's process, `rows` rows of the
    recurrence; None: the engine's for `limits.max_batch_tokens` positions, `ElmoEmbedder.rows_at`),
    the limits, the metrics. The embedder goes to the model's process; this process
    keeps none of it (the model is not held twice)."""

    def __init__(self, embedder: ElmoEmbedder, model_name: str, limits: Limits, tokenize: Tokenizer,
                 tokenizer_name: str, api_key: str | None, rows: int | None = None):
        self.model_name = model_name
        self.limits = limits
        self.tokenize = tokenize
        self.tokenizer_name = tokenizer_name
        self.api_key = api_key
        self.n_layers = embedder.bilm.config.n_output_layers
        self.metrics = ServeMetrics(ROUTES)
        if rows is None:
            rows = embedder.rows_at(limits.max_batch_tokens)
        check_rings_fit(embedder.bilm, embedder.device, rows, limits.max_input_tokens)
        self.unanswered = 0  # requests still in flight when --shutdown-timeout ran out (each answered 503)
        self.batcher = Batcher(embedder, rows, limits.max_input_tokens + 2, limits.max_batch_tokens,
                               limits.max_wait_ms / 1000, limits.max_queue_tokens, self.metrics.record_batch,
                               self.metrics.inference_seconds.observe)
        self.metrics.watch(self.batcher)
        self.info = self._info(embedder)  # what GET /info and the page's starting text say never changes: built once
        self.examples = examples()

    def _info(self, embedder: ElmoEmbedder) -> dict:
        config = embedder.bilm.config
        return {
            "model": self.model_name, "version": __version__,
            "shape": {"layers": self.n_layers, "dim": embedder.output_dim,
                      "lstm_layers": config.lstm.n_layers, "cell_dim": config.lstm.cell_dim,
                      "projection_dim": config.lstm.projection_dim,
                      "parameters": embedder.bilm.n_parameters},
            "device": str(embedder.device), "dtype": bilm_precision(embedder.bilm),
            "tokenizer": self.tokenizer_name, "limits": dataclasses.asdict(self.limits),
            "rows": self.batcher.rows,
            "api_key_required": self.api_key is not None}

    async def body(self, request: Request) -> dict:
        """The JSON object of the body, read up to `max_body_bytes` (413 past it) within
        `body_timeout_s` (408 past it: a client that sends its body a byte at a time holds no
        handler, and does not hold a stopping server either); its size in `request.state.body_bytes`.
        A compressed body (`Content-Encoding` other than identity) is refused: 415."""
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise BadRequest(415, f"the request body is compressed (Content-Encoding: {encoding[:40]}): elmo serve "
                                  f"reads uncompressed JSON only; send it without Content-Encoding")
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BadRequest(413, f"the request body has {int(declared)} bytes, more than the limit of {limit} "
                                  f"(--max-body-bytes)")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise BadRequest(413, f"the request body has more than {limit} bytes (--max-body-bytes)")
                    chunks.append(chunk)
        except TimeoutError:
            raise BadRequest(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s "
                                  f"({size} bytes came; --body-timeout)") from None
        request.state.body_bytes = size
        return await parse_json_async(b"".join(chunks))

    async def inputs(self, request: Request, body: dict, field: str, allow_tokens: bool = True,
                     others: int = 0) -> list[list[str]]:
        """body[field] as token lists (`read_inputs`; a large body's off the event loop)."""
        return await read_inputs_async(body, field, self.limits, self.tokenize, request.state.body_bytes,
                                       allow_tokens, others)

    def check_model(self, body: dict) -> None:
        """OpenAI's "model" (optional here), and "dimensions": refused unless they fit this server."""
        name = body.get("model", self.model_name)
        if not isinstance(name, str):
            raise BadRequest(422, "'model' must be a string")
        if name != self.model_name:
            raise BadRequest(404, f"the model {name[:200]!r} is not served here: this server holds "
                                  f"{self.model_name!r} (send \"model\": {json.dumps(self.model_name)}, or leave it "
                                  f"out)", code="model_not_found")
        dim = self.info["shape"]["dim"]
        if body.get("dimensions") not in (None, dim) or isinstance(body.get("dimensions"), bool):
            raise BadRequest(400, f"'dimensions' {json.dumps(body['dimensions'])[:60]} is not available: this "
                                  f"model's vectors have {dim} dimensions and cannot be shortened (leave "
                                  f"'dimensions' out)")

    async def embed(self, request: Request, sentences: list[list[str]],
                    sentence_vectors: bool = False) -> list[np.ndarray]:
        """Each sentence's layers (L+1, n, 2P), or with `sentence_vectors` its vector (2P,).
        Should the client hang up first, the request is cancelled (in the model's process too)
        and ClientGone raised."""
        work = asyncio.ensure_future(self.batcher.submit(sentences, sentence_vectors))
        gone = asyncio.ensure_future(client_gone(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            abandoned = not work.done()  # the client has gone, or this handler is cancelled (shutdown's time up)
            if abandoned:
                work.cancel()  # `submit` tells the model's process
        if abandoned:
            self.metrics.abandoned.inc()
            raise ClientGone()
        try:
            answer = work.result()
        except QueueFull as full:  # each refusal is counted once, by its status (`bad_request`)
            raise BadRequest(429, str(full), "overloaded") from None
        except TooLarge as large:
            raise BadRequest(413, str(large)) from None
        except ModelFailed as failed:
            raise BadRequest(503, str(failed), "unavailable") from None
        self.metrics.record_answered(sentences)  # only what reaches a client that waits for it
        return answer

    def usage(self, sentences: list[list[str]]) -> dict:
        n_tokens = sum(map(len, sentences))
        return {"prompt_tokens": n_tokens, "total_tokens": n_tokens}


# ---------------------------------------------------------------------------------------------
# Routes
# ---------------------------------------------------------------------------------------------
async def openai_embeddings(request: Request) -> Response:
    service: Service = request.app.state.service
    body = await service.body(request)
    sentences = await service.inputs(request, body, "input")
    encoding = read_choice(body, "encoding_format", ("float", "base64"))
    service.check_model(body)
    vectors = await service.embed(request, sentences, sentence_vectors=True)  # (2P,) each
    data = [{"object": "embedding", "index": i, "embedding": encode(v, encoding)}
            for i, v in enumerate(vectors)]
    return JSONResponse({"object": "list", "data": data, "model": service.model_name,
                         "usage": service.usage(sentences)})


async def tei_embed(request: Request) -> Response:
    service: Service = request.app.state.service
    body = await service.body(request)
    sentences = await service.inputs(request, body, "inputs")
    normalize = read_bool(body, "normalize", True)
    vectors = await service.embed(request, sentences, sentence_vectors=True)  # (2P,) each
    if normalize:
        vectors = [v / max(float(np.linalg.norm(v)), 1e-12) for v in vectors]
    return JSONResponse([encode(v, "float") for v in vectors])


async def embed_all(request: Request) -> Response:
    service: Service = request.app.state.service
    body = await service.body(request)
    sentences = await service.inputs(request, body, "inputs")
    how, which = read_layers(body, service.n_layers)
    encoding = read_choice(body, "encoding", ("float", "base64"))
    layers = await service.embed(request, sentences)  # (L+1, n, 2P) each
    return await answer_off_loop(lambda: embed_all_answer(service, sentences, layers, how, which, encoding))


def embed_all_answer(service: Service, sentences: list[list[str]], each_layers: list[np.ndarray], how: str,
                     which, encoding: str) -> dict:
    """/embed_all's answer: each sentence's tokens and its layers as `read_layers` asked (all, one,
    or a mix), encoded (BadRequest(422) for a mix that overflows float32)."""
    data = []
    for i, (tokens, layers) in enumerate(zip(sentences, each_layers)):  # (L+1, n, 2P)
        if how == "one":
            layers = layers[which]  # (n, 2P)
        elif how == "mix":
            layers = np.tensordot(np.asarray(which, np.float32), layers, axes=1)  # (n, 2P)
            if not np.isfinite(layers).all():  # JSON has no inf or NaN: they would be written as null
                raise BadRequest(422, f"'layers' weights {which} overflow float32 on inputs[{i}]: the weighted "
                                      f"sum is not finite; use smaller weights")
        data.append({"index": i, "tokens": tokens, "shape": list(layers.shape), "embedding": encode(layers, encoding)})
    layers_asked = {"all": "all", "one": which, "mix": {"weights": which}}[how]  # as read, not as sent
    return {"model": service.model_name, "layers": layers_asked, "encoding": encoding, "data": data,
            "usage": service.usage(sentences)}


async def explore_route(request: Request) -> Response:
    service: Service = request.app.state.service
    body = await service.body(request)
    if not isinstance(body.get("query"), str):
        raise BadRequest(422, "'query' must be one string: the query sentence")
    query = await service.inputs(request, body, "query")
    word = body.get("word")
    if not isinstance(word, str) or not word.strip():
        raise BadRequest(422, "'word' must be a non-empty string: the query word")
    sentences = await service.inputs(request, body, "sentences", allow_tokens=False, others=1)  # with the query
    where = locate(query[0], word.strip(), sentences)  # before any vector: a word found nowhere costs nothing
    vectors = await service.embed(request, query + sentences)
    return await answer_off_loop(lambda: explore(query[0], sentences, vectors, where))


async def explore_examples(request: Request) -> Response:
    return JSONResponse(request.app.state.service.examples)


async def health(request: Request) -> Response:
    """200 while the model's process runs; 503 once it has stopped (a supervisor should restart)."""
    if not request.app.state.service.batcher.alive:
        return error_response(503, "the model's process has stopped: restart elmo serve", "unavailable")
    return JSONResponse({"status": "ok"})


async def info(request: Request) -> Response:
    return JSONResponse(request.app.state.service.info)


async def metrics(request: Request) -> Response:
    service: Service = request.app.state.service
    return Response(service.metrics.text(), media_type=service.metrics.content_type)


async def page(request: Request) -> Response:
    return FileResponse(STATIC / "index.html")


# ---------------------------------------------------------------------------------------------
# Errors, the API key and the request metrics
# ---------------------------------------------------------------------------------------------
async def bad_request(request: Request, error: BadRequest) -> Response:
    """Every refusal of a route, counted once in `elmo_refused_total`, by its status."""
    request.app.state.service.metrics.refused.labels(str(error.status)).inc()
    headers = {"Retry-After": "1"} if error.status == 429 else {"Connection": "close"} if error.status == 408 else None
    return error_response(error.status, error.message, error.kind, headers, error.code)


async def client_left(request: Request, error: ClientGone) -> Response:
    """Nobody reads it: the status (nginx's 499, "client closed request") is for /metrics."""
    return error_response(499, "the client closed the connection before its answer: the request was dropped")


async def http_error(request: Request, error: HTTPException) -> Response:
    message = {404: f"no route {request.url.path}: see GET /info and docs/serve.md",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(error.status_code, str(error.detail))
    return error_response(error.status_code, message, headers=getattr(error, "headers", None))


async def disconnected(request: Request, error: ClientDisconnect) -> Response:
    """The client hung up while sending its body: abandoned, as one that hangs up later (`client_left`)."""
    request.app.state.service.metrics.abandoned.inc()
    return error_response(499, "the client closed the connection before sending the whole body")


class KeyAndMetrics:
    """ASGI middleware: refuses requests without the API key (401), and counts and times every
    HTTP request by route and status."""

    def __init__(self, app, service: Service):
        self.app = app
        self.service = service
        self.expected = None if service.api_key is None else service.api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status, responded = 500, False

        async def send_and_watch(message):
            nonlocal status, responded
            if message["type"] == "http.response.start":
                status, responded = message["status"], True
            await send(message)

        try:
            if self.expected is not None and not self._open(scope["path"]) and not self._has_key(scope):
                response = error_response(401, "a valid API key is required: send the header "
                                               "'Authorization: Bearer KEY'", "authentication_error",
                                          {"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send_and_watch)
            await self.app(scope, receive, send_and_watch)
        except asyncio.CancelledError:  # --shutdown-timeout passed before this request was answered
            if not responded:  # say so, rather than let uvicorn log a traceback and answer a bare 500
                self.service.unanswered += 1
                await error_response(503, "the server stopped before this request was answered "
                                          "(--shutdown-timeout)", "unavailable")(scope, receive, send_and_watch)
        finally:
            self.service.metrics.record_request(scope["path"], status, started)

    @staticmethod
    def _open(path: str) -> bool:
        """No key for the health check and the page (its files and starting text hold no data)."""
        return path in ("/", "/health", "/explore/examples") or path.startswith("/static/")

    def _has_key(self, scope) -> bool:
        """`Authorization: Bearer KEY`, the scheme in any case and one or more spaces after it
        (RFC 7235, section 2.1)."""
        scheme, _, credentials = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.lstrip(b" "), self.expected)


API = [Route("/v1/embeddings", openai_embeddings, methods=["POST"]),
       Route("/embed", tei_embed, methods=["POST"]), Route("/embed_all", embed_all, methods=["POST"]),
       Route("/explore", explore_route, methods=["POST"]),
       Route("/explore/examples", explore_examples, methods=["GET"]),
       Route("/health", health, methods=["GET"]), Route("/info", info, methods=["GET"]),
       Route("/metrics", metrics, methods=["GET"]), Route("/", page, methods=["GET"])]
ROUTES = {route.path for route in API}  # the metrics' route labels; any other path (/static/...) is "other"


def build_app(service: Service, on_ready=lambda: None) -> Starlette:
    """The app; `on_ready()` is called once the model's process has the model (requests are
    answered from then on)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await asyncio.to_thread(service.batcher.launch)  # the model's process (elmokit.serve.worker)
        service.batcher.start()
        on_ready()
        yield
        await service.batcher.stop()

    routes = [*API, Mount("/static", StaticFiles(directory=STATIC), name="static")]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={BadRequest: bad_request, HTTPException: http_error,
                                        ClientDisconnect: disconnected, ClientGone: client_left})
    app.state.service = service
    app.add_middleware(KeyAndMetrics, service=service)
    return app
