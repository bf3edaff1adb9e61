"""Empty and degenerate input is an error, never a silent result: an empty or blank-only corpus
for `elmo train` or `elmo perplexity`, and a bare string where the embedder expects tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from elmokit import ElmoEmbedder
from elmokit.cli import main
from elmokit.textfiles import CorpusError
from tests.conftest import one_error_line, tiny_config

BLANK_FILES = {"empty.txt": "", "blank.txt": "\n  \n\t\n\n", "nbsp.txt": "\u00a0\n \u2009\n"}


@pytest.fixture
def corpus(tmp_path) -> dict[str, Path]:
    (tmp_path / "train.txt").write_text("the cat sat\na dog ran\n", encoding="utf-8")
    for name, text in BLANK_FILES.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert main(["vocab", str(tmp_path / "train.txt"), "-o", str(tmp_path / "vocab.txt")]) == 0
    tiny_config().save(tmp_path / "model.json")
    return {"root": tmp_path, "vocab": tmp_path / "vocab.txt", "model": tmp_path / "model.json"}


@pytest.mark.parametrize("name", sorted(BLANK_FILES))
def test_train_on_an_empty_or_blank_corpus_is_an_error(corpus, capsys, name):
    root = corpus["root"]
    run = root / "run"
    common = ["--vocab", str(corpus["vocab"]), "--model", str(corpus["model"]), "--output-dir", str(run),
              "--batch-size", "2", "--unroll-steps", "3", "--epochs", "1", "--no-progress", "--device", "cpu"]
    capsys.readouterr()
    assert main(["train", "--train", str(root / name), *common]) == 2
    one_error_line(capsys, "training corpus", name, "empty or blank")
    assert not run.exists()  # nothing written, no best/ of random weights
    assert main(["train", "--train", str(root / "train.txt"), "--valid", str(root / name), *common]) == 2
    one_error_line(capsys, "validation corpus", name)
    assert not run.exists()


@pytest.fixture
def lm_dir(corpus) -> Path:
    from elmokit.training.checkpoint import save_model_dir
    from elmokit.training.lm import LanguageModel
    from elmokit.training.vocab import Vocabulary

    torch.manual_seed(0)
    model = LanguageModel(tiny_config(), len(Vocabulary.load(corpus["vocab"])))
    return save_model_dir(model, corpus["root"] / "lm", corpus["vocab"])


@pytest.mark.parametrize("name", sorted(BLANK_FILES))
def test_perplexity_of_an_empty_or_blank_file_is_an_error(corpus, lm_dir, capsys, name):
    root = corpus["root"]
    capsys.readouterr()
    assert main(["perplexity", str(lm_dir), str(root / name)]) == 2
    one_error_line(capsys, "nothing to score", name)
    assert main(["perplexity", str(lm_dir), str(root / name), "--per-sentence", str(root / "s.tsv")]) == 2
    assert not (root / "s.tsv").exists()
    assert main(["perplexity", str(lm_dir), str(root / "train.txt"), "--json"]) == 0  # a real file scores
    result = json.loads(capsys.readouterr().out)
    assert result["n_tokens"] == 8 and result["ppl"] > 1.5


def test_corpus_perplexity_refuses_no_tokens(corpus, lm_dir):
    from elmokit.training.checkpoint import load_model_dir
    from elmokit.training.perplexity import corpus_perplexity
    from elmokit.training.vocab import Vocabulary

    model, vocab_path = load_model_dir(lm_dir)
    with pytest.raises(CorpusError, match="nothing to score"):
        corpus_perplexity(model, Vocabulary.load(vocab_path), [corpus["root"] / "blank.txt"])


def test_embedder_refuses_a_bare_string(tiny_model):
    embedder = ElmoEmbedder(module=tiny_model)
    with pytest.raises(TypeError, match=r"sentence must be a list of token strings.*split"):
        embedder.embed_sentence("the cat sat")
    with pytest.raises(TypeError, match=r"batch\[0\] must be a list of token strings"):
        embedder.embed_batch(["the", "cat"])  # one sentence given as a batch
    with pytest.raises(TypeError, match="batch must be a list of sentences"):
        embedder.embed_batch("the cat")
    with pytest.raises(TypeError, match=r"batch\[1\] must hold token strings, got int"):
        embedder.embed_batch([["a"], ["b", 3]])
    with pytest.raises(TypeError, match=r"sentences\[0\] must be a list"):
        embedder.embed_many(["the cat"])
    with pytest.raises(TypeError, match="iterable of token lists"):
        next(embedder.embed_sentences("the cat"))
    with pytest.raises(TypeError, match=r"sentences\[1\] must be a list"):
        list(embedder.embed_sentences([["fine"], "not fine"]))
    with pytest.raises(TypeError, match="batch must be a list"):
        embedder.batch_layers("abc")
    assert embedder.embed_sentence(("tuples", "are", "fine")).shape == (3, 3, 12)
    assert embedder.embed_batch([[], ["a"]])[0].shape == (3, 0, 12)
