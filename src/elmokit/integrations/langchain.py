"""LangChain: `ELMoEmbeddings`, a `langchain_core.embeddings.Embeddings` of ELMo sentence vectors.

    from elmokit.integrations.langchain import ELMoEmbeddings
    embeddings = ELMoEmbeddings()                                   # the built-in model, in this process
    embeddings = ELMoEmbeddings(model="original", device="cuda")    # any model elmokit loads
    embeddings = ELMoEmbeddings(base_url="http://127.0.0.1:8000")   # a running `elmo serve`
    vector = embeddings.embed_query("What do cats eat?")            # list of 2P floats
    vectors = embeddings.embed_documents(["Cats eat fish.", "Dogs bark."])

Each text's vector is the one `elmo serve` answers on `/v1/embeddings` for it: the text is
Moses-tokenized (`elmokit.tokenize`), and its vector is the mean over the tokens of the
equal-weight average of the biLM's layers (`ElmoEmbedder.sentence_vectors`, defined once in
`elmokit.inference.layers`); zeros for a text without tokens. In-process, the model is loaded on
first use; with `base_url` nothing is loaded here: the texts go to the server (`batch_size` a
request, float32 sent as base64, so the numbers arrive bit for bit), with `api_key` (default: the
ELMOKIT_API_KEY variable `elmo serve` itself reads) as a bearer token. `aembed_documents` and
`aembed_query` are LangChain's, which run these in a worker thread (ElmoEmbedder is thread-safe).

Needs langchain-core (the `langchain` extra).
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.request
from typing import Any

import numpy as np

from elmokit.extras import require

require("langchain", "elmokit.integrations.langchain")

from langchain_core.embeddings import Embeddings  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, field_validator  # noqa: E402

from elmokit.inference.embedder import ElmoEmbedder  # noqa: E402
from elmokit.tokenizer import tokenize  # noqa: E402

__all__ = ["ELMoEmbeddings"]

API_KEY_VARIABLE = "ELMOKIT_API_KEY"  # the variable `elmo serve` reads its key from


def _api_key_from_environment() -> SecretStr | None:
    key = os.environ.get(API_KEY_VARIABLE)
    return SecretStr(key) if key else None


class ELMoEmbeddings(BaseModel, Embeddings):
    """ELMo sentence vectors for LangChain, computed here or by a running `elmo serve`.

    Args:
        model: in-process, anything `elmokit.load_model` takes (None: the built-in model); with
            `base_url`, the model name sent to the server (None: whatever it serves).
        base_url: the address of a running `elmo serve` ("http://host:port"); None embeds here.
        api_key: the server's key (default: $ELMOKIT_API_KEY).
        device: in-process, where the biLM runs ("cpu", "cuda", "auto"; default: the CPU).
        lang: the Moses language of `elmokit.tokenize` (in-process; the server tokenizes as it was started).
        batch_size: texts a batch in-process, and a request to the server.
        timeout: seconds a request to the server may take.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None
    base_url: str | None = None
    api_key: SecretStr | None = Field(default_factory=_api_key_from_environment)
    device: str | None = None
    lang: str = "en"
    batch_size: int = Field(default=64, ge=1)
    timeout: float = Field(default=60.0, gt=0)
    _embedder: ElmoEmbedder | None = PrivateAttr(default=None)

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be the http(s) address of an `elmo serve`, got {value!r}")
        return None if value is None else value.rstrip("/")

    # -----------------------------------------------------------------------------------------
    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """One vector (2P floats) per text, in order."""
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"ELMoEmbeddings embeds texts: texts[{i}] is a {type(text).__name__}")
        if not texts:
            return []
        vectors = self._served(texts) if self.base_url is not None else self._computed(texts)  # (N, 2P)
        return vectors.tolist()

    def embed_query(self, text: str) -> list[float]:
        """The vector of one text (the same as a document's: ELMo has no query form)."""
        return self.embed_documents([text])[0]

    # -----------------------------------------------------------------------------------------
    def _computed(self, texts: list[str]) -> np.ndarray:
        """(N, 2P) float32 in this process."""
        if self._embedder is None:
            self._embedder = ElmoEmbedder(options_file=self.model, device=self.device)
        sentences = [tokenize(text, self.lang) for text in texts]
        return self._embedder.sentence_vectors(sentences, batch_size=self.batch_size)

    def _served(self, texts: list[str]) -> np.ndarray:
        """(N, 2P) float32 from the server's /v1/embeddings, `batch_size` texts a request."""
        parts = [self._request(texts[start:start + self.batch_size]) for start in range(0, len(texts), self.batch_size)]
        return np.concatenate(parts)

    def _request(self, texts: list[str]) -> np.ndarray:
        body: dict[str, Any] = {"input": texts, "encoding_format": "base64"}
        if self.model is not None:
            body["model"] = self.model
        headers = {"Content-Type": "application/json"}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key.get_secret_value()}"
        url = f"{self.base_url}/v1/embeddings"
        request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"{url} answered {error.code}: {_error_message(error)}") from None
        except urllib.error.URLError as error:
            raise ConnectionError(f"cannot reach elmo serve at {self.base_url}: {error.reason}") from None
        items = sorted(answer["data"], key=lambda item: item["index"])
        return np.stack([np.frombuffer(base64.b64decode(item["embedding"]), "<f4") for item in items])


def _error_message(error: urllib.error.HTTPError) -> str:
    """The server's own message (OpenAI's {"error": {"message": ...}}), else the body as text."""
    text = error.read().decode("utf-8", "replace")
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:500]
