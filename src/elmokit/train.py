"""Training an ELMo biLM on your own corpus: configuration, the loop, evaluation, resume.

The loop is visible: `train` calls `train_step` for each window of each epoch, `evaluate` every
`eval_every` steps and at the end of every epoch, and `save_checkpoint` every `checkpoint_every`
steps. Everything needed to continue exactly where a run stopped (model, optimizer, schedule,
RNGs, the carried LSTM state and the data position of every rank) is in `checkpoint.pt`.

Several processes (`torchrun --nproc_per_node N -m elmokit train ...`): DistributedDataParallel,
gloo on CPU and nccl on GPU; rank r reads its own share of the rows (`LMBatcher(rank, world_size)`)
and the per-rank batch is `batch_size / world_size`. Losses are normalised by the token count of
the whole global batch, so N processes take the same steps as one process with the same batch.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elmokit import checkpoint as ckpt
from elmokit.config import ConfigError, ElmoConfig
from elmokit.io import atomic_path, atomic_write_text
from elmokit.lm import LanguageModel
from elmokit.model import LstmState
from elmokit.weights import load_original, load_pretrained, read_safetensors, WEIGHTS_NAME

METRICS_NAME = "metrics.jsonl"
CURVES_NAME = "curves.png"
TRAIN_CONFIG_NAME = "train_config.json"
BEST_DIR = "best"


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """Everything a training run depends on; saved as `train_config.json` in the output dir.

    Defaults follow the original recipe (spec §13): Adagrad lr 0.2 with initial accumulator 1.0,
    global gradient norm 10, dropout 0.1, 20-token windows, sampled softmax with 8192 negatives.
    """

    output_dir: str = ""
    train_files: list[str] = field(default_factory=list)  # globs
    valid_files: list[str] = field(default_factory=list)  # globs
    vocab: str = ""  # one token per line, sorted by frequency, with <S>, </S>, <UNK>
    model: str = "small"  # a preset name or an ElmoConfig JSON file
    init_from: str = ""  # a native model dir (its softmax is kept if its vocab.txt is ours)
    init_from_original: list[str] = field(default_factory=list)  # [options.json, weights.hdf5]
    optimizer: str = "adagrad"  # or "adam"
    lr: float = 0.2
    initial_accumulator: float = 1.0  # Adagrad
    warmup_steps: int = 0  # linear warm-up of the learning rate
    lr_decay: float = 1.0  # multiply the lr by this after an evaluation that does not improve
    grad_clip: float = 10.0  # global gradient norm; 0 = none
    dropout: float = 0.1
    batch_size: int = 128  # global: rows of all processes together
    unroll_steps: int = 20
    epochs: int = 10
    max_tokens: int = 0  # stop after this many training tokens (0 = no budget)
    softmax: str = "sampled"  # or "full"
    n_samples: int = 8192  # negatives of the sampled softmax (capped below the vocabulary size)
    bf16: bool = False  # bfloat16 autocast
    seed: int = 0
    eval_every: int = 0  # steps between evaluations (0 = only at the end of each epoch)
    eval_batch_size: int = 64
    patience: int = 0  # stop after this many evaluations without improvement (0 = never)
    log_every: int = 10
    checkpoint_every: int = 100  # steps; a multiple of log_every
    device: str = "auto"  # "cpu", "cuda", "cuda:1", or "auto"
    threads: int = 0  # torch.set_num_threads (0 = torch's default)
    progress: bool = True

    def __post_init__(self) -> None:
        def require(condition: bool, message: str) -> None:
            if not condition:
                raise ConfigError(message)

        require(self.optimizer in ("adagrad", "adam"), f"optimizer must be adagrad or adam, got {self.optimizer!r}")
        require(self.softmax in ("sampled", "full"), f"softmax must be sampled or full, got {self.softmax!r}")
        for name in ("batch_size", "unroll_steps", "epochs", "log_every", "checkpoint_every", "eval_batch_size"):
            require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_tokens", "eval_every", "patience", "warmup_steps", "n_samples", "threads"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        require(self.lr > 0, f"lr must be > 0, got {self.lr}")
        require(0 < self.lr_decay <= 1, f"lr_decay must be in (0, 1], got {self.lr_decay}")
        require(0 <= self.dropout < 1, f"dropout must be in [0, 1), got {self.dropout}")
        require(self.grad_clip >= 0, f"grad_clip must be >= 0, got {self.grad_clip}")
        require(self.checkpoint_every % self.log_every == 0,
                f"checkpoint_every ({self.checkpoint_every}) must be a multiple of log_every ({self.log_every})")
        require(not (self.init_from and self.init_from_original), "give init_from or init_from_original, not both")
        require(len(self.init_from_original) in (0, 2),
                f"init_from_original needs [options.json, weights.hdf5], got {self.init_from_original}")

    def check_paths(self) -> None:
        """Raise a clear error for a missing output dir, vocabulary or corpus."""
        if not self.output_dir:
            raise ConfigError("output_dir is required (--output-dir)")
        if not self.train_files:
            raise ConfigError("train_files is required (--train FILE_OR_GLOB ...)")
        if not self.vocab:
            raise ConfigError("vocab is required (--vocab vocab.txt; build one with `elmo vocab`)")
        if not Path(self.vocab).is_file():
            raise FileNotFoundError(f"vocabulary file not found: {self.vocab}")

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> "TrainConfig":
        """Read a JSON file; `overrides` (e.g. from the command line) win over its values."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"training config not found: {path}") from None
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: not valid JSON ({error})") from error
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{path}: unknown training options {unknown}")
        return cls(**{**data, **overrides})

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(asdict(self), indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Processes and devices
# ---------------------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_sum(self, values: list[float]) -> list[float]:
        """The sum over all ranks of a few numbers (identity in a single process)."""
        if self.world_size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()


def setup_distributed(config: TrainConfig) -> Dist:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1)."""
    if config.threads:
        torch.set_num_threads(config.threads)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if config.device == "auto":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
            else torch.device("cpu")
    else:
        device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if config.batch_size % world_size:
        raise ConfigError(f"batch_size {config.batch_size} must be divisible by the {world_size} processes")
    return Dist(rank, world_size, device)


# ---------------------------------------------------------------------------------------------
# Building the model, the optimizer and the data
# ---------------------------------------------------------------------------------------------
def build_model(config: TrainConfig, vocab) -> LanguageModel:
    """A fresh LanguageModel, or one initialised from a trained biLM (domain adaptation)."""
    n_samples = config.n_samples if config.softmax == "sampled" else 0
    ignore = (vocab.bos_id, vocab.eos_id)  # <S> after </S> in a packed forward stream, and the mirror
    if config.init_from:
        bilm = load_pretrained(config.init_from)
        model = LanguageModel(bilm.config, len(vocab), config.dropout, n_samples, ignore)
        model.bilm.load_state_dict(bilm.state_dict())
        if _same_vocabulary(Path(config.init_from) / ckpt.VOCAB_NAME, Path(config.vocab)):
            softmax = read_safetensors(Path(config.init_from) / WEIGHTS_NAME, prefix="softmax.")
            if set(softmax) == {"weight", "bias"}:
                model.softmax.load_state_dict(softmax)
        return model
    if config.init_from_original:
        bilm = load_original(*config.init_from_original)
        model = LanguageModel(bilm.config, len(vocab), config.dropout, n_samples, ignore)
        model.bilm.load_state_dict(bilm.state_dict())
        return model
    elmo_config = ElmoConfig.from_name(config.model) if not config.model.endswith(".json") \
        else ElmoConfig.load(config.model)
    return LanguageModel(elmo_config, len(vocab), config.dropout, n_samples, ignore)


def _same_vocabulary(a: Path, b: Path) -> bool:
    return a.is_file() and a.read_bytes() == b.read_bytes()


def build_optimizer(config: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    if config.optimizer == "adagrad":
        return torch.optim.Adagrad(model.parameters(), lr=config.lr,
                                   initial_accumulator_value=config.initial_accumulator)
    return torch.optim.Adam(model.parameters(), lr=config.lr)


def train_batches(config: TrainConfig, vocab, epoch: int, dist_: Dist):
    """This rank's LMBatcher for one epoch (rows rank::world_size of the global batch)."""
    from elmokit.data import LMBatcher

    return LMBatcher(config.train_files, vocab, config.batch_size // dist_.world_size, config.unroll_steps,
                     seed=config.seed + epoch, rank=dist_.rank, world_size=dist_.world_size, shuffle=True)


def eval_batches(files: list[str], vocab, batch_size: int, unroll_steps: int, rank: int = 0, world_size: int = 1):
    """Every token of `files` once, in order (no shuffle)."""
    from elmokit.data import LMBatcher

    return LMBatcher(files, vocab, batch_size, unroll_steps, seed=0, rank=rank, world_size=world_size,
                     shuffle=False)


# ---------------------------------------------------------------------------------------------
# One step, one evaluation
# ---------------------------------------------------------------------------------------------
@dataclass
class StepResult:
    loss: float  # mean of the two directions' mean NLL over the global batch (training softmax)
    n_tokens: int  # global targets counted (both directions averaged)
    grad_norm: float
    state: LstmState


def train_step(model, optimizer, batch, state: LstmState | None, lr: float,
               config: TrainConfig, dist_: Dist) -> StepResult:
    """Forward, backward, clip, update for one window; the loss is normalised by the global
    token counts so that every process count takes the same step."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    batch = _to_device(batch, dist_.device)
    with torch.autocast(dist_.device.type, dtype=torch.bfloat16, enabled=config.bf16):
        out = model(batch, state)
    forward_count, backward_count = dist_.all_sum([out.forward_count, out.backward_count])
    loss = 0.5 * (out.forward_nll / max(forward_count, 1) + out.backward_nll / max(backward_count, 1))
    optimizer.zero_grad(set_to_none=True)
    (loss * dist_.world_size).backward()  # DDP averages gradients over ranks: undo the 1/N
    parameters = [p for p in model.parameters() if p.grad is not None]
    if config.grad_clip:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, config.grad_clip))
    else:
        grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in parameters])))
    optimizer.step()
    global_loss = dist_.all_sum([float(loss.detach())])[0]
    return StepResult(global_loss, int(0.5 * (forward_count + backward_count)), grad_norm, out.state)


@torch.no_grad()
def evaluate(model: LanguageModel, batches, device: torch.device, dist_: Dist | None = None) -> dict[str, float]:
    """Full-softmax perplexities over every token of `batches`, the state carried as in training.

    Returns forward_ppl, backward_ppl, ppl (exp of the mean of the two mean NLLs) and the counts.
    """
    was_training = model.training
    model.eval()
    sums = [0.0, 0.0, 0.0, 0.0]  # forward nll, backward nll, forward count, backward count
    state = None
    for batch in batches:
        out = model(_to_device(batch, device), state)
        state = out.state
        for index, value in enumerate((out.forward_nll, out.backward_nll, out.forward_count, out.backward_count)):
            sums[index] += float(value)
    if dist_ is not None:
        sums = dist_.all_sum(sums)
    model.train(was_training)
    forward = sums[0] / max(sums[2], 1)
    backward = sums[1] / max(sums[3], 1)
    return {"forward_ppl": math.exp(forward), "backward_ppl": math.exp(backward),
            "ppl": math.exp(0.5 * (forward + backward)), "n_tokens": int(sums[2])}


def _to_device(batch, device: torch.device):
    if device.type == "cpu":
        return batch
    names = ("forward_char_ids", "backward_char_ids", "forward_targets", "backward_targets", "mask")
    moved = {name: getattr(batch, name).to(device, non_blocking=True) for name in names}
    return type(batch)(**{**batch.__dict__, **moved})
