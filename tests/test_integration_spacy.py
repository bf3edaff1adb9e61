"""The `elmo` pipe through the real spaCy: found by the entry point right after installation, its
`doc._.elmo` equal to ElmoEmbedder's for spaCy's tokens, the vectors, similarities and `doc.tensor`
(read by spaCy's own Tok2VecListener), batching through `nlp.pipe`, and `to_disk` / `spacy.load`."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

spacy = pytest.importorskip("spacy", reason="the spacy extra: pip install 'elmokit[spacy]'")

from elmokit import ElmoEmbedder  # noqa: E402
from elmokit.inference.layers import sentence_vector  # noqa: E402

TEXTS = ["The cat sat on the mat.", "Colorless green  ideas sleep furiously!", "naïve café in 東京", "", "a"]


@pytest.fixture
def nlp_with(model_dir):
    def build(**config):
        nlp = spacy.blank("en")
        nlp.add_pipe("elmo", config={"model": str(model_dir), **config})
        return nlp
    return build


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_doc_elmo_is_the_embedders_layers_of_spacys_tokens(nlp_with, model_dir, tiny_model):
    nlp = nlp_with()
    reference = ElmoEmbedder(str(model_dir))
    for text in TEXTS:
        doc = nlp(text)
        words = [token.text for token in doc if not token.is_space]
        assert doc._.elmo.shape == (tiny_model.config.n_output_layers, len(doc), tiny_model.output_dim)
        kept = [token.i for token in doc if not token.is_space]
        np.testing.assert_allclose(doc._.elmo[:, kept], reference.embed_sentence(words), rtol=1e-5, atol=1e-6)
    doc = nlp(TEXTS[1])  # "Colorless green  ideas ...": spaCy makes the extra space a token; the biLM never reads it
    assert doc[2].text == " " and not doc._.elmo[:, 2].any() and not doc[2].has_vector and not doc[2].vector.any()
    assert doc[1].has_vector and doc[3].has_vector
    words = np.array([not token.is_space for token in doc])
    np.testing.assert_allclose(doc.vector, doc.tensor[words].mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(doc[1:4].vector, doc.tensor[[1, 3]].mean(axis=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layers", ["average", "top", 0, 2])
def test_vectors_similarity_and_tensor(nlp_with, layers):
    nlp = nlp_with(layers=layers)
    doc, other = nlp(TEXTS[0]), nlp(TEXTS[1])
    elmo = doc._.elmo.astype(np.float64)  # (L+1, n, 2P)
    expected = {"average": elmo.mean(axis=0), "top": elmo[-1]}.get(layers) if isinstance(layers, str) else elmo[layers]
    for token in doc:
        np.testing.assert_allclose(token.vector, expected[token.i], rtol=1e-5, atol=1e-6)
        assert token.has_vector and token.vector_norm == pytest.approx(np.linalg.norm(expected[token.i]), rel=1e-5)
    np.testing.assert_allclose(doc.tensor, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(doc.vector, expected.mean(axis=0), rtol=1e-5, atol=1e-6)
    if layers == "average":  # elmo embed --sentence-vectors' vector of the same tokens
        np.testing.assert_allclose(doc.vector, sentence_vector(doc._.elmo), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(doc[1:4].vector, expected[1:4].mean(axis=0), rtol=1e-5, atol=1e-6)
    assert doc[1:4].vector_norm == pytest.approx(np.linalg.norm(expected[1:4].mean(axis=0)), rel=1e-5)  # a number
    assert doc.vector_norm == pytest.approx(np.linalg.norm(expected.mean(axis=0)), rel=1e-5)
    assert doc.similarity(other) == pytest.approx(cosine(doc.vector, other.vector), rel=1e-5)
    assert doc[1:4].similarity(other[0:2]) == pytest.approx(cosine(expected[1:4].mean(0), other[0:2].vector), rel=1e-5)
    assert doc[1].similarity(other[3]) == pytest.approx(cosine(expected[1], other[3].vector), rel=1e-5)
    assert doc.similarity(doc) == pytest.approx(1.0, rel=1e-6)


def test_the_built_in_model_is_the_default():
    nlp = spacy.blank("en")
    pipe = nlp.add_pipe("elmo")
    assert nlp.config["components"]["elmo"]["model"] == "gutenberg-en"
    np.testing.assert_allclose(nlp("Hello world")._.elmo, ElmoEmbedder().embed_sentence(["Hello", "world"]),
                               rtol=1e-5, atol=1e-6)
    assert pipe.vectors.layers == "average"


def test_an_empty_doc(nlp_with):
    nlp = nlp_with()
    empty, full = nlp(""), nlp("a b")
    assert empty._.elmo.shape[1] == 0 and empty.tensor.shape == (0, full.tensor.shape[1])
    assert not empty.vector.any() and empty.similarity(full) == 0.0
    blank = nlp("   \n\n  ")  # whitespace only: spaCy's tokens, but no word
    assert len(blank) > 0 and not blank._.elmo.any() and not blank.vector.any() and blank.similarity(full) == 0.0
    assert not empty.has_vector and not blank.has_vector and not blank[0:2].has_vector
    assert full.has_vector and full[0:1].has_vector
    paragraphs = nlp("a b\n\nc")  # a paragraph break between two words leaves the words' vectors as without it
    np.testing.assert_allclose(paragraphs._.elmo[:, [0, 1, 3]], nlp("a b c")._.elmo, rtol=1e-5, atol=1e-6)


def test_spacys_tok2vec_listener_reads_doc_tensor(nlp_with):
    from spacy.pipeline.tok2vec import Tok2VecListener

    nlp = nlp_with(layers="top")
    docs = list(nlp.pipe(TEXTS[:2]))
    listener = Tok2VecListener(upstream_name="elmo", width=docs[0].tensor.shape[1])
    for output, doc in zip(listener.predict(docs), docs):  # what a tagger or parser listening to "elmo" gets
        np.testing.assert_array_equal(output, doc._.elmo[-1])


def test_nlp_pipe_batches_and_gives_each_docs_own_vectors(nlp_with):
    nlp = nlp_with(batch_size=3)
    pipe = nlp.get_pipe("elmo")
    sizes = []
    embed_many = pipe.embedder.embed_many
    pipe.embedder.embed_many = lambda texts, rows: sizes.append(len(texts)) or embed_many(texts, rows)
    docs = list(nlp.pipe(TEXTS, batch_size=2))
    assert sizes == [2, 2, 1]
    sizes.clear()
    assert len(list(pipe.pipe(nlp.make_doc(text) for text in TEXTS))) == len(TEXTS)
    assert sizes == [3, 2]  # called without a batch size, the pipe's own
    for doc, text in zip(docs, TEXTS):
        alone = nlp(text)
        np.testing.assert_allclose(doc._.elmo, alone._.elmo, rtol=1e-5, atol=1e-6)


def test_a_pickled_doc_keeps_its_vectors(nlp_with):
    doc = nlp_with(layers="top")(TEXTS[0])
    copy = pickle.loads(pickle.dumps(doc))
    np.testing.assert_array_equal(copy.vector, doc.vector)
    np.testing.assert_array_equal(copy[2].vector, doc._.elmo[-1, 2])


def test_bad_config_says_what_is_expected(model_dir):
    nlp = spacy.blank("en")
    with pytest.raises(ValueError, match=r"layers must be 'average', 'top' or a layer index 0..2 .* got 'mean'"):
        nlp.add_pipe("elmo", config={"model": str(model_dir), "layers": "mean"})
    with pytest.raises(ValueError, match="layer index 0..2 .* got 3"):
        nlp.add_pipe("elmo", config={"model": str(model_dir), "layers": 3})
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        nlp.add_pipe("elmo", config={"model": str(model_dir), "batch_size": 0})
    with pytest.raises(FileNotFoundError, match="model not found"):
        nlp.add_pipe("elmo", config={"model": "no/such/model"})


def test_a_folder_given_relative_is_refused_as_spacy_would_save_it(model_dir, monkeypatch):
    """spaCy writes the config as given: a relative folder would load from whatever folder spacy.load
    runs in, so it is refused with its absolute form; the absolute one is taken and saved as such."""
    monkeypatch.chdir(model_dir.parent)
    nlp = spacy.blank("en")
    absolute = re.escape(str(model_dir.resolve()))
    with pytest.raises(ValueError, match=rf"model '{model_dir.name}' is a path relative .* give it absolute, "
                                         rf"'{absolute}' \(a pipeline saved .* spacy.load\(PATH, config=.*'{absolute}'"):
        nlp.add_pipe("elmo", config={"model": model_dir.name})
    nlp.add_pipe("elmo", config={"model": str(model_dir.resolve())})
    assert nlp.config["components"]["elmo"]["model"] == str(model_dir.resolve())


def test_the_entry_point_and_to_disk_in_a_fresh_process(model_dir, tmp_path):
    """Right after installation: no import of elmokit, add_pipe finds the factory; the saved
    pipeline holds the pipe's config (the model by reference), and spacy.load rebuilds it."""
    script = textwrap.dedent(f"""
        import json, sys
        import spacy
        nlp = spacy.blank("en")
        nlp.add_pipe("elmo", config={{"model": {str(model_dir)!r}, "layers": 1}})
        assert "elmokit.integrations.spacy" in sys.modules  # imported by spaCy through the entry point
        doc = nlp("The cat sat.")
        nlp.to_disk({str(tmp_path / "pipeline")!r})
        loaded = spacy.load({str(tmp_path / "pipeline")!r})
        again = loaded("The cat sat.")
        print(json.dumps({{"pipes": loaded.pipe_names, "config": loaded.config["components"]["elmo"],
                          "same": bool((again._.elmo == doc._.elmo).all()), "vector": doc[1].vector.tolist()}}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["pipes"] == ["elmo"] and record["same"]
    assert record["config"] == {"factory": "elmo", "model": str(model_dir), "layers": 1, "batch_size": 64,
                                "device": None, "threads": None}  # none chosen: none recorded
    saved = {path.name for path in (tmp_path / "pipeline").iterdir()}
    assert saved == {"config.cfg", "meta.json", "tokenizer", "vocab"}, saved  # spaCy's own files, no weights
    expected = ElmoEmbedder(str(model_dir)).embed_sentence(["The", "cat", "sat", "."])[1, 1]
    np.testing.assert_allclose(record["vector"], expected, rtol=1e-5, atol=1e-6)


def test_nlp_pipe_with_two_processes_finishes_and_gives_the_same_docs(model_dir, tmp_path):
    """spaCy forks its workers from a process whose torch thread pool ran: without
    `one_thread_in_forked_children` they hang at their first product (a time limit here)."""
    script = textwrap.dedent(f"""
        import warnings
        import numpy as np
        import spacy
        import torch

        torch.set_num_threads(2)
        nlp = spacy.blank("en")
        nlp.add_pipe("elmo", config={{"model": {str(model_dir)!r}, "batch_size": 2, "threads": 2}})  # a pool of 2, loaded or not
        texts = {TEXTS!r} * 3
        alone = [nlp(text) for text in texts]  # the parent's pool has run
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # spaCy's W109: the hooks do not travel between processes
            docs = list(nlp.pipe(texts, n_process=2, batch_size=2))
        pipe = nlp.get_pipe("elmo")
        assert [doc.text for doc in docs] == texts
        for doc, one in zip(docs, alone):
            np.testing.assert_allclose(doc._.elmo, one._.elmo, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(doc.tensor, one.tensor, rtol=1e-5, atol=1e-6)
            pipe.add_hooks(doc)
            np.testing.assert_allclose(doc.vector, one.vector, rtol=1e-5, atol=1e-6)
            assert [token.has_vector for token in doc] == [token.has_vector for token in one]
        print("ok", len(docs))
    """)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True, cwd=tmp_path)
    try:
        out, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)  # spaCy's workers too
        process.communicate()
        pytest.fail("nlp.pipe(n_process=2) did not finish in 120 s: its workers hung")
    assert process.returncode == 0, err[-3000:]
    assert out.split() == ["ok", str(3 * len(TEXTS))]


def test_the_device_is_recorded_only_when_chosen(nlp_with, monkeypatch):
    """A pipe given no device records none (null in config.cfg) and runs where every elmokit command
    runs by default: ELMOKIT_DEVICE, else auto (the GPU when torch sees one), decided where it loads."""
    import elmokit.integrations.spacy as pipe_module

    asked = []
    real = pipe_module.ElmoEmbedder

    def recording(model, device=None, **kwargs):
        asked.append(device)
        return real(model, device="cpu", **kwargs)

    monkeypatch.setattr(pipe_module, "ElmoEmbedder", recording)
    monkeypatch.setenv("ELMOKIT_DEVICE", "cuda:3")
    assert nlp_with().config["components"]["elmo"]["device"] is None
    monkeypatch.delenv("ELMOKIT_DEVICE")
    nlp_with()
    chosen = nlp_with(device="cpu")
    assert chosen.config["components"]["elmo"]["device"] == "cpu"
    assert asked == ["cuda:3", "auto", "cpu"]
