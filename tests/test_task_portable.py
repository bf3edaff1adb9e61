"""A task run travels (issue 31): trained here, moved to another folder and another installation,
it predicts the same labels. The built-in model is recorded by name and found wherever elmokit is
installed; a model directory by a path relative to the run (and where it was); `bilm=` and
`--model` point elsewhere, and a biLM with another fingerprint is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import elmokit.tasks
from elmokit import save_pretrained
from elmokit.cli import main
from elmokit.model import builtin
from elmokit.tasks.bilm_ref import BiLMMismatchError
from tests.test_task_api import TINY_KEYWORDS
from tests.test_task_cli import write_columns
from tests.test_tasks import synthetic_entities

SENTENCES = [["mr", "smith", "sees", "new", "york"], ["the", "dog", "and", "mr", "jones"]]


@pytest.fixture
def ner_files(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    return {split: write_columns(data / f"{split}.conll", synthetic_entities(n, seed))
            for split, n, seed in (("train", 80, 0), ("dev", 20, 1))}


def install(tmp_path, name, tiny_model, monkeypatch):
    """An elmokit installation at tmp_path/name whose built-in model is the tiny one."""
    models = tmp_path / name / "models"
    save_pretrained(tiny_model, models / builtin.BUILTIN_MODEL)
    monkeypatch.setattr(builtin, "MODELS_DIR", models)
    return models / builtin.BUILTIN_MODEL


def train(out, files, **options):
    return elmokit.tasks.train(task="ner", train=files["train"], dev=files["dev"], out=out,
                               **{**TINY_KEYWORDS, "max_epochs": 2, **options})


def test_the_built_in_model_is_recorded_by_name_and_found_in_another_installation(tmp_path, tiny_model, capsys,
                                                                                    ner_files, monkeypatch):
    first = install(tmp_path, "install-1", tiny_model, monkeypatch)
    run = train(tmp_path / "here" / "run", ner_files)  # model not given: the built-in one
    expected = run.predict_labels(SENTENCES)
    saved = json.loads((tmp_path / "here" / "run" / "task_config.json").read_text())
    assert saved["bilm"] == {"name": "gutenberg-en", "fingerprint": saved["bilm"]["fingerprint"]}
    assert saved["elmokit_version"] == elmokit.__version__ and saved["torch_version"] == torch.__version__
    # the built-in model given by its path is recorded by name too
    by_path = train(tmp_path / "by-path", ner_files, model=str(first))
    assert json.loads((tmp_path / "by-path" / "task_config.json").read_text())["bilm"]["name"] == "gutenberg-en"
    del by_path

    # another machine: the run moved elsewhere, elmokit installed elsewhere, the first one gone
    moved = shutil.move(tmp_path / "here" / "run", tmp_path / "elsewhere")
    install(tmp_path, "install-2", tiny_model, monkeypatch)
    shutil.rmtree(tmp_path / "install-1")
    assert elmokit.tasks.load(moved).predict_labels(SENTENCES) == expected
    raw = tmp_path / "raw.txt"
    raw.write_text("\n".join(" ".join(s) for s in SENTENCES) + "\n", encoding="utf-8")
    assert main(["task", "predict", str(moved), str(raw), "--format", "text", "--jsonl", "--no-progress"]) == 0
    assert [json.loads(line)["labels"] for line in capsys.readouterr().out.splitlines()] == expected

    # an installation whose built-in model is another one: refused, never other vectors
    with torch.no_grad():
        next(tiny_model.parameters()).add_(0.01)
    install(tmp_path, "install-3", tiny_model, monkeypatch)
    with pytest.raises(BiLMMismatchError, match="is not the one this run was trained with"):
        elmokit.tasks.load(moved)


def test_a_model_directory_moved_with_the_run_or_given_with_bilm(tmp_path, tiny_model, ner_files, capsys):
    project = tmp_path / "project"
    save_pretrained(tiny_model, project / "bilm")
    run = train(project / "runs" / "ner", ner_files, model=str(project / "bilm"))
    expected = run.predict_labels(SENTENCES)
    record = json.loads((project / "runs" / "ner" / "task_config.json").read_text())["bilm"]
    assert record["path"] == "../../bilm" and record["absolute_path"] == str((project / "bilm").resolve())

    # the run and its biLM moved together: found by the relative path
    shutil.move(project, tmp_path / "project-moved")
    moved = tmp_path / "project-moved" / "runs" / "ner"
    assert elmokit.tasks.load(moved).predict_labels(SENTENCES) == expected

    # the run alone, the biLM copied somewhere else: an error that says how to point at it
    alone = shutil.move(moved, tmp_path / "alone")
    copy = shutil.copytree(tmp_path / "project-moved" / "bilm", tmp_path / "copy-of-bilm")
    shutil.rmtree(tmp_path / "project-moved")
    with pytest.raises(FileNotFoundError, match=r"biLM this run was trained with is missing.*bilm="):
        elmokit.tasks.load(alone)
    assert elmokit.tasks.load(alone, bilm=copy).predict_labels(SENTENCES) == expected
    assert elmokit.tasks.load(alone, bilm=tiny_model).predict_labels(SENTENCES) == expected
    raw = tmp_path / "raw.txt"
    raw.write_text("\n".join(" ".join(s) for s in SENTENCES) + "\n", encoding="utf-8")
    assert main(["task", "predict", str(alone), str(raw), "--jsonl", "--model", str(copy), "--no-progress"]) == 0
    assert [json.loads(line)["labels"] for line in capsys.readouterr().out.splitlines()] == expected
    assert main(["task", "eval", str(alone), str(ner_files["dev"]), "--model", str(copy), "--json",
                 "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["f1"] == pytest.approx(run.results["dev"]["f1"])
    assert main(["task", "predict", str(alone), str(raw), "--no-progress"]) == 2
    assert "--model" in capsys.readouterr().err

    # another model given: refused by its fingerprint
    torch.manual_seed(5)
    other = type(tiny_model)(tiny_model.config)
    with pytest.raises(BiLMMismatchError, match="fingerprint"):
        elmokit.tasks.load(alone, bilm=other)


def test_a_run_without_elmo_refuses_a_bilm_and_an_old_record_still_loads(tmp_path, tiny_model, ner_files):
    plain = train(tmp_path / "plain", ner_files, model=None)
    with pytest.raises(ValueError, match="trained without ELMo"):
        elmokit.tasks.load(tmp_path / "plain", bilm=tiny_model)
    del plain
    save_pretrained(tiny_model, tmp_path / "bilm")
    run = train(tmp_path / "run", ner_files, model=str(tmp_path / "bilm"))
    expected = run.predict_labels(SENTENCES)
    # a run written before names were recorded: the absolute path alone
    path = tmp_path / "run" / "task_config.json"
    saved = json.loads(path.read_text())
    saved["bilm"] = {"path": str((tmp_path / "bilm").resolve()), "fingerprint": saved["bilm"]["fingerprint"]}
    path.write_text(json.dumps(saved))
    old = shutil.move(tmp_path / "run", tmp_path / "old-run-moved")
    assert elmokit.tasks.load(old).predict_labels(SENTENCES) == expected
