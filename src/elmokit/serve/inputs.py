"""What a request body may hold, checked before anything is queued: every problem is a
`BadRequest` (a 4xx status and a message that says what was wrong and where), never a 5xx.

Inputs are raw strings (tokenized as `elmo embed --tokenize` does: Moses) or token lists;
`Limits` bounds the body, the number of inputs and the tokens of each.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

Tokenizer = Callable[[str], list[str]]
CHARS_PER_TOKEN = 64  # a text longer than this many characters per allowed token is refused untokenized
# (the tokenizer's time grows with the characters: a text that surely has too many tokens is not tokenized)
OFF_LOOP_BYTES = 1 << 16  # a body past this is parsed and tokenized in a worker thread (`read_inputs_async`)


class BadRequest(Exception):
    """A request the server refuses: `status` (4xx) and a message for the client."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code  # OpenAI's error code where it has one ("model_not_found"); else the status, as a string


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (the `elmo serve` flags of the same names)."""

    max_body_bytes: int = 2_000_000
    max_inputs: int = 256
    max_input_tokens: int = 512
    max_batch_tokens: int = 16_384
    max_queue_tokens: int = 131_072  # max_inputs x max_input_tokens: the largest request the others admit fits
    max_wait_ms: float = 2.0
    body_timeout_s: float = 20.0  # to receive a whole body (408 past it): a client that dribbles it holds nothing

    @property
    def max_input_chars(self) -> int:
        """Characters a raw text may have (`CHARS_PER_TOKEN` a token of --max-input-tokens); token
        lists are bounded by --max-body-bytes (the character CNN reads a token's first 50 only)."""
        return CHARS_PER_TOKEN * self.max_input_tokens

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_inputs", "max_input_tokens", "max_batch_tokens", "max_queue_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_wait_ms <= 60_000:
            raise ValueError(f"--max-wait-ms must be between 0 and 60000, got {self.max_wait_ms}")
        if not 0 < self.body_timeout_s <= 3600:
            raise ValueError(f"--body-timeout must be more than 0 and at most 3600 seconds, got {self.body_timeout_s}")
        if self.max_queue_tokens < self.max_input_tokens:
            raise ValueError(f"--max-queue-tokens ({self.max_queue_tokens}) must be at least --max-input-tokens "
                             f"({self.max_input_tokens}): else one text could never be queued")


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def parse_json(body: bytes) -> dict:
    """The body as a JSON object; BadRequest(400) for anything else (bad UTF-8, bad JSON, NaN,
    nesting too deep, a lone surrogate, an array or a number)."""
    if not body.strip():
        raise BadRequest(400, "the request body is empty: send a JSON object such as {\"input\": \"Hello world\"}")
    try:
        value = json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest(400, "the request body is nested too deeply") from None
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRequest(400, f"the request body is not valid JSON: {str(error)[:200]}") from None
    if not isinstance(value, dict):
        raise BadRequest(400, f"the request body must be a JSON object, got a JSON {_json_type(value)}")
    try:  # "\ud800" is valid JSON but no text: a lone surrogate cannot be tokenized, echoed or logged
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        raise BadRequest(400, f"the request body holds a lone surrogate {error.object[error.start:error.end]!r}: "
                              f"not valid Unicode text") from None
    return value


def _json_type(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


async def parse_json_async(body: bytes) -> dict:
    """`parse_json`, in a worker thread for a body past `OFF_LOOP_BYTES` (see `read_inputs_async`)."""
    return await asyncio.to_thread(parse_json, body) if len(body) > OFF_LOOP_BYTES else parse_json(body)


async def read_inputs_async(body: dict, field: str, limits: Limits, tokenize: Tokenizer, body_bytes: int,
                            allow_tokens: bool = True, others: int = 0) -> list[list[str]]:
    """`read_inputs`, in a worker thread where the body had more than `OFF_LOOP_BYTES` bytes:
    the tokenizer reads about a megabyte of text a second, and on the event loop a large body
    would hold every other request, /health's included, until its texts were tokenized."""
    if body_bytes > OFF_LOOP_BYTES:
        return await asyncio.to_thread(read_inputs, body, field, limits, tokenize, allow_tokens, others)
    return read_inputs(body, field, limits, tokenize, allow_tokens, others)


def read_inputs(body: dict, field: str, limits: Limits, tokenize: Tokenizer,
                allow_tokens: bool = True, others: int = 0) -> list[list[str]]:
    """body[field] as token lists: a string, a list of strings (raw text, tokenized), or with
    `allow_tokens` a list of token lists. BadRequest(422) for a wrong type, an empty input or text, too many
    inputs (`others`: the request's inputs outside `field`, within the same --max-inputs) or too many tokens."""
    if field not in body:
        raise BadRequest(422, f"missing field {field!r}: give a string or a list of strings")
    value = body[field]
    single = isinstance(value, str)
    items = [value] if single else value
    what = "a string, a list of strings" + (" or a list of token lists" if allow_tokens else "")
    if not isinstance(items, list):
        raise BadRequest(422, f"{field!r} must be {what}, got a JSON {_json_type(value)}")
    if not items:
        raise BadRequest(422, f"{field!r} is an empty list: give at least one input")
    if len(items) + others > limits.max_inputs:
        besides = f" and {others} other{'s' if others > 1 else ''} in the request" if others else ""
        raise BadRequest(422, f"{field!r} has {len(items)} inputs{besides}, more than the limit of "
                              f"{limits.max_inputs} (--max-inputs): split the request")
    sentences = []
    for index, item in enumerate(items):
        name = repr(field) if single else f"{field}[{index}]"
        if isinstance(item, str):
            if len(item) > limits.max_input_chars:  # surely over the token limit: spare the tokenizer
                raise BadRequest(422, f"{name} has {len(item)} characters, more than the limit of "
                                      f"{limits.max_input_chars} characters of a text ({CHARS_PER_TOKEN} a token of "
                                      f"--max-input-tokens {limits.max_input_tokens}): split the text")
            tokens = tokenize(item)
        elif allow_tokens and isinstance(item, list):
            tokens = _token_list(item, name)
        else:
            raise BadRequest(422, f"{name} must be a string{' or a list of token strings' if allow_tokens else ''}, "
                                  f"got a JSON {_json_type(item)}")
        if not tokens:
            raise BadRequest(422, f"{name} is empty: it has no tokens")
        if len(tokens) > limits.max_input_tokens:
            raise BadRequest(422, f"{name} has {len(tokens)} tokens, more than the limit of {limits.max_input_tokens} "
                                  f"(--max-input-tokens): split the text")
        sentences.append(tokens)
    return sentences


def _token_list(item: list, name: str) -> list[str]:
    for position, token in enumerate(item):
        if not isinstance(token, str):
            raise BadRequest(422, f"{name}[{position}] must be a token string, got a JSON {_json_type(token)}")
        if not token or token != token.strip() or len(token.split()) != 1:
            raise BadRequest(422, f"{name}[{position}] must be one token (non-empty, no whitespace), got {token!r:.60}")
    return list(item)


def read_layers(body: dict, n_layers: int) -> tuple[str, int | list[float] | None]:
    """body["layers"]: "all" (default), a layer index 0..L, or {"weights": [w_0, ..., w_L]} (a
    weighted sum of the layers). Returns ("all", None), ("one", k) or ("mix", weights)."""
    value = body.get("layers", "all")
    if value == "all":
        return "all", None
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < n_layers:
            raise BadRequest(422, f"'layers' {json.dumps(value)[:60]} does not exist: the model has layers 0 to "
                                  f"{n_layers - 1}")
        return "one", value
    if isinstance(value, dict) and set(value) == {"weights"}:
        weights = value["weights"]
        if (not isinstance(weights, list) or len(weights) != n_layers
                or not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)):
            raise BadRequest(422, f"'layers' {{\"weights\": ...}} must be a list of {n_layers} numbers, one per layer")
        try:  # an integer past float's range (a JSON 1 with 400 zeros) is no float: OverflowError
            floats = [float(w) for w in weights]
        except OverflowError:
            floats = [math.inf]
        if not all(map(math.isfinite, floats)):
            raise BadRequest(422, "'layers' weights must be finite numbers, within float's range (about 1.8e308)")
        return "mix", floats
    raise BadRequest(422, f"'layers' must be \"all\", a layer index 0 to {n_layers - 1} or "
                          f"{{\"weights\": [{n_layers} numbers]}}, got {json.dumps(value)[:60]}")


def read_choice(body: dict, field: str, choices: tuple[str, ...]) -> str:
    """body[field], one of `choices` (the first when absent)."""
    value = body.get(field, choices[0])
    if value not in choices:
        raise BadRequest(422, f"{field!r} must be one of {', '.join(map(json.dumps, choices))}, "
                              f"got {json.dumps(value)[:60]}")
    return value


def read_bool(body: dict, field: str, default: bool) -> bool:
    value = body.get(field, default)
    if not isinstance(value, bool):
        raise BadRequest(422, f"{field!r} must be true or false, got {json.dumps(value)[:60]}")
    return value
