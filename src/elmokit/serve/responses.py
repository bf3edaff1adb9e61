"""What the routes of `elmo serve` answer: JSON by orjson, errors in OpenAI's shape, and vectors
as JSON numbers or base64."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable

import numpy as np
import orjson
from starlette.responses import Response


class JSONResponse(Response):
    """JSON by orjson: numpy arrays written straight from their float32 values (each number the
    shortest decimal that reads back as the same float32), without the Python float per number
    that `json` needs: the encoding is a share of every request's time in the server's process."""

    media_type = "application/json"

    def render(self, content) -> bytes:
        return dumps(content)


def dumps(content) -> bytes:
    """`content` as JSON bytes (numpy arrays written from their float32 values)."""
    return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


async def answer_off_loop(build: Callable[[], object]) -> Response:
    """A 200 of the JSON of `build()`, built and encoded in a worker thread: for answers that
    grow with a request's tokens (`/embed_all`'s layers, `/explore`'s pictures), which on the
    event loop would hold every other request, /health's included, while they are encoded."""
    return Response(await asyncio.to_thread(lambda: dumps(build())), media_type=JSONResponse.media_type)


def error_response(status: int, message: str, kind: str = "invalid_request_error", headers=None,
                   code: str | None = None) -> JSONResponse:
    """OpenAI's error shape, which TEI's clients also read: {"error": {"message", "type", "code"}},
    `code` a string for every error: OpenAI's where it has one, such as "model_not_found", else
    the status ("422"), so that a client reads one type whatever the error."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": code or str(status)}}, status,
                        headers=headers)


def encode(array: np.ndarray, encoding: str) -> np.ndarray | str:
    """float: the array (written as nested JSON lists); base64: its little-endian float32 bytes,
    C order."""
    array = np.ascontiguousarray(array, dtype="<f4")
    if encoding == "base64":
        return base64.b64encode(array.tobytes()).decode("ascii")
    return array
