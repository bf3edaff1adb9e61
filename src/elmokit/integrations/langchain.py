"""LangChain: `ELMoEmbeddings`, a `langchain_core.embeddings.Embeddings` of ELMo sentence vectors.

    from elmokit.integrations.langchain import ELMoEmbeddings
    embeddings = ELMoEmbeddings()                                   # the built-in model, in this process
    embeddings = ELMoEmbeddings(model="original", device="cuda")    # any model elmokit loads
    embeddings = ELMoEmbeddings(base_url="http://127.0.0.1:8080")   # a running `elmo serve`
    vector = embeddings.embed_query("What do cats eat?")            # list of 2P floats
    vectors = embeddings.embed_documents(["Cats eat fish.", "Dogs bark."])

Each text's vector is the one `elmo serve` answers on `/v1/embeddings` for it: the text is
Moses-tokenized (`elmokit.tokenize`), and its vector is the mean over the tokens of the
equal-weight average of the biLM's layers (`ElmoEmbedder.sentence_vectors`, defined once in
`elmokit.inference.layers`); zeros for a text without tokens. In-process, the model is loaded on
first use; with `base_url` nothing is loaded here: the texts go to the server, with `api_key`
(default: the ELMOKIT_API_KEY variable `elmo serve` itself reads) as a bearer token
(`elmokit.integrations.texts`, shared with the LlamaIndex class). `aembed_documents` and
`aembed_query` are LangChain's, which run these in a worker thread (ElmoEmbedder is thread-safe).

Needs langchain-core (the `langchain` extra).
"""

from __future__ import annotations

from elmokit.extras import require

require("langchain", "elmokit.integrations.langchain", ("langchain_core",))  # sacremoses: when texts are tokenized

from langchain_core.embeddings import Embeddings  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, field_validator  # noqa: E402

from elmokit.integrations.texts import SentenceVectors, api_key_from_environment, check_base_url, check_texts  # noqa: E402

__all__ = ["ELMoEmbeddings"]


def _api_key_from_environment() -> SecretStr | None:
    key = api_key_from_environment()
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
        threads: in-process, torch's CPU threads (default: from the CPUs this process may use and
            the other work on them, `elmokit.devices.use_threads`).
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None
    base_url: str | None = None
    api_key: SecretStr | None = Field(default_factory=_api_key_from_environment)
    device: str | None = None
    lang: str = "en"
    batch_size: int = Field(default=64, ge=1)
    timeout: float = Field(default=60.0, gt=0)
    threads: int | None = Field(default=None, ge=1)
    _vectors: SentenceVectors | None = PrivateAttr(default=None)

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, value: str | None) -> str | None:
        return check_base_url(value)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """One vector (2P floats) per text, in order."""
        texts = check_texts(texts, "ELMoEmbeddings")
        if self._vectors is None:
            key = None if self.api_key is None else self.api_key.get_secret_value()
            self._vectors = SentenceVectors(self.model, self.base_url, key, self.device, self.lang,
                                            self.batch_size, self.timeout, self.threads)
        return self._vectors(texts).tolist() if texts else []

    def embed_query(self, text: str) -> list[float]:
        """The vector of one text (the same as a document's: ELMo has no query form)."""
        return self.embed_documents([text])[0]
