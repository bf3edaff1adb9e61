"""Raw texts -> the sentence vectors `elmo serve` answers, computed in this process or asked of a
running server: the one backend of the LangChain and LlamaIndex classes (no third-party import).

In-process: each text's Moses tokens (`elmokit.tokenize`), then `ElmoEmbedder.sentence_vectors`
(the mean over the tokens of the equal-weight layer average, `elmokit.inference.layers`), the
model loaded on first use. With `base_url`: the same tokens, POST /v1/embeddings of a running
`elmo serve` as token lists, `batch_size` texts a request, float32 as base64 (no decimal rounding
on the way), the key as a bearer token; the server's refusals raise with its message, naming the
caller's `texts[i]`. Either way a text without tokens (blank, or control characters only) gives
zeros.
"""

from __future__ import annotations

import base64
import json
import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from elmokit.inference.embedder import ElmoEmbedder
from elmokit.tokenizer import tokenize

API_KEY_VARIABLE = "ELMOKIT_API_KEY"  # the variable `elmo serve` reads its own key from


def api_key_from_environment() -> str | None:
    """$ELMOKIT_API_KEY, or None when unset or empty."""
    return os.environ.get(API_KEY_VARIABLE) or None


def check_base_url(base_url: str | None) -> str | None:
    """The address of an `elmo serve` without its trailing slash; ValueError unless http(s)."""
    if base_url is not None and not (isinstance(base_url, str) and base_url.startswith(("http://", "https://"))):
        raise ValueError(f"base_url must be the http(s) address of an `elmo serve`, got {base_url!r}")
    return None if base_url is None else base_url.rstrip("/")


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
    _embedder: ElmoEmbedder | None = field(default=None, repr=False)

    def __call__(self, texts: list[str]) -> np.ndarray:
        """(N, 2P) float32, one row per text in order; (0, 0) for no text."""
        if not texts:
            return np.zeros((0, 0), np.float32)
        sentences = [tokenize(text, self.lang) for text in texts]
        if self.base_url is not None:
            return self._served(sentences)
        if self._embedder is None:
            self._embedder = ElmoEmbedder(options_file=self.model, device=self.device)
        return self._embedder.sentence_vectors(sentences, batch_size=self.batch_size)

    def _served(self, sentences: list[list[str]]) -> np.ndarray:
        """The server's vectors for the texts with tokens, zeros (as in-process) for those without,
        which `elmo serve` refuses (422); the width from GET /info when no text has a token."""
        sent = [i for i, tokens in enumerate(sentences) if tokens]
        parts = [self._request(sentences, sent[start:start + self.batch_size])
                 for start in range(0, len(sent), self.batch_size)]
        dim = parts[0].shape[1] if parts else int(self._get("/info")["shape"]["dim"])
        vectors = np.zeros((len(sentences), dim), np.float32)
        if parts:
            vectors[sent] = np.concatenate(parts)
        return vectors

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _get(self, path: str) -> dict:
        return self._open(urllib.request.Request(f"{self.base_url}{path}", headers=self._headers()))

    def _open(self, request: urllib.request.Request) -> dict:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"{request.full_url} answered {error.code}: {_error_message(error)}") from None
        except urllib.error.URLError as error:
            raise ConnectionError(f"cannot reach elmo serve at {self.base_url}: {error.reason}") from None

    def _request(self, sentences: list[list[str]], indices: list[int]) -> np.ndarray:
        """The vectors of sentences[i] for i in `indices`, one request; a refusal's `input[k]`
        (the request's k-th) is named as the caller's `texts[indices[k]]`."""
        body: dict[str, Any] = {"input": [sentences[i] for i in indices], "encoding_format": "base64"}
        if self.model is not None:
            body["model"] = self.model
        request = urllib.request.Request(f"{self.base_url}/v1/embeddings", data=json.dumps(body).encode(),
                                         headers=self._headers(), method="POST")
        try:
            answer = self._open(request)
        except RuntimeError as error:
            raise RuntimeError(re.sub(r"\binput\[(\d+)\]", lambda match: f"texts[{indices[int(match[1])]}]",
                                      str(error))) from None
        items = sorted(answer["data"], key=lambda item: item["index"])
        return np.stack([np.frombuffer(base64.b64decode(item["embedding"]), "<f4") for item in items])


def _error_message(error: urllib.error.HTTPError) -> str:
    """The server's own message (OpenAI's {"error": {"message": ...}}), else the body as text."""
    text = error.read().decode("utf-8", "replace")
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:500]
