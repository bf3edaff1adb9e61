"""elmokit.integrations.flair.ELMoEmbeddings through the real Flair: the vectors of each mode equal
ElmoEmbedder's, the class stacks with Flair's own embeddings, runs on CUDA as on the CPU, and a
SequenceTagger trains on a slice of CoNLL-2003, saves (the biLM by reference) and loads in a fresh
process."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

pytest.importorskip("flair", reason="the flair extra: pip install 'elmokit[flair]'")

import flair  # noqa: E402
from flair.data import Dictionary, Sentence  # noqa: E402
from flair.embeddings import OneHotEmbeddings, StackedEmbeddings  # noqa: E402
from flair.models import SequenceTagger  # noqa: E402

from tests.conftest import DATA, require_shared  # noqa: E402
from elmokit import ElmoEmbedder  # noqa: E402
from elmokit.integrations.flair import ELMoEmbeddings  # noqa: E402

TEXTS = ["The cat sat on the mat .", "Colorless green ideas", "naïve café 東京 !", "a"]


def sentences() -> list[Sentence]:
    return [Sentence(text.split()) for text in TEXTS]  # pre-split: Flair's tokens are exactly these


def expected_vectors(layers: np.ndarray, mode: str) -> np.ndarray:
    """(L+1, n, D) -> (n, E), written out independently of the class under test."""
    if mode == "all":
        return np.stack([np.concatenate([layers[k, i] for k in range(layers.shape[0])])
                         for i in range(layers.shape[1])])
    return layers[-1] if mode == "top" else layers.mean(axis=0)


@pytest.fixture
def cpu_device():
    previous = flair.device
    flair.device = torch.device("cpu")
    yield
    flair.device = previous


@pytest.mark.parametrize("mode", ["all", "top", "average"])
def test_token_vectors_equal_the_embedders(model_dir, tiny_model, mode, cpu_device):
    embeddings = ELMoEmbeddings(str(model_dir), embedding_mode=mode)
    n_layers = tiny_model.config.n_output_layers
    assert embeddings.embedding_length == (n_layers if mode == "all" else 1) * tiny_model.output_dim
    batch = sentences()
    embeddings.embed(batch)
    reference = ElmoEmbedder(str(model_dir))
    for sentence in batch:  # each sentence alone: the batch does not change its vectors (stateless)
        layers = reference.embed_sentence([token.text for token in sentence])
        got = torch.stack([token.get_embedding() for token in sentence]).numpy()
        assert got.shape == (len(sentence), embeddings.embedding_length)
        np.testing.assert_allclose(got, expected_vectors(layers, mode), rtol=1e-5, atol=1e-6)


def test_flairs_names_and_arguments(model_dir, monkeypatch):
    embeddings = ELMoEmbeddings(str(model_dir), embedding_mode="top")
    assert embeddings.name == f"elmo-{model_dir}-top" and embeddings.static_embeddings
    monkeypatch.chdir(model_dir.parent)
    assert ELMoEmbeddings(model_dir.name).model == str(model_dir.resolve())  # a saved tagger loads from anywhere
    with pytest.raises(ValueError, match="embedding_mode must be one of all, top, average, got 'mean'"):
        ELMoEmbeddings(str(model_dir), embedding_mode="mean")
    with pytest.raises(ValueError, match="options_file and weight_file go together"):
        ELMoEmbeddings(options_file=str(model_dir / "config.json"))
    with pytest.raises(FileNotFoundError, match="model not found"):
        ELMoEmbeddings("no/such/model")


def test_the_built_in_model_is_the_default(cpu_device):
    embeddings = ELMoEmbeddings(embedding_mode="average")
    assert embeddings.model == "gutenberg-en" and embeddings.embedding_length == ElmoEmbedder().output_dim
    none = ELMoEmbeddings(None, embedding_mode="average")  # None is the default too, not a model named "None"
    assert none.model == "gutenberg-en" and none.name == "elmo-gutenberg-en-average"


def test_stacks_with_flairs_own_embeddings(model_dir, cpu_device):
    vocabulary = Dictionary()
    for word in " ".join(TEXTS).split():
        vocabulary.add_item(word)
    torch.manual_seed(0)
    one_hot = OneHotEmbeddings(vocabulary, embedding_length=5)
    elmo = ELMoEmbeddings(str(model_dir))
    stacked = StackedEmbeddings([one_hot, elmo])
    assert stacked.embedding_length == 5 + elmo.embedding_length
    batch = sentences()
    stacked.embed(batch)
    alone = sentences()
    ELMoEmbeddings(str(model_dir)).embed(alone)
    for sentence, single in zip(batch, alone):
        for token, other in zip(sentence, single):
            vector = token.get_embedding()
            assert vector.shape == (stacked.embedding_length,)
            torch.testing.assert_close(vector[5:], other.get_embedding(), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_gives_the_cpus_vectors(model_dir):
    previous = flair.device
    try:
        flair.device = torch.device("cpu")
        on_cpu = sentences()
        embeddings = ELMoEmbeddings(str(model_dir))
        embeddings.embed(on_cpu)
        flair.device = torch.device("cuda:0")
        on_gpu = sentences()
        embeddings.embed(on_gpu)  # the same object follows flair.device
        for sentence, reference in zip(on_gpu, on_cpu):
            vectors = torch.stack([token.get_embedding() for token in sentence])
            assert vectors.device.type == "cuda"
            torch.testing.assert_close(vectors.cpu(), torch.stack([t.get_embedding() for t in reference]),
                                       rtol=1e-4, atol=1e-5)
    finally:
        flair.device = previous


def test_pickling_keeps_the_reference_not_the_weights(model_dir, cpu_device):
    embeddings = ELMoEmbeddings(str(model_dir), embedding_mode="average")
    data = pickle.dumps(embeddings)
    weights = (model_dir / "model.safetensors").stat().st_size
    assert len(data) < weights / 2, (len(data), weights)
    copy = pickle.loads(data)
    first, second = sentences(), sentences()
    embeddings.embed(first)
    copy.embed(second)
    torch.testing.assert_close(first[0][2].get_embedding(), second[0][2].get_embedding())


def tagger_with(embeddings) -> SequenceTagger:
    tags = Dictionary(add_unk=False)
    for tag in ("O", "S-PER", "B-PER", "E-PER", "I-PER", "S-LOC", "B-LOC", "E-LOC", "I-LOC"):
        tags.add_item(tag)
    torch.manual_seed(0)
    return SequenceTagger(hidden_size=8, embeddings=embeddings, tag_dictionary=tags, tag_type="ner", use_crf=True)


def test_a_saved_tagger_references_the_model_and_loads_in_a_fresh_process(model_dir, tmp_path, cpu_device):
    tagger = tagger_with(ELMoEmbeddings(str(model_dir), embedding_mode="all"))
    saved = tmp_path / "tagger.pt"
    tagger.save(saved)
    state = torch.load(saved, weights_only=False)
    assert not any("bilm" in key or "_embedder" in key for key in state["state_dict"]), list(state["state_dict"])
    assert state["embeddings"]["model"] == str(model_dir.resolve())  # by reference: a path, no weights
    texts = [TEXTS[0], TEXTS[2]]
    batch = [Sentence(text.split()) for text in texts]
    tagger.predict(batch, return_probabilities_for_all_classes=True)
    expected = [[token.get_label("ner").value for token in sentence] for sentence in batch]
    expected_scores = [[token.get_label("ner").score for token in sentence] for sentence in batch]
    script = textwrap.dedent(f"""
        import json, sys
        from flair.data import Sentence
        from flair.models import SequenceTagger
        assert "elmokit.integrations.flair" not in sys.modules
        tagger = SequenceTagger.load({str(saved)!r})  # the saved params import elmokit's class
        batch = [Sentence(text.split()) for text in {texts!r}]
        tagger.predict(batch, return_probabilities_for_all_classes=True)
        print(json.dumps([[[t.get_label("ner").value, t.get_label("ner").score] for t in s] for s in batch]))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert [[tag for tag, _ in sentence] for sentence in loaded] == expected
    np.testing.assert_allclose([score for sentence in loaded for _, score in sentence],
                               [score for sentence in expected_scores for score in sentence], rtol=1e-4)


def read_conll(path, limit: int) -> list[Sentence]:
    """The first `limit` sentences of a CoNLL-2003 file, IOB1 tags as spans (written here, not by Flair)."""
    sentences_, words, tags = [], [], []
    for line in path.read_text(encoding="utf-8").splitlines() + [""]:
        if line.strip() and not line.startswith("-DOCSTART-"):
            word, *_, tag = line.split()
            words.append(word)
            tags.append(tag)
        elif words:
            sentence = Sentence(words)
            start = None
            for i, tag in enumerate(tags + ["O"]):
                begins = tag.startswith("B-") or (tag.startswith("I-") and (i == 0 or tags[i - 1][2:] != tag[2:]))
                if start is not None and (tag == "O" or begins):
                    sentence[start:i].add_label("ner", tags[start][2:])
                    start = None
                if begins:
                    start = i
            sentences_.append(sentence)
            words, tags = [], []
            if len(sentences_) == limit:
                break
    return sentences_


def test_a_tagger_trains_an_epoch_on_conll2003(model_dir, tmp_path, cpu_device):
    from flair.data import Corpus
    from flair.trainers import ModelTrainer

    data = require_shared(DATA / "conll2003")
    corpus = Corpus(read_conll(data / "eng.train", 200), read_conll(data / "eng.testa", 20),
                    read_conll(data / "eng.testb", 20), sample_missing_splits=False)
    assert any(sentence.get_spans("ner") for sentence in corpus.train)
    tags = corpus.make_label_dictionary("ner", add_unk=False)
    elmo = ELMoEmbeddings(str(model_dir), embedding_mode="all")
    torch.manual_seed(0)
    tagger = SequenceTagger(hidden_size=16, embeddings=elmo, tag_dictionary=tags, tag_type="ner", use_crf=True)
    before = {name: value.clone() for name, value in tagger.state_dict().items()}
    result = ModelTrainer(tagger, corpus).train(tmp_path, max_epochs=1, mini_batch_size=8, learning_rate=0.5,
                                                create_file_logs=False, embeddings_storage_mode="none")
    assert any(not torch.equal(before[name], value) for name, value in tagger.state_dict().items())
    loaded = SequenceTagger.load(tmp_path / "final-model.pt")
    assert isinstance(loaded.embeddings, ELMoEmbeddings)
    for name, value in tagger.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, msg=name)
    # Flair's test score is the span F1 of the saved tagger's predictions, as seqeval scores them
    from seqeval.metrics import f1_score

    loaded.predict(corpus.test, label_name="predicted", mini_batch_size=16)
    gold = [bio_tags(sentence, "ner") for sentence in corpus.test]
    predicted = [bio_tags(sentence, "predicted") for sentence in corpus.test]
    assert any(any(tag != "O" for tag in tags) for tags in gold)
    score = f1_score(gold, predicted)
    assert score > 0 and result["test_score"] == pytest.approx(score, abs=1e-4), (result["test_score"], score)


def bio_tags(sentence, label_type: str) -> list[str]:
    """A sentence's spans of `label_type` as BIO tags (seqeval's input)."""
    tags = ["O"] * len(sentence)
    for span in sentence.get_spans(label_type):
        positions = [token.idx - 1 for token in span.tokens]
        tags[positions[0]] = f"B-{span.get_label(label_type).value}"
        for position in positions[1:]:
            tags[position] = f"I-{span.get_label(label_type).value}"
    return tags
