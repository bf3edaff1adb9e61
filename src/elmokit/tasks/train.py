"""Training and evaluating a task model, with or without ELMo.

One visible loop: `train_task` = load data -> (cache the frozen biLM's layers once) -> epochs of
`train_epoch` -> `evaluate` on dev after each -> `EarlyStopping` -> the loop's state saved
(`save_loop`, for `resume`) -> best weights -> dev and test scores -> `save_run`. Each epoch is one JSON line in OUT/metrics.jsonl (a log, appended as the
run goes) and one line on stderr; the run's other files are written whole (temp + rename).
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from elmokit.io import atomic_path, atomic_write_text
from elmokit.model.bilm import BiLM
from elmokit.progress import progress_bar, write as write_line
from elmokit.training.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from elmokit.training.model_card import software_versions
from elmokit.training.processes import seed_everything
from elmokit.tasks.bilm_ref import bilm_record, open_bilm
from elmokit.tasks.card import write_run_card
from elmokit.tasks.charcnn import CharWordEncoder
from elmokit.tasks.classifier import Classifier
from elmokit.tasks.data import TaskData, Vocabularies, gold_labels, load_splits  # noqa: F401 (re-exported)
from elmokit.tasks.encoder import ContextEncoder
from elmokit.tasks.scores import score_predictions
from elmokit.tasks.tagger import Tagger
from elmokit.tasks.task_config import DEFAULT_DATA_DIR, SPLITS, TASKS, TaskConfig  # noqa: F401 (re-exported)
from elmokit.devices import use_threads


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
def build_task_model(config: TaskConfig, vocabularies: Vocabularies, bilm: BiLM | None) -> Tagger | Classifier:
    """A fresh task model for `config` over these vocabularies (and this biLM's layers)."""
    elmo_layers = bilm.config.n_output_layers if bilm is not None else 0
    elmo_dim = bilm.output_dim if bilm is not None else 0
    char_encoder = None
    if vocabularies.chars is not None:
        char_encoder = CharWordEncoder(len(vocabularies.chars), config.char_dim, config.char_filters, config.char_width,
                               config.dropout)
    encoder = ContextEncoder(len(vocabularies.words), config.word_dim, config.hidden_dim, config.dropout,
                             elmo_layers, elmo_dim, config.elmo_at_output, config.elmo_dropout,
                             config.elmo_l2, bilm=bilm if config.finetune else None, char_encoder=char_encoder)
    if config.spec.kind == "tagger":
        return Tagger(encoder, len(vocabularies.labels), config.use_crf)
    return Classifier(encoder, len(vocabularies.labels), config.pooling)


def make_optimizer(model: torch.nn.Module, config: TaskConfig) -> torch.optim.Optimizer:
    """Adam; a fine-tuned biLM has its own (smaller) learning rate."""
    bilm_params = [p for n, p in model.named_parameters() if n.startswith("encoder.bilm.")]
    task_params = [p for n, p in model.named_parameters() if not n.startswith("encoder.bilm.")]
    groups = [{"params": task_params, "lr": config.lr}]
    if bilm_params:
        groups.append({"params": bilm_params, "lr": config.bilm_lr})
    return torch.optim.Adam(groups)


# ---------------------------------------------------------------------------------------------
# The loop: one function each for an epoch, evaluation, early stopping and the checkpoint
# ---------------------------------------------------------------------------------------------
def train_epoch(model, optimizer, data: TaskData, config: TaskConfig, rng: random.Random, epoch: int) -> float:
    model.train()
    total, count = 0.0, 0
    n_batches = -(-len(data.splits["train"]) // config.batch_size)
    bar = progress_bar(data.batches("train", config.batch_size, shuffle=True, rng=rng), total=n_batches,
                       desc=f"{config.task} epoch {epoch}", unit="batch", enabled=config.progress, leave=False)
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


def predict_split(model, data: TaskData, split: str, batch_size: int) -> list:
    """The predicted labels (strings) of every example of `split`, in order."""
    model.eval()
    predicted = []
    for batch in data.batches(split, batch_size):
        predicted.extend(model.predict(batch))
    if data.tagging:
        return [[data.labels[i] for i in row] for row in predicted]
    return [data.labels[i] for i in predicted]


def evaluate_split(model, data: TaskData, split: str, config: TaskConfig, predicted: list | None = None) -> dict:
    """{'accuracy'} (%) for POS and classification; {'f1', 'precision', 'recall', 'per_type'} for NER
    (of `predicted`, `split`'s predicted labels, when given)."""
    if predicted is None:
        predicted = predict_split(model, data, split, 2 * config.batch_size)
    return score_predictions([gold_labels(e) for e in data.splits[split]], predicted, config.spec.metric)


def single_class_warning(config: TaskConfig, data: TaskData, predicted: list, epochs: int,
                         stopped_early: bool) -> str | None:
    """A warning when the model predicts one class for every dev example (every token, or every
    sentence) though dev has several: a run too short to learn the task, and what to raise."""
    gold = [gold_labels(example) for example in data.splits["dev"]]
    classes = (lambda rows: {label for row in rows for label in row}) if data.tagging else set
    predicted_classes, gold_classes = classes(predicted), classes(gold)
    if len(predicted_classes) != 1 or len(gold_classes) < 2:
        return None
    unit, kind = ("token", "tag") if data.tagging else ("sentence", "label")
    patience = f"--patience (it stopped early after {config.patience} epochs without progress), " if stopped_early else ""
    return (f"warning: the model predicts {next(iter(predicted_classes))!r} for every dev {unit}, though dev has "
            f"{len(gold_classes)} {kind}s: it has not learnt the task yet. Raise --max-epochs (it ran {epochs}), "
            f"{patience}the training sentences ({len(data.splits['train'])}) or --lr ({config.lr:g})")


class EarlyStopping:
    """The best dev score so far, and when to stop: after `patience` epochs without a better one.

    An epoch that ties a best score of zero does not count against the patience, and its weights
    are kept: a tagger that still predicts no entity (F1 0.0) is learning, not stuck.
    """

    def __init__(self, patience: int):
        self.patience = patience
        self.best, self.best_epoch, self.waited = float("-inf"), 0, 0

    def update(self, score: float, epoch: int) -> bool:
        """Record an epoch's dev score; True if its weights are the ones to keep."""
        if score > self.best:
            self.best, self.best_epoch, self.waited = score, epoch, 0
            return True
        if score == self.best == 0.0:
            self.best_epoch = epoch
            return True
        self.waited += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.waited >= self.patience


def report(line: str) -> None:
    """One line on stderr, between progress bars if there are any."""
    write_line(line)


def epoch_line(config: TaskConfig, epoch: int, train_loss: float, dev: dict, stopping: EarlyStopping,
               cpu_seconds: float) -> str:
    metric = config.spec.metric
    return (f"{config.task} epoch {epoch}/{config.max_epochs}: train loss {train_loss:.4f}, dev {metric} "
            f"{dev[metric]:.2f} (best {stopping.best:.2f} at epoch {stopping.best_epoch}), {cpu_seconds:.0f} CPU s")


def train_task(config: TaskConfig, bilm: BiLM | None = None, data: TaskData | None = None,
               resume: bool = False) -> dict:
    """Train with early stopping on dev; save the best model to `config.out`; return the results.

    `bilm` (else loaded from `config.model`) and `data` (its cached layers included) may be passed
    in to share them between seeds. After each epoch the loop's state is saved (OUT/task_checkpoint.pt,
    removed once the run is whole); `resume` continues from it, epoch for epoch as if uninterrupted.
    """
    if config.threads is not None:  # kept by the embedders built later (elmokit.devices.use_threads)
        use_threads(config.threads, torch.device("cpu"))
    start_cpu, start_wall = time.process_time(), time.perf_counter()
    out = Path(config.out)
    if bilm is None and config.model is not None:
        bilm = open_bilm(config.model)
    frozen_bilm = bilm
    if config.finetune:
        bilm = copy.deepcopy(bilm).train().requires_grad_(True)
    if data is None:
        data = TaskData(config, load_splits(config, log=report), bilm, files=config.split_files())
    seed_everything(config.seed)
    model = build_task_model(config, data.vocabularies, bilm).to(data.device)  # a fine-tuned biLM with it
    optimizer = make_optimizer(model, config)
    loop = LoopState(EarlyStopping(config.patience), random.Random(config.seed))
    if resume:
        loop = resume_loop(out / CHECKPOINT, config, model, optimizer, loop, data_digests(data))
        start_cpu -= loop.cpu_seconds  # the CPU time of the epochs before the interruption counts
    metric = config.spec.metric
    out.mkdir(parents=True, exist_ok=True)  # only now that the data and the models are in hand
    with open(out / "metrics.jsonl", "w", encoding="utf-8") as log:
        log.writelines(json.dumps(record) + "\n" for record in loop.records)  # a resumed run's epochs so far
        while loop.epoch < config.max_epochs and not loop.stopping.should_stop:
            epoch = loop.epoch + 1
            train_loss = train_epoch(model, optimizer, data, config, loop.rng, epoch)
            dev = evaluate_split(model, data, "dev", config)
            if loop.stopping.update(dev[metric], epoch):
                loop.best_state = copy.deepcopy(model.state_dict())
            record = {"epoch": epoch, "train_loss": round(train_loss, 5),
                      **{f"dev_{k}": round(v, 3) for k, v in dev.items() if k != "per_type"},
                      "cpu_s": round(time.process_time() - start_cpu, 1)}
            loop.epoch, loop.cpu_seconds = epoch, time.process_time() - start_cpu
            loop.records.append(record)
            save_loop(out / CHECKPOINT, config, model, optimizer, loop, data_digests(data))
            log.write(json.dumps(record) + "\n")
            log.flush()
            report(epoch_line(config, epoch, train_loss, dev, loop.stopping, record["cpu_s"]))
    stopping = loop.stopping
    model.load_state_dict(loop.best_state)
    dev_predicted = predict_split(model, data, "dev", 2 * config.batch_size)
    if warning := single_class_warning(config, data, dev_predicted, loop.epoch, stopping.should_stop):
        report(warning)
    results = {
        "task": config.task, "elmo": config.model is not None, "seed": config.seed, "metric": metric,
        "best_epoch": stopping.best_epoch, "epochs": loop.epoch,
        "dev": evaluate_split(model, data, "dev", config, dev_predicted),
        "test": evaluate_split(model, data, "test", config) if "test" in data.splits else None,
        "layer_weights": model.encoder.layer_weights(),
        "cpu_seconds": round(time.process_time() - start_cpu, 1),
        "wall_seconds": round(time.perf_counter() - start_wall, 1),
        "n_train": len(data.splits["train"]),
        "config": asdict(config),
    }
    record = save_run(model, config, data.vocabularies, frozen_bilm, out)
    atomic_write_text(out / "results.json", json.dumps(results, indent=2) + "\n")
    write_run_card(out, config, results, record, frozen_bilm, {s: len(e) for s, e in data.splits.items()},
                   data.vocabularies.labels, data.files)
    (out / CHECKPOINT).unlink(missing_ok=True)  # the run is whole: nothing left to resume
    return results


# ---------------------------------------------------------------------------------------------
# Resuming: OUT/task_checkpoint.pt after every epoch, until the run is finished
# ---------------------------------------------------------------------------------------------
CHECKPOINT = "task_checkpoint.pt"
RESUMABLE_CHANGES = {"progress", "threads", "out", "cache_dir"}  # a resumed run may change them: how, not what


@dataclass
class LoopState:
    """Where the epochs stand: what `save_loop` writes after each epoch and `resume_loop` reads."""

    stopping: EarlyStopping
    rng: random.Random  # the order of the training examples
    epoch: int = 0  # the epochs done
    best_state: dict | None = None  # the task model's weights at its best dev score so far
    records: list[dict] = field(default_factory=list)  # metrics.jsonl's lines so far
    cpu_seconds: float = 0.0


def data_digests(data: TaskData) -> dict[str, str]:
    """A sha256 of each split's examples as read: a resumed run must train on the same data."""
    return {split: hashlib.sha256(repr(examples).encode()).hexdigest() for split, examples in data.splits.items()}


def save_loop(path: Path, config: TaskConfig, model, optimizer, loop: LoopState, digests: dict[str, str]) -> None:
    """Everything a resumed run needs to take the next epoch as the uninterrupted run would."""
    stopping = loop.stopping
    save_checkpoint(path, {
        "config": asdict(config), "data": digests, "epoch": loop.epoch, "model": model.state_dict(),
        "optimizer": optimizer.state_dict(), "best_state": loop.best_state,
        "stopping": [stopping.best, stopping.best_epoch, stopping.waited], "records": loop.records,
        "order_rng": loop.rng.getstate(), "rng": rng_state(), "cpu_seconds": loop.cpu_seconds})


def resume_loop(path: Path, config: TaskConfig, model, optimizer, loop: LoopState,
                digests: dict[str, str]) -> LoopState:
    """The loop state saved at `path`, loaded into `model` and `optimizer`; a ValueError naming
    the options that differ from the interrupted run's (other than RESUMABLE_CHANGES), or the
    splits whose examples differ, or saying that the file is not such a state."""
    saved = load_checkpoint(path, ("config", "epoch", "model", "optimizer", "stopping", "records", "order_rng", "rng"),
                            "a checkpoint of elmo task train")
    ours = asdict(config)
    unused = {"data_dir"} if config.train_file is not None else set()  # given files: the data folder is not read
    changed = sorted(name for name in ours if name not in RESUMABLE_CHANGES | unused
                     and saved["config"].get(name) != ours[name])
    if changed:
        before = saved["config"]
        differences = ", ".join(f"{name} ({before.get(name)!r}, now {ours[name]!r})" for name in changed)
        raise ValueError(f"cannot resume {path.parent}: it was trained with other {differences}; "
                         "give the same options, or overwrite=True to start over")
    changed = sorted(split for split in digests if saved.get("data", {}).get(split) != digests[split])
    if changed:
        raise ValueError(f"cannot resume {path.parent}: its {' and '.join(changed)} data changed since it was "
                         "interrupted (the files' examples differ); give the same data, or overwrite=True to start over")
    try:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        version, internal, gauss = saved["order_rng"]
        loop.rng.setstate((version, tuple(internal), gauss))
        set_rng_state(saved["rng"])
        loop.stopping.best, loop.stopping.best_epoch, loop.stopping.waited = map(float, saved["stopping"])
        loop.stopping.best_epoch, loop.stopping.waited = int(loop.stopping.best_epoch), int(loop.stopping.waited)
        loop.epoch, loop.best_state = int(saved["epoch"]), saved["best_state"]
        loop.records, loop.cpu_seconds = list(saved["records"]), float(saved["cpu_seconds"])
    except (RuntimeError, ValueError, TypeError, KeyError) as error:
        raise ValueError(f"{path}: not the state of this run ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}); overwrite=True starts over") from None
    report(f"resuming {path.parent} after epoch {loop.epoch} (best dev {config.spec.metric} "
           f"{loop.stopping.best:.2f} at epoch {loop.stopping.best_epoch})")
    return loop


# ---------------------------------------------------------------------------------------------
# Checkpoint: OUT/task_config.json (config, vocabularies, labels, the biLM) + task_model.safetensors
# ---------------------------------------------------------------------------------------------
RUN_CONFIG, RUN_WEIGHTS = "task_config.json", "task_model.safetensors"
RUN_LOCK = "task.lock"  # held by the process writing the run (`elmokit.tasks.api.train_into`)


def save_run(model, config: TaskConfig, vocabularies: Vocabularies, bilm: BiLM | None, out: Path) -> dict | None:
    """The task's own weights and everything needed to rebuild it. A frozen biLM is not copied:
    its name (or its path, relative to the run) and a fingerprint of its weights are recorded
    (`elmokit.tasks.bilm_ref`), and checked when the run is loaded. Returns that record."""
    tensors = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
    with atomic_path(out / RUN_WEIGHTS) as tmp:
        save_file(tensors, str(tmp))
    record = bilm_record(config.model, bilm, out) if config.model is not None else None
    saved = {"config": asdict(config), "vocab": vocabularies.words, "labels": vocabularies.labels,
             "chars": vocabularies.chars, "bilm": record, **software_versions()}
    atomic_write_text(out / RUN_CONFIG, json.dumps(saved) + "\n")
    return record
