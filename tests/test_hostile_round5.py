"""Hostile round 5: bad input to the surfaces landed together (elmokit.tokenize, the LangChain and
LlamaIndex classes in-process and against `elmo serve`), each test the check of one defect found."""

from __future__ import annotations

import unicodedata

import numpy as np
import pytest

pytest.importorskip("sacremoses", reason="elmokit.tokenize needs the prepare extra")

from elmokit import tokenize  # noqa: E402
from elmokit.integrations.texts import SentenceVectors, check_texts  # noqa: E402


def test_tokenize_decomposed_accents_are_the_composed_tokens():
    """NFD text ("e" + U+0301) gave "cafe" and a lone accent as tokens, so other vectors than "café"."""
    composed = "café naïve Ångström"
    decomposed = unicodedata.normalize("NFD", composed)
    assert decomposed != composed
    assert tokenize(decomposed) == tokenize(composed) == ["café", "naïve", "Ångström"]


def test_prepare_tokenizes_decomposed_accents_as_tokenize(monkeypatch):
    """`elmo prepare` (training.corpus) writes the tokens elmokit.tokenize gives for the same text."""
    pytest.importorskip("sentencex")
    from elmokit.training import corpus

    monkeypatch.setattr(corpus, "_worker_lang", "en")
    monkeypatch.setattr(corpus, "_worker_moses", None)
    text = unicodedata.normalize("NFD", "Der Käse ist café.")
    assert corpus.tokenize_paragraphs([text]) == [" ".join(tokenize(text))]


def test_a_lone_string_is_not_a_list_of_texts():
    """embed_documents("hello") embedded each character in-process (5 vectors), one text when served."""
    with pytest.raises(TypeError, match="list of texts, got one str"):
        check_texts("hello", "ELMoEmbeddings")
    with pytest.raises(TypeError, match=r"texts\[1\] is a NoneType"):
        check_texts(iter(["a", None]), "ELMoEmbeddings")
    assert check_texts(("a", "b"), "ELMoEmbeddings") == ["a", "b"]


def test_langchain_refuses_a_lone_string():
    pytest.importorskip("langchain_core")
    from elmokit.integrations.langchain import ELMoEmbeddings

    with pytest.raises(TypeError, match="ELMoEmbeddings embeds a list of texts, got one str"):
        ELMoEmbeddings(base_url="http://127.0.0.1:1").embed_documents("hello")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.serving import Server, save_tiny_model

    model = save_tiny_model(tmp_path_factory.mktemp("hostile5"))
    server = Server(model, api_key="k5")
    yield model, server
    assert server.stop() == 0


def test_blank_texts_are_zeros_served_as_in_process(served):
    """elmo serve refuses a blank input (422): through base_url a document list holding one failed
    whole, where in-process (and the docs) give zeros for it."""
    model, server = served
    texts = ["Cats eat fish.", "", "   \t", "Dogs bark, don't they?"]
    here = SentenceVectors(str(model))(texts)
    there = SentenceVectors(base_url=server.url, api_key="k5", batch_size=1)(texts)
    assert here.shape == there.shape == (4, 12)
    assert not here[[1, 2]].any() and (np.abs(here[[0, 3]]).sum(axis=1) > 0).all()  # both texts with words
    np.testing.assert_allclose(there, here, atol=1e-6)
    only_blank = SentenceVectors(base_url=server.url, api_key="k5")(["", " "])
    assert only_blank.shape == (2, 12) and not only_blank.any()


def test_sentence_transformers_folder_refuses_a_lang_that_is_not_a_code(tmp_path, tiny_model):
    """save_sentence_transformers(lang=5) wrote a folder whose every encode() then failed."""
    pytest.importorskip("sentence_transformers")
    from elmokit.integrations.sentence_transformers import ELMoSentenceEncoder, save_sentence_transformers

    for lang in (5, "", None):
        with pytest.raises(TypeError, match="lang must be a Moses language code"):
            save_sentence_transformers(tiny_model, tmp_path / "st", lang=lang)
        with pytest.raises(TypeError, match="lang must be a Moses language code"):
            ELMoSentenceEncoder(tiny_model, lang=lang)
    assert not (tmp_path / "st").exists()
