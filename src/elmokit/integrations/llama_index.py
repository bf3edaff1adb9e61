"""LlamaIndex: `ELMoEmbedding`, a `llama_index.core` `BaseEmbedding` of ELMo sentence vectors.

    from llama_index.core import Settings
    from elmokit.integrations.llama_index import ELMoEmbedding
    Settings.embed_model = ELMoEmbedding()                          # the built-in model, in this process
    embedding = ELMoEmbedding(base_url="http://127.0.0.1:8080")     # or a running `elmo serve`
    vector = embedding.get_query_embedding("What do cats eat?")     # list of 2P floats

The same vectors as `elmokit.integrations.langchain.ELMoEmbeddings` and `elmo serve`'s
`/v1/embeddings` (the backend is `elmokit.integrations.texts.SentenceVectors`): each text's Moses
tokens (`elmokit.tokenize`), the mean over them of the equal-weight layer average; a query's vector
is a text's. `embed_batch_size` texts go through the biLM (or to the server) at once; the async
methods run the same calls in a worker thread.

Needs the llama-index extra (`pip install 'elmokit[llama-index]'`: llama-index-core, sacremoses).
"""

from __future__ import annotations

import asyncio

from elmokit.extras import MissingExtraError

try:
    from llama_index.core.base.embeddings.base import BaseEmbedding
except ImportError as error:
    raise MissingExtraError("elmokit.integrations.llama_index needs llama-index-core: pip install llama-index-core",
                            name="llama_index") from error

from pydantic import Field, PrivateAttr, field_validator  # noqa: E402

from elmokit.integrations.texts import SentenceVectors, api_key_from_environment, check_base_url, check_texts  # noqa: E402
from elmokit.model.builtin import BUILTIN_MODEL  # noqa: E402

__all__ = ["ELMoEmbedding"]


class ELMoEmbedding(BaseEmbedding):
    """ELMo sentence vectors for LlamaIndex, computed here or by a running `elmo serve`.

    Args:
        model: in-process, anything `elmokit.load_model` takes (None: the built-in model); with
            `base_url`, the model name sent to the server (None: whatever it serves).
        base_url: the address of a running `elmo serve` ("http://host:port"); None embeds here.
        api_key: the server's key (default: $ELMOKIT_API_KEY).
        device: in-process, where the biLM runs ("cpu", "cuda", "auto"; default: the CPU).
        lang: the Moses language of `elmokit.tokenize` (in-process).
        embed_batch_size: texts a batch in-process, and a request to the server (64).
        timeout: seconds a request to the server may take.
        threads: in-process, torch's CPU threads (default: from the CPUs this process may use and
            the other work on them, `elmokit.devices.use_threads`).
    """

    model: str | None = None
    base_url: str | None = None
    api_key: str | None = Field(default_factory=api_key_from_environment, repr=False)
    device: str | None = None
    lang: str = "en"
    timeout: float = Field(default=60.0, gt=0)
    embed_batch_size: int = Field(default=64, gt=0, le=2048)
    threads: int | None = Field(default=None, ge=1)
    _vectors: SentenceVectors | None = PrivateAttr(default=None)

    def __init__(self, **data):
        data.setdefault("model_name", data.get("model") or BUILTIN_MODEL)
        super().__init__(**data)

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, value: str | None) -> str | None:
        return check_base_url(value)

    @classmethod
    def class_name(cls) -> str:
        return "ELMoEmbedding"

    def _embed(self, texts: list[str]) -> list[list[float]]:
        texts = check_texts(texts, "ELMoEmbedding")
        if self._vectors is None:
            self._vectors = SentenceVectors(self.model, self.base_url, self.api_key, self.device, self.lang,
                                            self.embed_batch_size, self.timeout, self.threads)
        return self._vectors(list(texts)).tolist() if texts else []

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embed([query])[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embed([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embed(texts)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return (await asyncio.to_thread(self._embed, [query]))[0]

    async def _aget_text_embedding(self, text: str) -> list[float]:
        return (await asyncio.to_thread(self._embed, [text]))[0]

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return await asyncio.to_thread(self._embed, texts)
