"""A small HTTP server on 127.0.0.1 that answers as a test tells it, hostile or not, for the
tests of elmokit's HTTP clients (tests never reach the internet):

    def answer(request: Request) -> None:      # any behaviour: redirects, drips, endless bodies
        request.send(200, {"data": [...]})
    with HostileServer(answer) as server:
        ...server.url...
        server.requests                        # [Request], in order, each recorded before it is answered

`embeddings_answer` answers `/v1/embeddings` as `elmo serve` does, with vectors made from the
tokens sent (`token_vector`), so a test knows which vector belongs to which text.
"""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Callable

import numpy as np

from tests.local_server import LocalServer

WIDTH = 4  # the width of `token_vector`'s vectors


def token_vector(tokens: list[str]) -> np.ndarray:
    """(WIDTH,) float32 that tells texts apart: the token count, the characters, the first
    character's code, 1; zeros for no token (what the client gives a text without tokens)."""
    return np.array([len(tokens), sum(map(len, tokens)), ord(tokens[0][0]) if tokens else 0, bool(tokens)], np.float32)


def encoded(vector: np.ndarray) -> str:
    """A vector as `elmo serve` sends it with encoding_format base64: little-endian float32."""
    return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")


@dataclass
class Request:
    """One request as the server read it, and the means to answer it."""

    method: str
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes
    handler: BaseHTTPRequestHandler = field(repr=False)

    def json(self):
        return json.loads(self.body)

    def send(self, status: int, answer=None, headers: dict[str, str] | None = None, raw: bytes | None = None) -> None:
        """Answer with `answer` as JSON (or the bytes `raw`), its Content-Length, and `headers`."""
        data = raw if raw is not None else json.dumps(answer).encode()
        self.handler.send_response(status)
        for key, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                           **(headers or {})}.items():
            self.handler.send_header(key, value)
        self.handler.end_headers()
        self.handler.wfile.write(data)

    def write(self, data: bytes) -> None:
        """Bytes as they are on the connection (a hand-made answer, a byte at a time)."""
        self.handler.wfile.write(data)
        self.handler.wfile.flush()


def embeddings_answer(request: Request) -> None:
    """`elmo serve`'s answer to POST /v1/embeddings of token lists (base64), `token_vector` of each."""
    if request.path == "/info":
        return request.send(200, {"shape": {"dim": WIDTH}})
    texts = request.json()["input"]
    request.send(200, {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": encoded(
        token_vector(tokens))} for i, tokens in enumerate(texts)]})


class HeldUntilReleased:
    """A handler that gives `embeddings_answer` only once `release()`, a coroutine, has run on the
    caller's event loop: an async method that blocked the loop gets a 503 instead (after 60 s)."""

    def __init__(self):
        self.released = threading.Event()

    def __call__(self, request: Request) -> None:
        if not self.released.wait(60):
            return request.send(503, {"error": {"message": "never released: the event loop was blocked"}})
        embeddings_answer(request)

    async def release(self) -> None:
        self.released.set()

    def rearm(self) -> None:
        self.released.clear()


class HostileServer(LocalServer):
    def __init__(self, answer: Callable[[Request], None]):
        self.answer = answer
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._listen(block_on_close=False)  # a dripping answer ends when its client is gone, not before

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {key.lower(): value for key, value in self.headers.items()}
                request = Request(self.command, self.path, headers, body, self)
                with server._lock:
                    server.requests.append(request)
                self.close_connection = True
                try:
                    server.answer(request)
                except OSError:  # the client gave up
                    pass

            do_GET = do_POST = _any

        return Handler
