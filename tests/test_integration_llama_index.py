"""LlamaIndex, through the real llama-index-core: `ELMoEmbedding` is a BaseEmbedding whose public
methods (batches, queries, the async forms) give the vectors `elmo serve` answers for the same texts,
in-process and from a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("llama_index.core", reason="needs llama-index-core (pip install llama-index-core)")

from llama_index.core.base.embeddings.base import BaseEmbedding  # noqa: E402

from elmokit import ElmoEmbedder, tokenize  # noqa: E402
from elmokit.integrations.llama_index import ELMoEmbedding  # noqa: E402
from tests.hostile_http import HeldUntilReleased, HostileServer, embeddings_answer, token_vector  # noqa: E402
from tests.serving import Server, save_tiny_model  # noqa: E402

TEXTS = ["I like to eat apple.", "I like apple products, don't you?", "They play football on Sundays."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def served(tiny):
    server = Server(tiny)
    status, answer, _ = server.call("POST", "/v1/embeddings", {"input": TEXTS})
    assert status == 200
    yield server, np.array([item["embedding"] for item in answer["data"]], np.float32)
    assert server.stop() == 0


def test_in_process_and_from_the_server(tiny, served):
    server, vectors = served
    local = ELMoEmbedding(model=str(tiny), embed_batch_size=2)  # two batches
    remote = ELMoEmbedding(base_url=server.url, embed_batch_size=2)  # two requests
    assert isinstance(local, BaseEmbedding) and local.model_name == str(tiny)
    for embedding in (local, remote):
        np.testing.assert_allclose(embedding.get_text_embedding_batch(TEXTS), vectors, atol=1e-6, rtol=1e-5)
        np.testing.assert_allclose(embedding.get_query_embedding(TEXTS[1]), vectors[1], atol=1e-6, rtol=1e-5)
    # independent of both: the embedder's layers of elmokit.tokenize's tokens, averaged by hand
    layers = ElmoEmbedder(options_file=str(tiny)).embed_sentence(tokenize(TEXTS[2]))  # (L+1, n, 2P)
    np.testing.assert_allclose(local.get_text_embedding(TEXTS[2]), layers.mean(axis=0).mean(axis=0), atol=1e-6)
    assert not any(local.get_text_embedding(""))  # no token: zeros


@pytest.mark.asyncio
async def test_the_async_methods(tiny, served):
    server, vectors = served
    for embedding in (ELMoEmbedding(model=str(tiny)), ELMoEmbedding(base_url=server.url)):
        np.testing.assert_allclose(await embedding.aget_text_embedding_batch(TEXTS), vectors, atol=1e-6, rtol=1e-5)
        np.testing.assert_allclose(await embedding.aget_query_embedding(TEXTS[0]), vectors[0], atol=1e-6, rtol=1e-5)


def test_the_builtin_model_by_default_and_refusals(served):
    server, _ = served
    default = ELMoEmbedding()
    assert default.model_name == "gutenberg-en" and len(default.get_query_embedding("Hello.")) == 256
    with pytest.raises(RuntimeError, match=r"answered 404: the model 'other' is not served here"):
        ELMoEmbedding(base_url=server.url, model="other").get_query_embedding("hello")
    with pytest.raises(ValueError, match="base_url must be the http"):
        ELMoEmbedding(base_url="localhost:8000")
    assert ELMoEmbedding(base_url="http://127.0.0.1:8080/v1").base_url == "http://127.0.0.1:8080"  # OpenAI's form


def test_a_list_goes_to_the_server_embed_batch_size_texts_a_request():
    texts = [f"Text number {i} here." for i in range(7)]
    with HostileServer(embeddings_answer) as served:
        vectors = ELMoEmbedding(base_url=served.url, embed_batch_size=3).get_text_embedding_batch(texts)
    sent = [request.json()["input"] for request in served.requests]
    assert [len(batch) for batch in sent] == [3, 3, 1]
    assert [tokens for batch in sent for tokens in batch] == [tokenize(text) for text in texts]
    np.testing.assert_array_equal(vectors, [token_vector(tokenize(text)) for text in texts])


@pytest.mark.asyncio
async def test_the_async_methods_run_off_the_event_loop():
    """The server answers only once a coroutine on the caller's event loop has run: an async
    method that blocked the loop would get its 503 instead of the vectors of the texts' tokens."""
    held = HeldUntilReleased()
    with HostileServer(held) as served:
        embedding = ELMoEmbedding(base_url=served.url, embed_batch_size=2)
        batch, _ = await asyncio.gather(embedding.aget_text_embedding_batch(TEXTS), held.release())
        held.rearm()
        query, _ = await asyncio.gather(embedding.aget_query_embedding(TEXTS[2]), held.release())
    assert sorted(len(request.json()["input"]) for request in served.requests) == [1, 1, 2]
    np.testing.assert_array_equal(batch, [token_vector(tokenize(text)) for text in TEXTS])
    np.testing.assert_array_equal(query, token_vector(tokenize(TEXTS[2])))
