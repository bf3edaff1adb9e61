"""Training and evaluating a task model, with or without ELMo (issue 5).

One visible loop: `train_task` = load data -> (cache the frozen biLM's layers once) -> epochs of
`train_epoch` -> `evaluate` on dev after each -> early stopping -> best weights -> dev and test
scores -> `save_task_model`. Metrics are written one JSON object a line to OUT/metrics.jsonl.
"""

from __future__ import annotations

import copy
import json
import os
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from elmokit.io import atomic_path, atomic_write_text
from elmokit.model import BiLM
from elmokit.tasks import readers
from elmokit.tasks.classifier import Classifier
from elmokit.tasks.encoder import Batch, ContextEncoder
from elmokit.tasks.features import cached_layers, pad_layers
from elmokit.tasks.metrics import accuracy, span_f1
from elmokit.tasks.tagger import Tagger
from elmokit.weights import load_model

PAD, UNK = "<pad>", "<unk>"
DEFAULT_DATA_DIR = os.environ.get("ELMOKIT_DATA_DIR", "../shared/data")
SPLITS = ("train", "dev", "test")


# ---------------------------------------------------------------------------------------------
# The tasks: where their data is, how to read it, what model and metric they use
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TaskSpec:
    kind: str  # "tagger" or "classifier"
    files: tuple[str, str, str]  # train, dev, test, relative to the data directory
    metric: str  # "accuracy" or "f1"
    use_crf: bool = False

    def read(self, path: Path, name: str) -> list:
        if name == "pos":
            return readers.read_conllu(path)
        if name == "ner":
            return readers.read_conll2003(path)
        return readers.read_sst_trees(path, binary=name == "sst2")


TASKS = {
    "pos": TaskSpec("tagger", ("ud-english-ewt/en_ewt-ud-train.conllu.gz", "ud-english-ewt/en_ewt-ud-dev.conllu",
                               "ud-english-ewt/en_ewt-ud-test.conllu"), "accuracy"),
    "ner": TaskSpec("tagger", ("conll2003/eng.train", "conll2003/eng.testa", "conll2003/eng.testb"), "f1",
                    use_crf=True),
    "sst5": TaskSpec("classifier", ("sst/train.txt", "sst/dev.txt", "sst/test.txt"), "accuracy"),
    "sst2": TaskSpec("classifier", ("sst/train.txt", "sst/dev.txt", "sst/test.txt"), "accuracy"),
}


@dataclass
class TaskConfig:
    """Everything that defines a task run; saved as OUT/task_config.json."""

    task: str = "pos"
    model: str | None = None  # biLM directory; None = no ELMo
    out: str = "runs/task"
    seed: int = 1
    data_dir: str = DEFAULT_DATA_DIR
    max_epochs: int = 10
    patience: int = 3
    batch_size: int = 32
    lr: float = 0.001
    word_dim: int = 100
    hidden_dim: int = 128
    dropout: float = 0.5
    min_word_count: int = 2
    elmo_dropout: float = 0.5
    elmo_l2: float = 0.001  # lambda of Peters et al. (2018) §3.3
    elmo_at_output: bool = False
    crf: bool | None = None  # None: the task's default (NER yes, POS no)
    pooling: str = "max"
    finetune: bool = False
    bilm_lr: float = 1e-4
    max_train_sentences: int | None = None  # subsample (the same subset for every seed)
    max_eval_sentences: int | None = None
    cache_dir: str | None = None  # share the frozen biLM's layers between runs
    threads: int | None = None  # torch intra-op threads; 1 is fastest for small models on a busy CPU
    progress: bool = True

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"--task must be one of {sorted(TASKS)}, got {self.task!r}")
        if self.pooling not in ("max", "mean"):
            raise ValueError(f"--pooling must be max or mean, got {self.pooling!r}")
        for name in ("max_epochs", "batch_size", "word_dim", "hidden_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.finetune and self.model is None:
            raise ValueError("--finetune needs an ELMo model (--model DIR)")

    @property
    def spec(self) -> TaskSpec:
        return TASKS[self.task]

    @property
    def use_crf(self) -> bool:
        return self.spec.use_crf if self.crf is None else self.crf


# ---------------------------------------------------------------------------------------------
# Data: examples, vocabularies, batches
# ---------------------------------------------------------------------------------------------
def load_splits(config: TaskConfig) -> dict[str, list]:
    """The task's train/dev/test examples, subsampled (a fixed subset, seed 0) if asked."""
    data_dir = Path(config.data_dir)
    splits = {}
    for split, relative in zip(SPLITS, config.spec.files):
        examples = config.spec.read(data_dir / relative, config.task)
        limit = config.max_train_sentences if split == "train" else config.max_eval_sentences
        if limit is not None and len(examples) > limit:
            keep = sorted(random.Random(0).sample(range(len(examples)), limit))
            examples = [examples[i] for i in keep]
        splits[split] = examples
    return splits


def labels_of(example) -> list[str] | int:
    return example.tags if hasattr(example, "tags") else example.label


def build_vocab(examples: Sequence, min_count: int) -> list[str]:
    counts = Counter(token for example in examples for token in example.tokens)
    return [PAD, UNK, *sorted(word for word, count in counts.items() if count >= min_count)]


def build_labels(config: TaskConfig, examples: Sequence) -> list[str]:
    if config.spec.kind == "classifier":
        return [str(k) for k in range(2 if config.task == "sst2" else 5)]
    return sorted({tag for example in examples for tag in example.tags})


def make_batch(examples: Sequence, word_index: dict[str, int], label_index: dict[str, int],
               layers: Sequence[torch.Tensor] | None) -> Batch:
    lengths = [len(example.tokens) for example in examples]
    word_ids = torch.zeros(len(examples), max(lengths), dtype=torch.long)
    mask = torch.zeros(len(examples), max(lengths), dtype=torch.bool)
    for row, example in enumerate(examples):
        word_ids[row, :lengths[row]] = torch.tensor([word_index.get(t, 1) for t in example.tokens])
        mask[row, :lengths[row]] = True
    if hasattr(examples[0], "tags"):
        labels = torch.zeros_like(word_ids)
        for row, example in enumerate(examples):
            labels[row, :lengths[row]] = torch.tensor([label_index.get(t, 0) for t in example.tags])
    else:
        labels = torch.tensor([example.label for example in examples])
    return Batch(word_ids, mask, labels, [list(example.tokens) for example in examples],
                 pad_layers(layers) if layers is not None else None)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
def build_model(config: TaskConfig, vocab_size: int, n_labels: int, bilm: BiLM | None) -> Tagger | Classifier:
    elmo_layers = bilm.config.n_output_layers if bilm is not None else 0
    elmo_dim = bilm.output_dim if bilm is not None else 0
    encoder = ContextEncoder(vocab_size, config.word_dim, config.hidden_dim, config.dropout,
                             elmo_layers, elmo_dim, config.elmo_at_output, config.elmo_dropout,
                             config.elmo_l2, bilm=bilm if config.finetune else None)
    if config.spec.kind == "tagger":
        return Tagger(encoder, n_labels, config.use_crf)
    return Classifier(encoder, n_labels, config.pooling)


def make_optimizer(model: torch.nn.Module, config: TaskConfig) -> torch.optim.Optimizer:
    """Adam; a fine-tuned biLM has its own (smaller) learning rate."""
    bilm_params = [p for n, p in model.named_parameters() if n.startswith("encoder.bilm.")]
    task_params = [p for n, p in model.named_parameters() if not n.startswith("encoder.bilm.")]
    groups = [{"params": task_params, "lr": config.lr}]
    if bilm_params:
        groups.append({"params": bilm_params, "lr": config.bilm_lr})
    return torch.optim.Adam(groups)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# The loop: one function each for an epoch, evaluation and the checkpoint
# ---------------------------------------------------------------------------------------------
class TaskData:
    """Examples, vocabularies and (for a frozen biLM) the cached layers of every split."""

    def __init__(self, config: TaskConfig, splits: dict[str, list], bilm: BiLM | None,
                 layers: dict[str, list[torch.Tensor]] | None = None, vocab: list[str] | None = None,
                 labels: list[str] | None = None):
        self.splits = splits
        self.vocab = vocab or build_vocab(splits["train"], config.min_word_count)
        self.labels = labels or build_labels(config, splits["train"])
        self.word_index = {word: i for i, word in enumerate(self.vocab)}
        self.label_index = {label: i for i, label in enumerate(self.labels)}
        self.layers = layers
        if layers is None and bilm is not None and not config.finetune:
            self.layers = {split: cached_layers(bilm, [e.tokens for e in examples], config.cache_dir,
                                                progress=config.progress, desc=f"ELMo {split}")
                           for split, examples in splits.items()}

    def batches(self, split: str, batch_size: int, shuffle: bool = False, rng: random.Random | None = None):
        examples = self.splits[split]
        order = list(range(len(examples)))
        if shuffle:
            rng.shuffle(order)
        for start in range(0, len(order), batch_size):
            indices = order[start:start + batch_size]
            layers = [self.layers[split][i] for i in indices] if self.layers is not None else None
            yield make_batch([examples[i] for i in indices], self.word_index, self.label_index, layers)


def train_epoch(model, optimizer, data: TaskData, config: TaskConfig, rng: random.Random, epoch: int) -> float:
    model.train()
    total, count = 0.0, 0
    n_batches = -(-len(data.splits["train"]) // config.batch_size)
    bar = tqdm(data.batches("train", config.batch_size, shuffle=True, rng=rng), total=n_batches,
               desc=f"{config.task} epoch {epoch}", unit="batch", disable=not config.progress, leave=False)
    for batch in bar:
        optimizer.zero_grad()
        loss = model.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        optimizer.step()
        total += loss.item()
        count += 1
        bar.set_postfix(loss=f"{total / count:.3f}")
    return total / max(count, 1)


def evaluate(model, data: TaskData, split: str, config: TaskConfig) -> dict[str, float]:
    """{'accuracy': %} for POS and sentiment, {'f1', 'precision', 'recall'} (%) for NER."""
    model.eval()
    predicted = []
    for batch in data.batches(split, 2 * config.batch_size):
        predicted.extend(model.predict(batch))
    examples = data.splits[split]
    if config.spec.kind == "classifier":
        return {"accuracy": 100.0 * accuracy([e.label for e in examples], predicted)}
    predicted_tags = [[data.labels[i] for i in row] for row in predicted]
    if config.spec.metric == "f1":
        scores = span_f1([e.tags for e in examples], predicted_tags)
        return {name: scores[name] for name in ("f1", "precision", "recall")}
    flat_gold = [tag for e in examples for tag in e.tags]
    return {"accuracy": 100.0 * accuracy(flat_gold, [tag for row in predicted_tags for tag in row])}


def train_task(config: TaskConfig, bilm: BiLM | None = None, data: TaskData | None = None) -> dict:
    """Train with early stopping on dev; save the best model to `config.out`; return the results.

    `bilm` (else loaded from `config.model`) and `data` (its cached layers included) may be passed
    in to share them between seeds.
    """
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    start_cpu, start_wall = time.process_time(), time.perf_counter()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    if bilm is None and config.model is not None:
        bilm = load_model(config.model)
    if config.finetune:
        bilm = copy.deepcopy(bilm).train().requires_grad_(True)
    if data is None:
        data = TaskData(config, load_splits(config), bilm)
    seed_everything(config.seed)
    model = build_model(config, len(data.vocab), len(data.labels), bilm)
    optimizer = make_optimizer(model, config)
    rng = random.Random(config.seed)
    metric = config.spec.metric
    best_score, best_state, best_epoch, waited = float("-inf"), None, 0, 0
    with open(out / "metrics.jsonl", "w", encoding="utf-8") as log:
        for epoch in range(1, config.max_epochs + 1):
            train_loss = train_epoch(model, optimizer, data, config, rng, epoch)
            dev = evaluate(model, data, "dev", config)
            record = {"epoch": epoch, "train_loss": round(train_loss, 5),
                      **{f"dev_{k}": round(v, 3) for k, v in dev.items()},
                      "cpu_s": round(time.process_time() - start_cpu, 1)}
            log.write(json.dumps(record) + "\n")
            log.flush()
            if config.progress:
                tqdm.write(json.dumps(record))
            if dev[metric] > best_score:
                best_score, best_epoch, waited = dev[metric], epoch, 0
                best_state = copy.deepcopy(model.state_dict())
            else:
                waited += 1
                if waited >= config.patience:
                    break
    model.load_state_dict(best_state)
    results = {
        "task": config.task, "elmo": config.model is not None, "seed": config.seed, "metric": metric,
        "best_epoch": best_epoch, "dev": evaluate(model, data, "dev", config),
        "test": evaluate(model, data, "test", config),
        "layer_weights": model.encoder.layer_weights(),
        "cpu_seconds": round(time.process_time() - start_cpu, 1),
        "wall_seconds": round(time.perf_counter() - start_wall, 1),
        "n_train": len(data.splits["train"]),
    }
    save_task_model(model, config, data, out)
    atomic_write_text(out / "results.json", json.dumps(results, indent=2) + "\n")
    return results


# ---------------------------------------------------------------------------------------------
# Checkpoint: task_config.json (config, vocabulary, labels) + task_model.safetensors
# ---------------------------------------------------------------------------------------------
def save_task_model(model, config: TaskConfig, data: TaskData, out: Path) -> None:
    """The task's own weights; a frozen biLM is not copied (task_config.json names its directory)."""
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    with atomic_path(out / "task_model.safetensors") as tmp:
        save_file(tensors, str(tmp))
    saved = {"config": asdict(config), "vocab": data.vocab, "labels": data.labels}
    atomic_write_text(out / "task_config.json", json.dumps(saved) + "\n")


def load_task_model(run_dir: str | Path) -> tuple[TaskConfig, Tagger | Classifier, list[str], list[str], BiLM | None]:
    """Rebuild a trained task model from its run directory: (config, model, vocab, labels, bilm)."""
    run_dir = Path(run_dir)
    for name in ("task_config.json", "task_model.safetensors"):
        if not (run_dir / name).is_file():
            raise FileNotFoundError(f"{run_dir}: not a task run directory (no {name})")
    saved = json.loads((run_dir / "task_config.json").read_text(encoding="utf-8"))
    config = TaskConfig(**saved["config"])
    bilm = load_model(config.model) if config.model is not None else None
    model = build_model(config, len(saved["vocab"]), len(saved["labels"]), bilm)
    model.load_state_dict(load_file(str(run_dir / "task_model.safetensors")))
    return config, model.eval(), saved["vocab"], saved["labels"], bilm


def evaluate_run(run_dir: str | Path, split: str = "test", data_dir: str | None = None,
                 max_sentences: int | None = None, progress: bool = True) -> dict[str, float]:
    """Score a saved run on one split of its task."""
    config, model, vocab, labels, bilm = load_task_model(run_dir)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    config.data_dir = data_dir or config.data_dir
    config.max_eval_sentences = max_sentences if max_sentences is not None else config.max_eval_sentences
    config.progress = progress
    path = Path(config.data_dir) / config.spec.files[SPLITS.index(split)]
    examples = config.spec.read(path, config.task)
    if config.max_eval_sentences is not None and len(examples) > config.max_eval_sentences:
        keep = sorted(random.Random(0).sample(range(len(examples)), config.max_eval_sentences))
        examples = [examples[i] for i in keep]
    layers = None
    if bilm is not None and not config.finetune:
        layers = {split: cached_layers(bilm, [e.tokens for e in examples], config.cache_dir, progress=progress)}
    data = TaskData(config, {split: examples}, None, layers, vocab, labels)
    return evaluate(model, data, split, config)
