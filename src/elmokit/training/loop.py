# Why this file is long: it is the training loop, visible in one place (setup, epochs, steps,
# evaluation, checkpoints, resume), as its docstring lays out; the pieces it calls live elsewhere.
"""Training an ELMo biLM on your own corpus: configuration, the loop, evaluation, resume.

The loop is visible: `train` calls `train_step` for each window of each epoch, `run_evaluation`
every `eval_every` steps and at the end of every epoch, and `save_training_checkpoint` every
`checkpoint_every` steps (and at once on SIGINT or SIGTERM, then it stops). The options are `TrainConfig` (train_config.py); the metrics, the
progress bar and the curves are in metrics.py. Everything needed to continue exactly where a run stopped (model, optimizer, schedule,
RNGs, the carried LSTM state and the data position of every rank) is in `checkpoint.pt`.

Several processes (`torchrun --nproc_per_node N -m elmokit train ...`): DistributedDataParallel,
gloo on CPU and nccl on GPU; rank r reads its own share of the corpus (`LMBatcher(rank,
world_size)`, or with data_split="rows" its rows of every global batch) and the per-rank batch is
`batch_size / world_size`. Losses are normalised by the token count of
the whole global batch, so N processes take the same steps as one process with the same batch.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elmokit.training import checkpoint as ckpt
from elmokit.model.config import ConfigError, ElmoConfig
from elmokit.model.weights import CONFIG_NAME
from elmokit.training.build import (build_model, build_optimizer, configure_device, padding_batch,
                                    products_precision, train_batches, valid_batches)
from elmokit.training.data import LMBatch
from elmokit.extras import MissingExtraError
from elmokit.training.lm import LanguageModel
from elmokit.model.lstm import LstmState
from elmokit.training.metrics import MetricsWindow, append_metrics, plot_curves, truncate_metrics
from elmokit.training.config import TrainConfig
from elmokit.training.processes import Dist, StopSignals, TrainingStopped, check_bf16, seed_everything, setup_distributed
from elmokit.training.corpus import count_targets
from elmokit.textfiles import expand_paths, same_files
from elmokit.progress import progress_bar

log = logging.getLogger(__name__)

METRICS_NAME = "metrics.jsonl"
CURVES_NAME = "curves.png"
TRAIN_CONFIG_NAME = "train_config.json"
BEST_DIR = "best"


# ---------------------------------------------------------------------------------------------
# One step, one evaluation
# ---------------------------------------------------------------------------------------------
@dataclass
class StepResult:
    loss: float  # mean of the two directions' mean NLL over the global batch (training softmax)
    n_tokens: int  # targets per direction in the global batch
    grad_norm: float
    state: LstmState


def train_step(model, optimizer, batch, state: LstmState | None, lr: float,
               config: TrainConfig, dist_: Dist) -> StepResult:
    """Forward, backward, clip, update for one window.

    The gradient is that of the summed NLL over the global window's positions (rows x unroll
    steps, all processes): every target weighs the same in every step, as in bilm-tf, whose
    windows are always full. Where the end of an epoch leaves a window part-empty (its rows run
    dry one after another: the last PTB window of 32 x 20 holds 4 targets), it takes a step in
    proportion; a mean over its targets instead gave those 4 the weight of a whole window, and on
    PTB the epoch's last steps sent the validation perplexity from 606 to 10,044 (issue 41's
    loss-curve runs). The reported loss is the mean NLL over the window's targets. Both are
    normalised by global counts, so every process count takes the same step."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    batch = _to_device(batch, dist_.device)
    with torch.autocast(dist_.device.type, dtype=torch.bfloat16, enabled=config.bf16):
        out = model(batch, state)
    n_targets, positions = dist_.all_sum([out.n_targets, batch.mask.numel()])
    summed = 0.5 * (out.forward_nll + out.backward_nll)
    loss = summed / max(n_targets, 1)  # what the metrics report
    language_model = getattr(model, "module", model)  # under DDP, the wrapped model
    kept = language_model.softmax.weight.grad if language_model.sparse_softmax_grad else None
    optimizer.zero_grad(set_to_none=True)
    if kept is not None:  # the (V, P) softmax gradient is kept, zeroed: the sampled rows' gradient
        language_model.softmax.weight.grad = kept.zero_()  # is added into it (GatherRows), no new one a step
    (summed / positions * dist_.world_size).backward()  # DDP averages gradients over ranks: undo the 1/N
    grad_norm = float(apply_gradients(model, optimizer, config))
    global_loss = dist_.all_sum([float(loss.detach())])[0]
    return StepResult(global_loss, int(n_targets), grad_norm, out.state)


def apply_gradients(model, optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.Tensor:
    """Clip the gradients to `grad_clip`'s global norm and take the optimizer's step; returns the
    norm before clipping, on the parameters' device (no host sync here: tests run it on `meta`)."""
    parameters = [p for p in model.parameters() if p.grad is not None]
    if config.grad_clip:
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, config.grad_clip)
    else:
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in parameters]))
    optimizer.step()
    return grad_norm


@torch.no_grad()
def evaluate(model: LanguageModel, batches, device: torch.device, dist_: Dist | None = None,
             bar=None) -> dict[str, float]:
    """Full-softmax perplexities over every token of `batches`, the state carried as in training.

    Returns forward_ppl, backward_ppl, ppl (exp of the mean of the two mean NLLs) and the counts.
    In float32 whatever the training's products (`lstm_bf16` too): the figure `elmo perplexity`
    gives for the saved model.
    """
    was_training, options = model.training, model.recurrence
    model.eval()
    model.recurrence = replace(options, lstm_bf16=False)
    sums = [0.0, 0.0, 0.0]  # forward nll, backward nll, targets per direction
    state = None
    for batch in batches:
        out = model(_to_device(batch, device), state)
        state = out.state
        for index, value in enumerate((out.forward_nll, out.backward_nll, out.n_targets)):
            sums[index] += float(value)
        if bar is not None:  # this rank's targets, times the ranks: the bar's total is the whole set's
            bar.update(int(out.n_targets) * (dist_.world_size if dist_ is not None else 1))
    if dist_ is not None:
        sums = dist_.all_sum(sums)
    model.train(was_training)
    model.recurrence = options
    forward, backward = sums[0] / max(sums[2], 1), sums[1] / max(sums[2], 1)
    return {"forward_ppl": math.exp(forward), "backward_ppl": math.exp(backward),
            "ppl": math.exp(0.5 * (forward + backward)), "n_tokens": int(sums[2])}


def _to_device(batch: LMBatch, device: torch.device) -> LMBatch:
    return batch if device.type == "cpu" else batch.to(device, non_blocking=True)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------
@dataclass
class Progress:
    """Counters and schedule, identical on every rank; saved in the checkpoint."""

    step: int = 0
    tokens: int = 0
    epoch: int = 0
    best_ppl: float = math.inf
    bad_evals: int = 0
    lr_scale: float = 1.0
    done: bool = False
    seconds: float = 0.0  # wall-clock time of the run, all its sessions (resumes) together

    def lr(self, config: TrainConfig) -> float:
        """The next step's lr: warm-up, constant (times `lr_decay` at each evaluation that does not
        improve), then from `anneal_start` linearly to 0 over `anneal_steps` (warmup-stable-decay)."""
        warmup = min(1.0, (self.step + 1) / config.warmup_steps) if config.warmup_steps else 1.0
        anneal = 1.0
        if config.anneal_steps and self.step >= config.anneal_start:
            anneal = max(0.0, 1.0 - (self.step - config.anneal_start) / config.anneal_steps)
        return config.lr * self.lr_scale * warmup * anneal


@dataclass
class Run:
    """Everything the loop carries: the configuration and the processes, the vocabulary, the model
    (and its DDP wrapper), the optimizer, the counters and the LSTM state carried between windows."""

    config: TrainConfig
    dist_: Dist
    out_dir: Path
    vocab: Any
    model: LanguageModel
    wrapped: torch.nn.Module
    optimizer: torch.optim.Optimizer
    progress: Progress
    state: LstmState | None = None
    data_state: dict | None = None  # the data position to continue from (a resumed run's first epoch)
    changed: dict | None = None  # settings a resume changed: {field: [checkpoint's, now]}, recorded once accepted
    window: MetricsWindow = field(default_factory=MetricsWindow)  # the steps since the last metrics line


def train(config: TrainConfig, resume: bool | str = False) -> Progress:
    """Train (or, with `resume`, continue) the run in `config.output_dir`; returns the counters.
    `resume="auto"` continues the run if its directory holds a checkpoint and starts it otherwise
    (`elmo train --auto-resume`: the one command line of a job that torchrun restarts)."""
    run = start_run(config, resume)
    config = run.config  # as the run decided it (absolute paths, its products' precision)
    shown = config.progress and run.dist_.is_main
    bar = progress_bar(total=training_total(config) if shown else None, initial=run.progress.tokens, unit="tokens",
                       unit_scale=True, desc="training", enabled=shown)
    with StopSignals() as stop:
        while run.progress.epoch < config.epochs and not run.progress.done:
            if run_epoch(run, bar, stop):
                run.progress.epoch += 1
                run.state = None  # the next epoch's rows start fresh
                with run.window.left_out():  # not in the next line's tokens_per_s, as in `run_epoch`
                    if config.valid_files and not (config.eval_every and run.progress.step % config.eval_every == 0):
                        run_evaluation(run.model, config, run.vocab, run.progress, run.out_dir, run.dist_, bar)
                with run.window.left_out():
                    save_training_checkpoint(run.out_dir, config, run.model, run.optimizer, run.progress, run.state,
                                             None, run.dist_, run.window)
    bar.close()
    if run.dist_.is_main and not config.valid_files:  # nothing to select on: the last model is the best
        ckpt.check_finite_weights(run.model, run.out_dir, run.progress.step)
        ckpt.save_model_dir(run.model, run.out_dir / BEST_DIR, config.vocab,
                            ckpt.provenance(asdict(config), asdict(run.progress), None))
    return run.progress


def start_run(config: TrainConfig, resume: bool | str) -> Run:
    """A fresh run in `config.output_dir` (its config files written), or, with `resume`, the run
    there as its checkpoint left it (model, optimizer, counters, RNGs, LSTM state, data position);
    `resume="auto"`: the one or the other as rank 0 finds a checkpoint there or not."""
    from elmokit.training.vocab import Vocabulary

    config = config.with_absolute_paths()  # its saved train_config.json names the same files from any folder
    config.check_paths()
    dist_ = setup_distributed(config)
    out_dir = Path(config.output_dir)
    vocab = Vocabulary.load(config.vocab)
    found = dist_.gather((out_dir / ckpt.CHECKPOINT_NAME).is_file())[0]  # rank 0's view decides for every rank
    if resume == "auto":  # (a rank deciding on its own view would enter other collectives than the rest)
        resume = found
    checkpoint = _resume_checkpoint(out_dir, config, dist_, vocab) if resume else None
    if checkpoint is None and found:
        raise ConfigError(f"{out_dir} already holds a run ({ckpt.CHECKPOINT_NAME}); "
                          "continue it with --resume or choose another --output-dir")
    config = products_precision(config, dist_.device,  # bfloat16 products by default where faster; saved as chosen
                                None if checkpoint is None else checkpoint.get("train_config") or {})
    if config.bf16 and dist_.is_main:
        check_bf16(dist_.device)
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    if checkpoint is None:
        model = build_model(config, vocab).to(dist_.device)
    else:  # the run's own shape (its config.json): --model / --init-from are not read again, the checkpoint
        _refuse_fixed_changes(checkpoint.get("train_config"), config)  # holds the weights they gave
        model = build_model(config, vocab, ElmoConfig.load(out_dir / "config.json")).to(dist_.device)
    model.sparse_softmax_grad = True  # train_step keeps the softmax weight's gradient between steps
    optimizer = build_optimizer(config, model)
    configure_device(config, model, dist_.device)
    wrapped = DistributedDataParallel(model) if dist_.world_size > 1 else model
    run = Run(config, dist_, out_dir, vocab, model, wrapped, optimizer, Progress())
    if dist_.is_main:  # what writers killed mid-write left (a lost worker's job), before writing again
        ckpt.remove_unfinished_writes(written_files(out_dir))
    if checkpoint is None:
        seed_everything(config.seed + dist_.rank)
        if dist_.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            config.save(out_dir / TRAIN_CONFIG_NAME)
            model.bilm.config.save(out_dir / "config.json")
            (out_dir / METRICS_NAME).unlink(missing_ok=True)
    else:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        run.progress = Progress(**checkpoint["progress"])
        budget = (checkpoint.get("train_config") or {}).get("max_tokens", 0)
        if run.progress.done and budget and run.progress.tokens >= budget:  # it ended on its token budget (not
            # on --patience, which stays final):
            if not config.max_tokens or run.progress.tokens < config.max_tokens:
                run.progress.done = False  # ... which this resume raised (or lifted)
            elif dist_.is_main:
                log.warning(f"{out_dir}: the run already ended on its token budget (--max-tokens "
                            f"{config.max_tokens:,}, {run.progress.tokens:,} tokens trained): raise it to train on")
        if "metrics_window" in checkpoint:  # older checkpoints: the first line after resuming covers fewer steps
            run.window.load_state_dict(checkpoint["metrics_window"])
        mine = checkpoint["ranks"][dist_.rank]
        ckpt.set_rng_state(mine["rng"])
        if mine["lstm_state"] is not None:
            run.state = LstmState(*(t.to(dist_.device) for t in mine["lstm_state"]))
        run.data_state = ckpt.from_plain(mine["data"])
        if dist_.is_main:
            truncate_metrics(out_dir / METRICS_NAME, run.progress.step)
        run.changed = _changed_settings(checkpoint.get("train_config"), config)
    model.train()
    return run


def written_files(out_dir: Path) -> list[Path]:
    """Every file a run writes (each through `elmokit.io.atomic_path`): its own and best/'s."""
    names = (ckpt.CHECKPOINT_NAME, TRAIN_CONFIG_NAME, CONFIG_NAME, METRICS_NAME, CURVES_NAME)
    return [out_dir / name for name in names] + [out_dir / BEST_DIR / name for name in ckpt.MODEL_DIR_FILES]


def training_total(config: TrainConfig) -> int:
    """The progress bar's total: targets of every epoch (counted by `count_targets`: a pass over
    the files' bytes), or `max_tokens` where that comes first."""
    corpus = config.epochs * count_targets(expand_paths(config.train_files))
    return min(corpus, config.max_tokens) if config.max_tokens else corpus


@functools.lru_cache(maxsize=4)
def validation_total(valid_files: tuple[str, ...]) -> int:
    """Targets of the validation files (counted once a run): the validation bar's total."""
    return count_targets(expand_paths(valid_files))


def run_epoch(run: Run, bar, stop: StopSignals) -> bool:
    """Train on this epoch's windows (from the saved position when resuming): True when the epoch
    is over, False when the run is done (max_tokens). A stop signal checkpoints and raises."""
    config, progress, dist_, window = run.config, run.progress, run.dist_, run.window
    started = time.perf_counter() - progress.seconds  # the clock goes on from the checkpoint's time
    batches = train_batches(config, run.vocab, progress.epoch, dist_)
    if run.data_state is not None:
        batches.load_state_dict(run.data_state)  # refuses settings that change the data
        run.data_state = None
    if run.changed:
        _log(run.out_dir, dist_, {"step": progress.step, "resumed_with": run.changed}, None)
        if dist_.is_main:
            config.save(run.out_dir / TRAIN_CONFIG_NAME)
        run.changed = None
    while (batch := next_batch(batches, config, dist_)) is not None:
        lr = progress.lr(config)  # this step's (the log line says the last step's, not the next one's)
        result = train_step(run.wrapped, run.optimizer, batch, run.state, lr, config, dist_)
        if not (math.isfinite(result.loss) and math.isfinite(result.grad_norm)):  # global figures: every rank stops
            raise ckpt.diverged(run.out_dir, progress.step + 1, f"the training loss is {_number(result.loss)}, "
                                f"its gradient's norm {_number(result.grad_norm)} (--lr {lr:g})")
        run.state = result.state
        progress.step += 1
        progress.tokens += result.n_tokens
        window.add(result.loss, result.grad_norm, result.n_tokens)
        bar.update(result.n_tokens)
        progress.seconds = time.perf_counter() - started
        if progress.step % config.log_every == 0:
            _log(run.out_dir, dist_, window.record(step=progress.step, tokens=progress.tokens, epoch=progress.epoch,
                                                   lr=lr, elapsed_s=round(progress.seconds, 1)), bar)
        due = bool(config.valid_files and config.eval_every) and progress.step % config.eval_every == 0
        spent = config.max_tokens and progress.tokens >= config.max_tokens
        if due or (spent and config.valid_files):  # the budget's last model too (an annealed run ends on its best)
            with window.left_out():  # validation and checkpoints: not in the next line's tokens_per_s
                run_evaluation(run.model, config, run.vocab, progress, run.out_dir, dist_, bar)
        progress.done = progress.done or bool(spent)
        stopping = stop.requested(dist_)
        if progress.step % config.checkpoint_every == 0 or progress.done or stopping:
            with window.left_out():
                save_training_checkpoint(run.out_dir, config, run.model, run.optimizer, progress, run.state, batches,
                                         dist_, window)
        if stopping:
            bar.close()
            raise TrainingStopped(f"{stop.name} at step {progress.step}: checkpoint written; "
                                  f"continue with --resume --output-dir {run.out_dir}")
        if progress.done:
            return False
    return True  # every process ran out of data: the epoch is over


def next_batch(batches, config: TrainConfig, dist_: Dist) -> LMBatch | None:
    """The next window of this process; None once every process has run out. A process whose
    share ends first takes padding windows, so that all of them keep taking steps together."""
    batch = next(batches, None)
    if dist_.world_size == 1:
        return batch
    if dist_.all_sum([batch is not None])[0] == 0:
        return None
    return batch if batch is not None else padding_batch(config.batch_size // dist_.world_size, config.unroll_steps)


def run_evaluation(model: LanguageModel, config: TrainConfig, vocab, progress: Progress, out_dir: Path,
                   dist_: Dist, bar) -> dict[str, float]:
    """Validation perplexities; keeps the best model, decays the lr and stops early as configured."""
    shown = config.progress and dist_.is_main
    valid_bar = progress_bar(total=validation_total(tuple(config.valid_files)) if shown else None,
                             unit="tokens", unit_scale=True, desc=f"validation at step {progress.step}",
                             leave=False, enabled=shown)
    with valid_bar:
        result = evaluate(model, valid_batches(config, vocab, dist_), dist_.device, dist_, valid_bar)
    record = {"step": progress.step, "tokens": progress.tokens, "epoch": progress.epoch,
              "elapsed_s": round(progress.seconds, 1), "valid_forward_ppl": result["forward_ppl"], "valid_backward_ppl": result["backward_ppl"],
              "valid_ppl": result["ppl"]}
    _log(out_dir, dist_, record, bar)
    if result["ppl"] < progress.best_ppl:
        progress.best_ppl, progress.bad_evals = result["ppl"], 0
        ckpt.check_finite_weights(model, out_dir, progress.step)
        if dist_.is_main:
            ckpt.save_model_dir(model, out_dir / BEST_DIR, config.vocab,
                                ckpt.provenance(asdict(config), asdict(progress), result))
    else:
        progress.bad_evals += 1
        progress.lr_scale *= config.lr_decay
        if config.patience and progress.bad_evals >= config.patience:
            progress.done = True
    if dist_.is_main:
        try:
            plot_curves(out_dir / METRICS_NAME, out_dir / CURVES_NAME)
        except MissingExtraError as error:  # metrics.jsonl holds the same numbers; shown once a run
            warnings.warn(f"{error}; training goes on without it", stacklevel=1)
    return result


def save_training_checkpoint(out_dir: Path, config: TrainConfig, model: LanguageModel, optimizer, progress: Progress,
                             state: LstmState | None, batches, dist_: Dist, window: MetricsWindow) -> None:
    """Write checkpoint.pt: shared parts once, and every rank's RNGs, carried state and data position;
    never weights that are not finite (every rank refuses alike, before any exchange)."""
    ckpt.check_finite_weights(model, out_dir, progress.step)
    mine = {"rng": ckpt.rng_state(),
            "lstm_state": None if state is None else [t.detach().cpu() for t in state],
            "data": ckpt.to_plain(batches.state_dict()) if batches is not None else None}
    ranks = [mine]
    if dist_.world_size > 1:  # gathered as torch.save bytes: plain values, read back weights_only
        buffer = io.BytesIO()
        torch.save(ckpt.to_plain(mine), buffer)
        gathered = [None] * dist_.world_size
        dist.all_gather_object(gathered, buffer.getvalue())
        ranks = [torch.load(io.BytesIO(data), weights_only=True) for data in gathered]
    if dist_.is_main:
        ckpt.save_checkpoint(out_dir / ckpt.CHECKPOINT_NAME, {
            "model": model.state_dict(), "optimizer": optimizer.state_dict(), "progress": asdict(progress),
            "metrics_window": window.state_dict(),
            "ranks": ranks, "elmo_config": model.bilm.config.to_dict(), "vocab_size": model.vocab_size,
            "vocab_sha256": _file_sha256(config.vocab), "train_config": asdict(config),
            "checkpoint_id": os.urandom(8).hex(),  # tells two writings of one step apart (check_ranks_agree)
        })
    if dist_.world_size > 1:
        dist.barrier()


def _resume_checkpoint(out_dir: Path, config: TrainConfig, dist_: Dist, vocab) -> dict[str, Any] | None:
    """The checkpoint to continue from, read by every rank from the same file: the ranks compare
    what they read (step and checkpoint id) and all refuse together if they differ or one failed."""
    path = out_dir / ckpt.CHECKPOINT_NAME
    try:
        if not path.exists():
            raise FileNotFoundError(f"--resume: no {ckpt.CHECKPOINT_NAME} in {out_dir}")
        checkpoint = ckpt.load_checkpoint(path)
        report: Any = (checkpoint["progress"]["step"], checkpoint.get("checkpoint_id"))
    except Exception as error:  # reported to every rank before it is raised: no rank waits on this one
        failure, report = error, f"{type(error).__name__}: {error}"
    ckpt.check_ranks_agree(path, dist_.gather(report), dist_.rank)
    if isinstance(report, str):
        raise failure
    saved_ranks = len(checkpoint["ranks"])
    if saved_ranks != dist_.world_size:
        raise ConfigError(f"{path} was written by {saved_ranks} processes; resume it with as many "
                          f"(got {dist_.world_size})")
    digest = checkpoint.get("vocab_sha256")  # older checkpoints lack it: then the size alone is compared
    if checkpoint["vocab_size"] != len(vocab) or (digest is not None and digest != _file_sha256(config.vocab)):
        trained_with = checkpoint.get("train_config", {}).get("vocab", "another file")
        raise ConfigError(f"--resume: {path} was trained with the vocabulary {trained_with} "
                          f"({checkpoint['vocab_size']:,} entries), not {config.vocab} ({len(vocab):,} entries"
                          f"{', other tokens' if checkpoint['vocab_size'] == len(vocab) else ''}); its softmax "
                          "rows belong to that vocabulary: resume with it")
    return checkpoint


def _number(value: float) -> str:
    """A figure of an error message: NaN as NaN, others as %g."""
    return "NaN" if math.isnan(value) else f"{value:g}"


def _file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


RUNTIME_FIELDS = ("threads", "progress", "device", "cuda_graph", "output_dir")  # how and where a run runs, not
# what it computes (its folder is where --resume found it, however spelt)
FIXED_ON_RESUME = ("model", "init_from", "init_from_original", "optimizer")  # the checkpoint holds what they made


def _refuse_fixed_changes(saved: dict | None, config: TrainConfig) -> None:
    """ConfigError where a resume changes the model's shape or start, or the optimizer: the
    checkpoint holds the weights and the optimizer state those made (checked before anything is
    built or rewritten)."""
    changed = {name: values for name, values in _changed_settings(saved, config).items() if name in FIXED_ON_RESUME}
    if changed:
        said = ", ".join(f"--{name.replace('_', '-')} {old!r}, now {new!r}" for name, (old, new) in changed.items())
        raise ConfigError(f"--resume: the run was made with {said}: its checkpoint holds the model and optimizer "
                          f"state they made; resume with them, or start a new run in another --output-dir")


def _changed_settings(saved: dict | None, config: TrainConfig) -> dict[str, list]:
    """The settings a resume changes (`--resume --eval-every 5000`), against what the checkpoint
    ran with: {field: [old, new]}; where and how the run runs (threads, progress bar, device, the
    spelling of its directory) is no change. Recorded in metrics.jsonl, with train_config.json
    rewritten, once the data state has accepted them (`run_epoch`)."""
    if saved is None:  # checkpoints from before the config was stored in them
        return {}
    changed = {}
    defaults = asdict(products_precision(TrainConfig(), torch.device("cpu"), {}))  # a field newer than the
    # checkpoint ran with its default (float32 products, for the options whose default a new run decides)
    for name, value in asdict(config).items():
        old = saved.get(name, defaults[name])
        if name in RUNTIME_FIELDS or old == value:
            continue
        if name in PATH_FIELDS and _same_paths(old, value):  # the same files, spelt another way
            continue
        changed[name] = [old, value]
    return changed


PATH_FIELDS = ("vocab", "train_files", "valid_files", "model", "init_from", "init_from_original")


def _same_paths(old: Any, new: Any) -> bool:
    """Whether two values of a path option name the same files however spelt (`..`, `~`, links; a
    relative one read from the working folder, as when a run saved before its paths were made
    absolute started; globs by the files they match)."""
    if isinstance(old, list) and isinstance(new, list):
        try:
            return same_files(expand_paths(old), expand_paths(new))
        except (OSError, ValueError):  # a pattern that matches nothing: compared as written
            return old == new
    return isinstance(old, str) and isinstance(new, str) and same_files([old], [new])


def _log(out_dir: Path, dist_: Dist, record: dict[str, Any], bar) -> None:
    if dist_.is_main:
        append_metrics(out_dir / METRICS_NAME, record, bar)
