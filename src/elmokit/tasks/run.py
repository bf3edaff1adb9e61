"""A trained task model as a tool: load a run directory, predict labels for token lists, score a file.

    run = elmokit.tasks.load("runs/ner")
    run.predict([["Peter", "Smith", "lives", "in", "Paris", "."]])  # [['B-PER', 'I-PER', 'O', 'O', 'B-LOC', 'O']]

A run directory is self-contained: task_model.safetensors (the task model's weights) and
task_config.json (its TaskConfig, word, character and label vocabularies, and which biLM it reads:
the biLM's directory and a fingerprint of its weights, checked here so that a biLM changed since
training is an error rather than silently different vectors).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from elmokit.devices import resolve_device
from elmokit.inference.elmo import module_device
from elmokit.model.bilm import BiLM
from elmokit.tasks.data import Vocabularies, gold_labels, read_split, subsample
from elmokit.model.weights import model_fingerprint
from elmokit.tasks.features import compute_layers
from elmokit.tasks.formats import read_examples, resolve_format
from elmokit.tasks.scores import score_predictions
from elmokit.tasks.task_config import SPLITS, TaskConfig
from elmokit.tasks.train import RUN_CONFIG, RUN_WEIGHTS, build_task_model
from elmokit.model.weights import WeightFileError, load_model, read_safetensors


class TaskRun:
    """A trained task model, its vocabularies and its biLM, loaded from a run directory."""

    def __init__(self, config: TaskConfig, model, vocabularies: Vocabularies, bilm: BiLM | None, run_dir: Path):
        self.config, self.model, self.vocabularies, self.bilm = config, model.eval(), vocabularies, bilm
        self.run_dir = run_dir

    @property
    def kind(self) -> str:
        """'tagger' (one label a token) or 'classifier' (one label a sentence)."""
        return self.config.spec.kind

    @property
    def labels(self) -> list[str]:
        return self.vocabularies.labels

    def predict(self, sentences: Sequence[Sequence[str]], batch_size: int | None = None,
                progress: bool = False) -> list:
        """The predicted labels of each tokenized sentence: a tag a token for a tagger (entity tags
        in BIO), one label for a classifier. Sentences are read `batch_size` at a time (default
        twice the training batch, as evaluation during training reads them); `progress` shows a
        bar while the biLM reads them."""
        _check_sentences(sentences)
        if not sentences:
            return []
        batch_size = batch_size or 2 * self.config.batch_size
        device = module_device(self.model)
        layers = None
        if self.bilm is not None and not self.config.finetune:
            layers = compute_layers(self.bilm, sentences, progress=progress, device=device,
                                    bilm_dtype=self.config.bilm_dtype)
        tagging = self.kind == "tagger"
        predicted = []
        for start in range(0, len(sentences), batch_size):
            chunk = sentences[start:start + batch_size]
            batch = self.vocabularies.batch(chunk, None, layers[start:start + batch_size] if layers is not None else None,
                                            tagging, device)
            predicted.extend(self.model.predict(batch))
        if tagging:
            return [[self.labels[i] for i in row] for row in predicted]
        return [self.labels[i] for i in predicted]

    def evaluate(self, examples: Sequence, batch_size: int | None = None, progress: bool = False) -> tuple[dict, list]:
        """(scores, predictions) of labelled examples (TaggedSentence or LabelledSentence)."""
        predicted = self.predict([e.tokens for e in examples], batch_size, progress)
        return score_predictions([gold_labels(e) for e in examples], predicted, self.config.spec.metric), predicted

    def read_file(self, path: str | Path, data_format: str = "auto", column: str | None = None) -> tuple[list, dict]:
        """The labelled examples of any file this run's task reads, and what was found in it."""
        fmt = resolve_format(path, self.kind, data_format, column or self.config.column)
        return read_examples(path, self.kind, fmt, entity_tags=self.config.entity_tags)


def _check_sentences(sentences) -> None:
    if isinstance(sentences, str) or not isinstance(sentences, Sequence):
        raise ValueError(f"predict takes a list of tokenized sentences (lists of strings), got {type(sentences).__name__}")
    for index, sentence in enumerate(sentences):
        if isinstance(sentence, str) or not sentence or not all(isinstance(t, str) and t for t in sentence):
            raise ValueError(f"sentence {index} must be a non-empty list of non-empty strings, got {sentence!r:.80}")


def load_bilm(saved: dict, config: TaskConfig, run_dir: Path) -> BiLM | None:
    """The biLM a run was trained with, checked against the fingerprint it recorded."""
    if config.model is None:
        return None
    record = saved.get("bilm") or {"path": config.model, "fingerprint": None}
    path = Path(record["path"])
    if not path.exists():
        raise FileNotFoundError(f"{run_dir}: the biLM this run was trained with is missing: {path}")
    bilm = load_model(path)
    if record["fingerprint"] is not None and model_fingerprint(bilm)[:16] != record["fingerprint"]:
        raise ValueError(f"{run_dir}: the biLM at {path} changed since this run was trained (fingerprint "
                         f"{record['fingerprint']} then, {model_fingerprint(bilm)[:16]} now): the task model would "
                         "read other vectors than it learned from; restore that biLM or train the task model again")
    return bilm


def load(run_dir: str | Path, device: str | torch.device | None = None) -> TaskRun:
    """Rebuild a trained task model from its run directory (see the module docstring), on `device`
    (default: the CPU, whatever device it was trained on)."""
    run_dir = Path(run_dir)
    for name in (RUN_CONFIG, RUN_WEIGHTS):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir}: not a task run directory (no {name})")
    saved = _read_run_config(run_dir / RUN_CONFIG)
    try:
        config = TaskConfig(**saved["config"])
    except TypeError as error:  # a key TaskConfig does not have, or lacks
        raise ValueError(f"{run_dir / RUN_CONFIG}: not a task run's config ({error})") from None
    bilm = load_bilm(saved, config, run_dir)
    vocabularies = Vocabularies(saved["vocab"], saved["labels"], saved.get("chars"))
    model = build_task_model(config, vocabularies, bilm)
    weights = read_safetensors(run_dir / RUN_WEIGHTS)  # float and finite, or an error naming the tensor
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:  # missing, unexpected or differently shaped tensors
        raise WeightFileError(f"{run_dir / RUN_WEIGHTS}: does not match {RUN_CONFIG} "
                              f"({' '.join(str(error).split())[:400]})") from None
    return TaskRun(config, model.to(resolve_device(device)), vocabularies, bilm, run_dir)


def _read_run_config(path: Path) -> dict:
    """OUT/task_config.json, checked for the structure `save_run` writes (it may have been edited)."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    expected = {"config": dict, "vocab": list, "labels": list}
    if not isinstance(saved, dict) or any(not isinstance(saved.get(key), kind) for key, kind in expected.items()):
        raise ValueError(f"{path}: not a task run's config (expected an object with a config object and "
                         "vocab and labels lists)")
    if not isinstance(saved.get("chars"), (list, type(None))) or not isinstance(saved.get("bilm"), (dict, type(None))):
        raise ValueError(f"{path}: not a task run's config (chars must be a list, bilm an object)")
    if saved.get("bilm") and not {"path", "fingerprint"} <= set(saved["bilm"]):
        raise ValueError(f"{path}: its bilm record lacks the path or the fingerprint of the biLM")
    return saved


def evaluate_run(run_dir: str | Path, split: str = "test", data_dir: str | None = None,
                 max_sentences: int | None = None, progress: bool = True,
                 device: str | torch.device | None = None) -> dict:
    """Score a saved run on one split of the data it was trained with (its files, or its preset's
    under `data_dir`, by default the folder it was trained from)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    run = load(run_dir, device)
    config = replace(run.config, data_dir=data_dir) if data_dir else run.config
    files = config.split_files()
    if split not in files:
        raise ValueError(f"{run_dir}: this run has no {split} file")
    examples, _ = read_split(config, files[split])
    examples = subsample(examples, max_sentences if max_sentences is not None else config.max_eval_sentences)
    return run.evaluate(examples, progress=progress)[0]
