"""A trained task model as a tool: load a run directory, label new text, score labelled files.

    run = elmokit.tasks.load("runs/ner")
    run.predict("Peter Smith lives in Paris.", tokenize=True)
    # TagPrediction(6 tokens: Span(PER 'Peter Smith' [0:2] 0.98), Span(LOC 'Paris' [4:5] 0.99))
    run.predict_labels([["Peter", "Smith", "lives", "in", "Paris", "."]])  # [['B-PER', 'I-PER', 'O', 'O', 'B-LOC', 'O']]
    run.evaluate("test.conll")  # Evaluation(span F1 91.02 on 3,453 sentences of test.conll)

A run directory is self-contained: task_model.safetensors (the task model's weights),
task_config.json (its TaskConfig, word, character and label vocabularies, the elmokit and torch
versions that wrote it, and which biLM it reads: by name or by path, with a fingerprint of its
weights, checked here so that another biLM is an error rather than silently different vectors; see
`elmokit.tasks.bilm_ref`), results.json and README.md (its model card).
"""

from __future__ import annotations

import json
import typing
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from elmokit.devices import resolve_device
from elmokit.jsonfiles import read_json
from elmokit.inference.elmo import module_device
from elmokit.model.bilm import BiLM
from elmokit.model.weights import WeightFileError, read_safetensors, safetensors_header
from elmokit.tasks.bilm_ref import describe, find_bilm
from elmokit.tasks.confidence import label_predictions, tag_predictions
from elmokit.tasks.data import Vocabularies, gold_labels, read_split, subsample
from elmokit.tasks.features import compute_layers
from elmokit.tasks.formats import label_breaks_lines, read_examples, resolve_format
from elmokit.tasks.readers import LabelledSentence, TaggedSentence
from elmokit.tasks.results import Evaluation, LabelPrediction, TagPrediction
from elmokit.tasks.scores import score_predictions
from elmokit.tasks.task_config import SPLITS, TaskConfig
from elmokit.tasks.train import RUN_CONFIG, RUN_LOCK, RUN_WEIGHTS, build_task_model

Prediction = TagPrediction | LabelPrediction


class TaskRun:
    """A trained task model, its vocabularies and its biLM, loaded from a run directory (`load`)."""

    def __init__(self, config: TaskConfig, model, vocabularies: Vocabularies, bilm: BiLM | None, run_dir: Path,
                 bilm_record: dict | None = None, results: dict | None = None):
        self.config, self.model, self.vocabularies, self.bilm = config, model.eval(), vocabularies, bilm
        self.run_dir, self.bilm_record, self.results = run_dir, bilm_record, results

    @property
    def kind(self) -> str:
        """'tagger' (one label a token) or 'classifier' (one label a sentence)."""
        return self.config.spec.kind

    @property
    def labels(self) -> list[str]:
        return self.vocabularies.labels

    def __repr__(self) -> str:
        elmo = f"ELMo {describe(self.bilm_record)}" if self.bilm_record else "no ELMo"
        scores = ""
        if self.results:
            metric = self.config.spec.metric
            scored = [f"{name} {self.results[name][metric]:.2f}" for name in ("dev", "test") if self.results.get(name)]
            scores = f", {'span F1' if metric == 'f1' else 'accuracy'} {', '.join(scored)}"
        return f"TaskRun({self.config.task} {self.kind}, {len(self.labels)} labels, {elmo}{scores}, {self.run_dir})"

    def predict(self, text: str | Sequence[str] | Sequence[Sequence[str]], tokenize: bool = False,
                batch_size: int | None = None, progress: bool = False) -> Prediction | list[Prediction]:
        """Label text: a string (split with the Moses tokenizer if `tokenize`, else on whitespace)
        or a list of tokens gives one prediction; a list of token lists gives a list of them.

        A tagger gives `TagPrediction`s (tags, each tag's probability, and for entity tags the
        spans with theirs), a classifier `LabelPrediction`s (the label, its probability and every
        label's); see `elmokit.tasks.confidence` for what the probabilities are. `predict_labels`
        gives the bare labels."""
        single, sentences = _token_lists(text, tokenize)
        predictions = []
        for chunk, batch in self._batches(sentences, batch_size, progress):
            if self.kind == "tagger":
                predictions += tag_predictions(self.model, batch, chunk, self.labels, self.config.entity_tags)
            else:
                predictions += label_predictions(self.model, batch, chunk, self.labels)
        return predictions[0] if single else predictions

    def predict_labels(self, sentences: Sequence[Sequence[str]], batch_size: int | None = None,
                       progress: bool = False) -> list:
        """The bare labels of each tokenized sentence: a tag a token for a tagger (entity tags in
        BIO), one label for a classifier (what `elmo task predict` writes)."""
        _check_sentences(sentences)
        predicted = []
        for _, batch in self._batches(sentences, batch_size, progress):
            predicted.extend(self.model.predict(batch))
        if self.kind == "tagger":
            return [[self.labels[i] for i in row] for row in predicted]
        return [self.labels[i] for i in predicted]

    def _batches(self, sentences: Sequence[Sequence[str]], batch_size: int | None, progress: bool):
        """(sentences, Batch) `batch_size` sentences at a time (default twice the training batch,
        as evaluation during training reads them); `progress` shows a bar while the biLM reads them."""
        batch_size = batch_size or 2 * self.config.batch_size
        device = module_device(self.model)
        layers = None
        if self.bilm is not None and not self.config.finetune and sentences:
            layers = compute_layers(self.bilm, sentences, progress=progress, device=device,
                                    bilm_dtype=self.config.bilm_dtype)
        for start in range(0, len(sentences), batch_size):
            chunk = sentences[start:start + batch_size]
            chunk_layers = layers[start:start + batch_size] if layers is not None else None
            yield chunk, self.vocabularies.batch(chunk, None, chunk_layers, self.kind == "tagger", device)

    def evaluate(self, data: str | Path | Sequence, batch_size: int | None = None, progress: bool = False,
                 data_format: str = "auto", column: str | None = None) -> Evaluation:
        """Score labelled data: a file in any format this run's task reads (`data_format`,
        `column` as `read_file`), or examples (TaggedSentence / LabelledSentence, or
        (tokens, labels) pairs). Returns an `Evaluation`: its `scores`, `predictions`, and a table
        as its str."""
        if isinstance(data, (str, Path)):
            examples, _ = self.read_file(data, data_format, column)
            return self._evaluate(examples, str(data), batch_size, progress)
        return self._evaluate([_example(item, self.kind) for item in data], "the examples given", batch_size, progress)

    def _evaluate(self, examples: Sequence, source: str, batch_size: int | None, progress: bool) -> Evaluation:
        predicted = self.predict_labels([e.tokens for e in examples], batch_size, progress) if examples else []
        scores = score_predictions([gold_labels(e) for e in examples], predicted, self.config.spec.metric)
        return Evaluation(scores, predicted, len(examples), source, self.config.spec.metric)

    def read_file(self, path: str | Path, data_format: str = "auto", column: str | None = None) -> tuple[list, dict]:
        """The labelled examples of any file this run's task reads, and what was found in it."""
        fmt = resolve_format(path, self.kind, data_format, column or self.config.column)
        return read_examples(path, self.kind, fmt, entity_tags=self.config.entity_tags)


def _example(item, kind: str):
    """An example given to `evaluate`: kept as it is, or made from a (tokens, labels) pair."""
    if isinstance(item, (TaggedSentence, LabelledSentence)):
        return item
    if isinstance(item, Sequence) and len(item) == 2 and not isinstance(item, str):
        tokens, labels = item
        return TaggedSentence(list(tokens), list(labels)) if kind == "tagger" else LabelledSentence(list(tokens), labels)
    raise ValueError(f"evaluate takes a file path, or examples (TaggedSentence, LabelledSentence or "
                     f"(tokens, labels) pairs); got {item!r:.80}")


def _token_lists(text, tokenize: bool) -> tuple[bool, list[list[str]]]:
    """(one sentence?, the sentences as token lists) of what `predict` was given."""
    if isinstance(text, str):
        from elmokit.inference.files import make_tokenizer

        tokens = make_tokenizer(tokenize)(text)
        if not tokens:
            raise ValueError("predict: the text is empty (no token in it)")
        return True, [tokens]
    if tokenize:
        raise ValueError("predict: tokenize=True is for raw text (a str); a list is read as tokens already")
    if isinstance(text, Sequence) and text and all(isinstance(token, str) for token in text):
        _check_sentences([text])
        return True, [list(text)]
    _check_sentences(text)
    return False, [list(sentence) for sentence in text]


def _check_sentences(sentences) -> None:
    if isinstance(sentences, str) or not isinstance(sentences, Sequence):
        raise ValueError(f"predict takes a list of tokenized sentences (lists of strings), got {type(sentences).__name__}")
    for index, sentence in enumerate(sentences):
        if isinstance(sentence, str) or not sentence or not all(isinstance(t, str) and t for t in sentence):
            raise ValueError(f"sentence {index} must be a non-empty list of non-empty strings, got {sentence!r:.80}")


def load(run_dir: str | Path, device: str | torch.device | None = None,
         bilm: str | Path | BiLM | None = None) -> TaskRun:
    """Rebuild a trained task model from its run directory (see the module docstring), on `device`
    (default: the CPU, whatever device it was trained on). Its biLM is the one the run records (by
    name, or by its path relative to the run, then where it was), or `bilm`: a BiLM, a name or a
    model directory, for a run moved away from its biLM; either must have the recorded fingerprint."""
    run_dir = Path(run_dir)
    if (run_dir / RUN_LOCK).exists():  # being written (OutputInUseError), or a stale lock taken and dropped
        from elmokit.io import output_lock

        with output_lock(run_dir / RUN_LOCK, f"run directory {run_dir}"):
            pass
    for name in (RUN_CONFIG, RUN_WEIGHTS):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir}: not a task run directory (no {name})")
    saved = _read_run_config(run_dir / RUN_CONFIG)
    config = _config_from_saved(run_dir / RUN_CONFIG, saved["config"])
    record = None
    vocabularies = Vocabularies(saved["vocab"], saved["labels"], saved.get("chars"))
    if config.model is not None:
        record = saved.get("bilm") or {"path": config.model, "fingerprint": None}
        # a published biLM's shape (from its options file) is checked against the task model's
        # tensors before its weights are downloaded
        bilm = find_bilm(record, run_dir, bilm, fits=lambda shape: _check_sizes(run_dir, config, vocabularies, shape))
    elif bilm is not None:
        raise ValueError(f"{run_dir}: this run was trained without ELMo; it reads no biLM (bilm= / --model)")
    _check_sizes(run_dir, config, vocabularies, bilm)  # before anything is allocated
    model = build_task_model(config, vocabularies, bilm)
    weights = read_safetensors(run_dir / RUN_WEIGHTS)  # float and finite, or an error naming the tensor
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:  # missing, unexpected or differently shaped tensors
        raise WeightFileError(f"{run_dir / RUN_WEIGHTS}: does not match {RUN_CONFIG} "
                              f"({' '.join(str(error).split())[:400]})") from None
    results_path = run_dir / "results.json"
    results = read_json(results_path) if results_path.is_file() else None
    return TaskRun(config, model.to(resolve_device(device)), vocabularies, bilm, run_dir, record, results)


def _check_sizes(run_dir: Path, config: TaskConfig, vocabularies: Vocabularies, bilm: BiLM | None) -> None:
    """The task model `task_config.json` describes, built as a skeleton on the meta device (no
    memory), has exactly the tensors of `task_model.safetensors`'s header: an edited size
    (`hidden_dim: 30000`) is an error here rather than gigabytes allocated before the check."""
    header = safetensors_header(run_dir / RUN_WEIGHTS)
    try:
        with torch.device("meta"):
            skeleton = build_task_model(config, vocabularies, bilm)
    except (RuntimeError, TypeError, ValueError, OverflowError) as error:  # sizes no model can have
        raise WeightFileError(f"{run_dir / RUN_CONFIG}: sizes no task model can have "
                              f"({str(error).splitlines()[0][:200]})") from None
    expected = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    actual = {name: shape for name, (_, shape) in header.items()}
    if expected != actual:
        wrong = sorted(name for name in expected.keys() | actual.keys() if expected.get(name) != actual.get(name))
        described = ", ".join(f"{name} {list(expected[name]) if name in expected else 'absent'} in the config, "
                              f"{list(actual[name]) if name in actual else 'absent'} in the weights"
                              for name in wrong[:3])
        raise WeightFileError(f"{run_dir / RUN_WEIGHTS}: does not match {RUN_CONFIG} ({len(wrong)} tensors differ: "
                              f"{described}); was the config edited?")


def _read_run_config(path: Path) -> dict:
    """OUT/task_config.json, checked for the structure `save_run` writes (it may have been edited):
    anything else is a ValueError naming the file and the key."""
    saved = read_json(path)  # JSONFileError naming the file: not JSON, not UTF-8, nested too deeply
    expected = {"config": dict, "vocab": list, "labels": list}
    if not isinstance(saved, dict) or any(not isinstance(saved.get(key), kind) for key, kind in expected.items()):
        raise ValueError(f"{path}: not a task run's config (expected an object with a config object and "
                         "vocab and labels lists)")
    if not isinstance(saved.get("chars"), (list, type(None))) or not isinstance(saved.get("bilm"), (dict, type(None))):
        raise ValueError(f"{path}: not a task run's config (chars must be a list, bilm an object)")
    for key, least in (("vocab", 2), ("labels", 1), ("chars", 1)):  # the words start with padding and unknown
        items = saved.get(key)
        if items is not None and (len(items) < least or not all(isinstance(item, str) and item for item in items)):
            raise ValueError(f"{path}: not a task run's config ({key} must be a list of at least {least} "
                             f"non-empty strings, got {json.dumps(items)[:80]})")
    if any(label_breaks_lines(label) for label in saved["labels"]):
        raise ValueError(f"{path}: labels must not hold a tab or a line break")
    record = saved.get("bilm")
    if record and ("fingerprint" not in record or not ({"path", "name"} & set(record))):
        raise ValueError(f"{path}: its bilm record lacks the name or path, or the fingerprint, of the biLM")
    for key in ("path", "name", "absolute_path", "fingerprint"):
        if record and record.get(key) is not None and not isinstance(record[key], str):
            raise ValueError(f"{path}: bilm.{key} must be a string, got {json.dumps(record[key])[:80]}")
    return saved


def _config_from_saved(path: Path, values: dict) -> TaskConfig:
    """The TaskConfig of a run's config object, each value of the type of its field."""
    hints = typing.get_type_hints(TaskConfig)
    for name, value in values.items():
        if name in hints and not _has_type(value, hints[name]):
            wanted = " or ".join("null" if kind is type(None) else kind.__name__
                                 for kind in typing.get_args(hints[name]) or (hints[name],))
            raise ValueError(f"{path}: config.{name} must be {wanted}, got {json.dumps(value)[:80]}")
    try:
        return TaskConfig(**values)
    except TypeError as error:  # a key TaskConfig does not have, or lacks
        raise ValueError(f"{path}: not a task run's config ({error})") from None
    except ValueError as error:  # a value out of its range (TaskOptionError)
        raise ValueError(f"{path}: config: {error}") from None


def _has_type(value, hint) -> bool:
    allowed = typing.get_args(hint) or (hint,)
    if value is None or isinstance(value, bool):
        return type(value) in allowed
    if isinstance(value, int):
        return int in allowed or float in allowed
    return isinstance(value, tuple(kind for kind in allowed if kind is not int))


def evaluate_run(run_dir: str | Path, split: str = "test", data_dir: str | None = None,
                 max_sentences: int | None = None, progress: bool = True,
                 device: str | torch.device | None = None, bilm: str | Path | BiLM | None = None) -> dict:
    """Score a saved run on one split of the data it was trained with (its files, or its preset's
    under `data_dir`, by default the folder it was trained from)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if max_sentences is not None and (isinstance(max_sentences, bool) or not isinstance(max_sentences, int)
                                      or max_sentences < 1):
        raise ValueError(f"max_sentences (--max-sentences) must be an integer >= 1, got {max_sentences!r}")
    run = load(run_dir, device, bilm)
    config = replace(run.config, data_dir=data_dir) if data_dir else run.config
    files = config.split_files()
    if split not in files:
        raise ValueError(f"{run_dir}: this run has no {split} file")
    examples, _ = read_split(config, files[split])
    examples = subsample(examples, max_sentences if max_sentences is not None else config.max_eval_sentences)
    return run._evaluate(examples, f"{split} split", None, progress).scores
