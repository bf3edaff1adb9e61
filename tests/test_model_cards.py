"""Model cards (issue 31): every task run and every native model directory elmokit writes holds a
README.md made from its own records (scores, training data, the biLM, the elmokit and torch
versions, the command), and records the elmokit version beside its config."""

from __future__ import annotations

import json
import shlex

import pytest
import torch

import elmokit
import elmokit.tasks
from elmokit import save_pretrained
from elmokit.cli import main
from elmokit.training.checkpoint import save_model_dir
from elmokit.training.lm import LanguageModel
from tests.conftest import tiny_config
from tests.test_task_api import TINY_KEYWORDS
from tests.test_task_cli import write_columns
from tests.test_tasks import synthetic_entities


def test_a_task_run_has_a_card_made_from_its_results(tmp_path, tiny_model):
    save_pretrained(tiny_model, tmp_path / "bilm")
    files = {split: write_columns(tmp_path / f"{split}.conll", synthetic_entities(n, seed))
             for split, n, seed in (("train", 60, 0), ("dev", 20, 1), ("test", 20, 2))}
    run = elmokit.tasks.train(task="ner", train=files["train"], dev=files["dev"], test=files["test"],
                              out=tmp_path / "run", model=tmp_path / "bilm",
                              **TINY_KEYWORDS)
    card = (tmp_path / "run" / "README.md").read_text(encoding="utf-8")
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    for split in ("dev", "test"):  # the scores as results.json holds them
        scores = results[split]
        assert f"| {split} | {scores['f1']:.2f} | {scores['precision']:.2f} | {scores['recall']:.2f} |" in card
    for entity, scores in results["test"]["per_type"].items():
        assert f"| {entity} | {scores['precision']:.2f} |" in card
    assert f"| train | `{files['train']}` | 60 |" in card
    saved = json.loads((tmp_path / "run" / "task_config.json").read_text())
    assert saved["bilm"]["fingerprint"] in card and "fingerprint" in card
    assert f"elmokit {elmokit.__version__}, torch {torch.__version__}" in card
    assert saved["elmokit_version"] == elmokit.__version__
    assert "## Intended use and limits" in card and "`B-PER`" in card
    command = card.split("```\nelmo task train", 1)[1].split("\n```", 1)[0]
    words = shlex.split("elmo task train" + command)
    assert words[words.index("--train") + 1] == str(files["train"]) and words[words.index("--max-epochs") + 1] == "4"
    assert repr(run).startswith("TaskRun(ner tagger, 4 labels, ELMo ")


@pytest.fixture
def language_model_dir(tmp_path):
    torch.manual_seed(0)
    words = ["<S>", "</S>", "<UNK>", "the", "cat", "sat"]
    (tmp_path / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    model = LanguageModel(tiny_config(), len(words))
    provenance = {"trained_by": "elmo train", "train_files": ["corpus/*.txt"], "vocab": "vocab.txt", "steps": 120,
                  "tokens": 45678, "epochs": 2, "valid_files": ["valid.txt"], "valid_ppl": 123.456,
                  "valid_forward_ppl": 120.5, "valid_backward_ppl": 126.25}
    save_model_dir(model, tmp_path / "trained", tmp_path / "vocab.txt", provenance)
    return tmp_path / "trained", model


def test_an_exported_model_directory_has_a_card(tmp_path, language_model_dir, capsys):
    source, model = language_model_dir
    out = tmp_path / "exported"
    assert main(["export", str(source), "--native", str(out), "--no-softmax"]) == 0
    assert "model card README.md" in capsys.readouterr().out
    card = (out / "README.md").read_text(encoding="utf-8")
    n_parameters = model.bilm.n_parameters  # the published count: the char table's padding row left out
    assert n_parameters == sum(p.numel() for p in model.bilm.parameters()) - model.bilm.config.char_cnn.embedding_dim
    assert card.startswith(f"# ELMo biLM ({n_parameters:,} parameters)")
    assert "45,678 training tokens in 120 steps (2 epochs)" in card and "`corpus/*.txt`" in card
    assert "| validation | 120.50 | 126.25 | 123.46 |" in card  # provenance.json's perplexities
    assert f"```\nelmo export {source} --native {out} --no-softmax\n```" in card
    assert f"elmokit {elmokit.__version__}, torch {torch.__version__}" in card
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["elmokit_version"] == elmokit.__version__ and provenance["tokens"] == 45678
    assert "## Intended use and limits" in card and "no softmax: for embedding" in card
    # a card in the way is an output like the others: replaced only with --overwrite
    other = tmp_path / "other"
    other.mkdir()
    (other / "README.md").write_text("mine\n")
    assert main(["export", str(source), "--native", str(other)]) == 2
    assert "README.md" in capsys.readouterr().err and (other / "README.md").read_text() == "mine\n"


def test_a_model_without_a_training_record_says_so(tmp_path, language_model_dir):
    _, model = language_model_dir
    save_model_dir(model, tmp_path / "bare", tmp_path / "vocab.txt")
    card = (tmp_path / "bare" / "README.md").read_text(encoding="utf-8")
    assert "Not recorded" in card and "No perplexity recorded" in card
    assert json.loads((tmp_path / "bare" / "provenance.json").read_text())["elmokit_version"] == elmokit.__version__
