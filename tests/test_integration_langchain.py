"""LangChain, through the real packages: `ELMoEmbeddings` passes langchain_tests' standard
EmbeddingsUnitTests (and its EmbeddingsIntegrationTests, run here against the built-in model and a
real `elmo serve` on 127.0.0.1), and gives the vectors `elmo serve` answers for the same texts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("langchain_core", reason="needs the langchain extra")
pytest.importorskip("langchain_tests", reason="LangChain's standard tests come with the test extra")

from langchain_core.embeddings import Embeddings  # noqa: E402
from langchain_tests.integration_tests import EmbeddingsIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import EmbeddingsUnitTests  # noqa: E402

from elmokit import ElmoEmbedder, tokenize  # noqa: E402
from elmokit.integrations.langchain import ELMoEmbeddings  # noqa: E402
from tests.hostile_http import HeldUntilReleased, HostileServer, embeddings_answer, token_vector  # noqa: E402
from tests.serving import Server, save_tiny_model  # noqa: E402


def async_tests(cls: type) -> type:
    """The standard tests' async pair runs under pytest-asyncio (strict mode: marked tests only); the
    class-wide mark also reaches their sync tests, where it does nothing but warn."""
    return pytest.mark.asyncio(pytest.mark.filterwarnings("ignore:The test <Function test_:pytest.PytestWarning")(cls))


TEXTS = ["I like to eat apple.", "I like apple products, don't you?", "They play football on Sundays."]
KEY = "langchain-test-key"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("langchain"))


@pytest.fixture(scope="module")
def server(tiny):
    served = Server(tiny, api_key=KEY)
    yield served
    assert served.stop() == 0


class TestELMoEmbeddingsStandard(EmbeddingsUnitTests):
    """LangChain's unit tests: construction from parameters and from the environment."""

    @property
    def embeddings_class(self) -> type[ELMoEmbeddings]:
        return ELMoEmbeddings

    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        return {"ELMOKIT_API_KEY": "from-the-environment"}, {"base_url": "http://127.0.0.1:1"}, {
            "api_key": "from-the-environment"}


@async_tests
class TestELMoEmbeddingsInProcess(EmbeddingsIntegrationTests):
    """LangChain's embedding tests (the sync and async pairs) on the built-in model, in this process."""

    @property
    def embeddings_class(self) -> type[ELMoEmbeddings]:
        return ELMoEmbeddings


@async_tests
class TestELMoEmbeddingsServed(EmbeddingsIntegrationTests):
    """The same tests, the vectors coming from a real `elmo serve` (with an API key)."""

    @property
    def embeddings_class(self) -> type[ELMoEmbeddings]:
        return ELMoEmbeddings

    @pytest.fixture
    def model(self, server) -> Embeddings:
        return ELMoEmbeddings(base_url=server.url, api_key=KEY)


def test_the_served_vectors_in_process_and_through_the_server(tiny, server):
    status, answer, _ = server.call("POST", "/v1/embeddings", {"input": TEXTS})  # the server, asked directly
    assert status == 200
    served = np.array([item["embedding"] for item in answer["data"]], np.float32)
    local = ELMoEmbeddings(model=str(tiny), batch_size=2)
    remote = ELMoEmbeddings(base_url=server.url + "/", api_key=KEY, batch_size=2)  # two requests
    np.testing.assert_allclose(local.embed_documents(TEXTS), served, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(remote.embed_documents(TEXTS), served, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(local.embed_query(TEXTS[1]), served[1], atol=1e-6, rtol=1e-5)
    # independent of both: the embedder's layers of elmokit.tokenize's tokens, averaged by hand
    layers = ElmoEmbedder(options_file=str(tiny)).embed_sentence(tokenize(TEXTS[1]))  # (L+1, n, 2P)
    np.testing.assert_allclose(local.embed_query(TEXTS[1]), layers.mean(axis=0).mean(axis=0), atol=1e-6)
    assert local.embed_documents([]) == [] and not any(local.embed_query(""))


@pytest.mark.asyncio
async def test_the_async_pair_runs_off_the_event_loop():
    """The server answers only once a coroutine on the caller's event loop has run: an async
    method that blocked the loop (the call made in its thread) would get the server's 503 instead
    of the vectors, which must be the sync methods' and those of the texts' own tokens."""
    held = HeldUntilReleased()
    with HostileServer(held) as served:
        embeddings = ELMoEmbeddings(base_url=served.url, batch_size=2)
        documents, _ = await asyncio.gather(embeddings.aembed_documents(TEXTS), held.release())
        held.rearm()
        query, _ = await asyncio.gather(embeddings.aembed_query(TEXTS[2]), held.release())
        assert documents == embeddings.embed_documents(TEXTS) and query == embeddings.embed_query(TEXTS[2])
    np.testing.assert_array_equal(documents, [token_vector(tokenize(text)) for text in TEXTS])
    np.testing.assert_array_equal(query, token_vector(tokenize(TEXTS[2])))


def test_a_list_goes_to_the_server_batch_size_texts_a_request():
    """7 texts with tokens and 2 without, batch_size 3: requests of 3, 3 and 1 texts, in order;
    the texts without tokens are not sent and get zeros."""
    texts = [f"Text number {i} here." for i in range(7)]
    texts[2:2], texts[6:6] = [""], ["\x07"]
    with HostileServer(embeddings_answer) as served:
        vectors = ELMoEmbeddings(base_url=served.url + "/v1", batch_size=3).embed_documents(texts)
    sent = [request.json()["input"] for request in served.requests]
    assert [len(batch) for batch in sent] == [3, 3, 1] and {r.path for r in served.requests} == {"/v1/embeddings"}
    assert [tokens for batch in sent for tokens in batch] == [tokenize(text) for text in texts if text.strip("\x07")]
    np.testing.assert_array_equal(vectors, [token_vector(tokenize(text)) for text in texts])


def test_texts_without_tokens_are_zeros_through_the_server_too(tiny, server):
    """Control characters only: no Moses token, so zeros, in process and served alike (the server
    refuses a text without tokens; the client sends only those with tokens)."""
    texts = ["ok text", "\x00", "\x07\x08", "   "]
    local = np.array(ELMoEmbeddings(model=str(tiny)).embed_documents(texts))
    remote = np.array(ELMoEmbeddings(base_url=server.url, api_key=KEY).embed_documents(texts))
    assert local[0].any() and not local[1:].any()
    np.testing.assert_allclose(remote, local, atol=1e-6, rtol=1e-5)


def test_a_refusal_names_the_callers_text(server):
    """The server's `input[k]` counts within one request of the texts with tokens; the error names
    the caller's own index."""
    texts = ["One.", "", "Two.", "Three.", "word " * 600]
    with pytest.raises(RuntimeError, match=r"texts\[4\] has 600 tokens"):
        ELMoEmbeddings(base_url=server.url, api_key=KEY, batch_size=2).embed_documents(texts)


def test_what_the_server_refuses_is_said(tiny, server):
    with pytest.raises(RuntimeError, match="answered 401"):
        ELMoEmbeddings(base_url=server.url, api_key="wrong-key").embed_query("hello")
    with pytest.raises(RuntimeError, match=r"answered 404: the model 'other' is not served here"):
        ELMoEmbeddings(base_url=server.url, api_key=KEY, model="other").embed_query("hello")
    with pytest.raises(ConnectionError, match="cannot reach elmo serve at http://127.0.0.1:1"):
        ELMoEmbeddings(base_url="http://127.0.0.1:1").embed_query("hello")
    with pytest.raises(ValueError, match="base_url must be the http"):
        ELMoEmbeddings(base_url="127.0.0.1:8000")
    assert ELMoEmbeddings(base_url="http://127.0.0.1:8080/v1/").base_url == "http://127.0.0.1:8080"  # OpenAI's form
    with pytest.raises(TypeError, match=r"texts\[1\] is a int"):
        ELMoEmbeddings(model=str(tiny)).embed_documents(["fine", 3])
