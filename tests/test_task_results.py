"""scripts/task_results.py reuses a finished run only when the recipe and the biLM's weights are
the ones it would use now (the built-in model keeps its path when a new version replaces it), and
puts the runs that finish out of order (several jobs) back in seed order."""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import asdict
from pathlib import Path

import torch

from elmokit.model.weights import model_fingerprint
from elmokit.tasks.train import TaskConfig, TaskData, train_task
from tests.test_tasks import quick_config, synthetic_sentiment

REPO = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("task_results", REPO / "scripts" / "task_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_finished_runs_are_reused_only_with_the_same_biLM_weights(tiny_model, tmp_path, capsys):
    script = _script()
    config = quick_config("sst2", tmp_path, use_elmo=True, max_epochs=1, patience=1)
    splits = {"train": synthetic_sentiment(40, 0), "dev": synthetic_sentiment(20, 1), "test": synthetic_sentiment(20, 2)}
    trained = train_task(config, tiny_model, TaskData(config, splits, tiny_model))
    args = argparse.Namespace(fresh=False)
    same = model_fingerprint(tiny_model)[:16]

    reused = script.finished_run(Path(config.out), config, args, same)
    assert reused is not None and reused["reused"] and reused["test"] == trained["test"]

    with torch.no_grad():
        retrained = type(tiny_model)(tiny_model.config)
        retrained.load_state_dict(tiny_model.state_dict())
        next(retrained.parameters()).add_(1e-3)  # one weight changed: another version at the same path
    other = model_fingerprint(retrained)[:16]
    assert other != same
    assert script.finished_run(Path(config.out), config, args, other) is None
    assert "trained with another biLM" in capsys.readouterr().out

    changed_recipe = TaskConfig(**(asdict(config) | {"hidden_dim": config.hidden_dim + 1}))
    assert script.finished_run(Path(config.out), changed_recipe, args, same) is None
    assert script.finished_run(Path(config.out), config, argparse.Namespace(fresh=True), same) is None


def test_runs_finished_out_of_order_are_tabled_in_seed_order():
    script = _script()
    results = {("sst2", "elmo", 3): {"seed": 3}, ("sst2", "no_elmo", 1): {"seed": 1},
               ("sst2", "elmo", 1): {"seed": 1}, ("pos", "elmo", 2): {"seed": 2}}
    runs = script.new_runs(results, ["pos", "sst2"], ["elmo", "no_elmo"])
    assert [r["seed"] for r in runs["sst2"]["elmo"]] == [1, 3]
    assert [r["seed"] for r in runs["sst2"]["no_elmo"]] == [1]
    assert runs["pos"] == {"elmo": [{"seed": 2}], "no_elmo": []}
