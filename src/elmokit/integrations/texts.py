"""Raw texts -> the sentence vectors `elmo serve` answers, computed in this process or asked of a
running server: the one backend of the LangChain and LlamaIndex classes (no third-party import).

In-process: each text's Moses tokens (`elmokit.tokenize`), then `ElmoEmbedder.sentence_vectors`
(the mean over the tokens of the equal-weight layer average, `elmokit.inference.layers`), the
model loaded on first use. With `base_url`: the same tokens, POST /v1/embeddings of a running
`elmo serve` as token lists, `batch_size` texts a request, float32 as base64 (no decimal rounding
on the way), the key as a bearer token; the server's refusals raise with its message, naming the
caller's `texts[i]`. Either way a text without tokens (blank, or control characters only) gives
zeros, and no text at all (0, 2P).

The server is not trusted: each exchange ends within `timeout` seconds in all, reads at most what
its answer can need (`answer_max_bytes`), follows redirects only to http(s) and sends the key only
to the origin it was given for (`elmokit.integrations.bounded_http`); an answer must hold one
finite vector of one width (at most MAX_WIDTH) per text sent, each `index` once.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from elmokit.inference.embedder import ElmoEmbedder
from elmokit.integrations.bounded_http import exchange
from elmokit.tokenizer import tokenize

API_KEY_VARIABLE = "ELMOKIT_API_KEY"  # the variable `elmo serve` reads its own key from
MAX_WIDTH = 1 << 16  # the widest vector believed of a server (ELMo's published models give at most 1,024)
INFO_MAX_BYTES = 1 << 20  # the most bytes read of a GET /info answer


def api_key_from_environment() -> str | None:
    """$ELMOKIT_API_KEY, or None when unset or empty."""
    return os.environ.get(API_KEY_VARIABLE) or None


def check_base_url(base_url: str | None) -> str | None:
    """The address of an `elmo serve` without its trailing slash, nor a trailing `/v1` (the form
    OpenAI clients take: the paths asked here, /v1/embeddings, carry it); ValueError unless http(s)."""
    if base_url is not None and not (isinstance(base_url, str) and base_url.startswith(("http://", "https://"))):
        raise ValueError(f"base_url must be the http(s) address of an `elmo serve`, got {base_url!r}")
    return None if base_url is None else base_url.rstrip("/").removesuffix("/v1").rstrip("/")


def check_texts(texts: list[str], who: str) -> list[str]:
    """`texts` as a list, each a str; TypeError naming the first that is not, or a lone str/bytes
    given for the list (which would otherwise be embedded a character at a time)."""
    if isinstance(texts, (str, bytes)):
        raise TypeError(f"{who} embeds a list of texts, got one {type(texts).__name__} "
                        f"(embed_query takes one text; embed_documents a list)")
    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{who} embeds texts: texts[{i}] is a {type(text).__name__}")
    return texts


@dataclass
class SentenceVectors:
    """Texts -> (N, 2P) float32 sentence vectors, here (`model`, `device`, `lang`) or from the
    `elmo serve` at `base_url` (`model` then the name sent, None: whatever it serves)."""

    model: str | None = None
    base_url: str | None = None
    api_key: str | None = None
    device: str | None = None
    lang: str = "en"
    batch_size: int = 64
    timeout: float = 60.0
    threads: int | None = None  # in-process: torch's CPU threads (None: elmokit.devices.use_threads's default)
    _embedder: ElmoEmbedder | None = field(default=None, repr=False)

    def __call__(self, texts: list[str]) -> np.ndarray:
        """(N, 2P) float32, one row per text in order; (0, 2P) for no text (the width of the
        model loaded here, or of the server's /info)."""
        sentences = [tokenize(text, self.lang) for text in texts]
        if self.base_url is not None:
            return self._served(sentences)
        if self._embedder is None:
            self._embedder = ElmoEmbedder(options_file=self.model, device=self.device, threads=self.threads)
        return self._embedder.sentence_vectors(sentences, batch_size=self.batch_size)

    def _served(self, sentences: list[list[str]]) -> np.ndarray:
        """The server's vectors for the texts with tokens, zeros (as in-process) for those without,
        which `elmo serve` refuses (422); the width from GET /info when no text has a token. Every
        request's vectors must have the first one's width (RuntimeError)."""
        sent = [i for i, tokens in enumerate(sentences) if tokens]
        parts = [self._request(sentences, sent[start:start + self.batch_size])
                 for start in range(0, len(sent), self.batch_size)]
        dim = parts[0].shape[1] if parts else self._width()
        if any(part.shape[1] != dim for part in parts):
            raise RuntimeError(f"{self.base_url} answered vectors of widths {sorted({p.shape[1] for p in parts})} "
                               f"to the requests of one call: expected one width")
        vectors = np.zeros((len(sentences), dim), np.float32)
        if parts:
            vectors[sent] = np.concatenate(parts)
        return vectors

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _ask(self, path: str, body: dict | None = None, max_bytes: int = INFO_MAX_BYTES) -> tuple[str, Any]:
        """(the address that answered, its JSON) for GET `path`, or POST of `body`: one exchange
        bounded by `timeout` in all and by `max_bytes` (`bounded_http.exchange`)."""
        data = None if body is None else json.dumps(body).encode()
        try:
            answer = exchange("GET" if body is None else "POST", f"{self.base_url}{path}", data, self._headers(),
                              timeout=self.timeout, max_bytes=max_bytes)
        except TimeoutError:
            raise TimeoutError(f"elmo serve at {self.base_url} gave no whole answer to {path} within "
                               f"timeout={self.timeout} s") from None
        except (OSError, http.client.HTTPException) as error:
            raise ConnectionError(f"cannot reach elmo serve at {self.base_url}: {error}") from None
        if answer.status != 200:
            raise RuntimeError(f"{answer.url} answered {answer.status}: {_error_message(answer.body)}")
        try:
            return answer.url, json.loads(answer.body)
        except ValueError:
            raise RuntimeError(f"{answer.url} answered 200 with a body that is not JSON: {answer.body[:200]!r}") from None

    def _width(self) -> int:
        """The width of the served vectors, from GET /info (1 to MAX_WIDTH)."""
        url, info = self._ask("/info")
        try:
            return check_width(info["shape"]["dim"], f"{url}'s shape.dim")
        except (KeyError, TypeError):
            raise RuntimeError(f"{url} answered no shape.dim: not the /info of an `elmo serve`") from None

    def _request(self, sentences: list[list[str]], indices: list[int]) -> np.ndarray:
        """The vectors of sentences[i] for i in `indices`, one request; a refusal's `input[k]`
        (the request's k-th) is named as the caller's `texts[indices[k]]`."""
        body: dict[str, Any] = {"input": [sentences[i] for i in indices], "encoding_format": "base64"}
        if self.model is not None:
            body["model"] = self.model
        try:
            url, answer = self._ask("/v1/embeddings", body, answer_max_bytes(len(indices)))
        except RuntimeError as error:
            raise type(error)(re.sub(r"\binput\[(\d+)\]", lambda match: f"texts[{indices[int(match[1])]}]",
                                     str(error))) from None
        return _answered_vectors(answer, url, indices)


def check_width(width: Any, what: str) -> int:
    """`width` if it is an int from 1 to MAX_WIDTH; RuntimeError naming `what` otherwise (a server's
    width sizes the arrays made here)."""
    if type(width) is not int or not 0 < width <= MAX_WIDTH:
        raise RuntimeError(f"{what} is {width!r}: expected a vector width from 1 to {MAX_WIDTH:,}")
    return width


def answer_max_bytes(n_texts: int) -> int:
    """The most bytes an `/v1/embeddings` answer for `n_texts` texts may take: that many base64
    vectors of MAX_WIDTH float32 each, and room for the JSON around them."""
    return (1 << 16) + n_texts * (MAX_WIDTH * 4 * 4 // 3 + 1024)


def _answered_vectors(answer: Any, url: str, indices: list[int]) -> np.ndarray:
    """(n, W) float32: the vectors of an `/v1/embeddings` answer to n texts, in request order,
    checked: a list of n items whose `index` is each of 0..n-1 once, each vector base64 float32 of
    one width (1 to MAX_WIDTH), finite. RuntimeError naming the caller's `texts[i]` otherwise."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
        raise RuntimeError(f"{url} answered no list of embeddings (\"data\")")
    if len(data) != len(indices):
        raise RuntimeError(f"{url} answered {len(data)} vectors for {len(indices)} texts")
    order = [item.get("index") for item in data]
    if any(type(k) is not int for k in order) or sorted(order) != list(range(len(indices))):
        raise RuntimeError(f"{url} answered the indices {order[:20]}: expected each of 0 to {len(indices) - 1} once")
    rows = [np.empty(0, np.float32)] * len(indices)
    for item in data:
        rows[item["index"]] = _decoded(item.get("embedding"), f"{url}'s vector for texts[{indices[item['index']]}]")
    if len({len(row) for row in rows}) != 1:
        raise RuntimeError(f"{url} answered vectors of widths {sorted({len(row) for row in rows})}: expected one width")
    return np.stack(rows)


def _decoded(embedding: Any, what: str) -> np.ndarray:
    """A base64 little-endian float32 vector as a float32 array; RuntimeError naming `what` unless
    it decodes to 1 to MAX_WIDTH finite numbers."""
    try:
        raw = base64.b64decode(embedding, validate=True)
    except (TypeError, ValueError):
        raise RuntimeError(f"{what} is not base64") from None
    if len(raw) % 4:
        raise RuntimeError(f"{what} has {len(raw)} bytes: not float32 numbers (4 bytes each)")
    vector = np.frombuffer(raw, "<f4").astype(np.float32)
    check_width(len(vector), f"{what}'s width")
    if not np.isfinite(vector).all():
        raise RuntimeError(f"{what} holds NaN or infinity")
    return vector


def _error_message(body: bytes) -> str:
    """The server's own message (OpenAI's {"error": {"message": ...}}), else the body as text."""
    text = body.decode("utf-8", "replace")
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:500]
