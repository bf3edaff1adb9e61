"""What a training run is made of: the language model (fresh, or initialised from a native or an
original model), the optimizer, and the windows of the training and validation data."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import torch

from elmokit.model.chars import MAX_CHARS
from elmokit.model.config import ConfigError, ElmoConfig
from elmokit.model.weights import WEIGHTS_NAME, load_original, load_pretrained, read_safetensors
from elmokit.model.bilm import BiLM
from elmokit.model.builtin import BUILTIN_MODEL, builtin_model_dir
from elmokit.sources import tfhub
from elmokit.sources.loading import load_model
from elmokit.training import checkpoint as ckpt
from elmokit.training.config import TrainConfig
from elmokit.training.data import LMBatch, LMBatcher, eval_batches
from elmokit.training.lm import LanguageModel
from elmokit.training.processes import Dist
from elmokit.training.recurrence import RecurrenceOptions

_TENSOR_NAMES = ("forward_char_ids", "backward_char_ids", "forward_targets", "backward_targets", "mask")

# ---------------------------------------------------------------------------------------------
# Building the model, the optimizer and the data
# ---------------------------------------------------------------------------------------------
def build_model(config: TrainConfig, vocab, shape: ElmoConfig | None = None) -> LanguageModel:
    """A fresh LanguageModel, or one initialised from a trained biLM (domain adaptation); with
    `shape`, a LanguageModel of that biLM shape whose weights are to be loaded (a resumed run:
    nothing is read from --model or --init-from)."""
    n_samples = config.n_samples if config.softmax == "sampled" else 0
    if shape is not None:
        return LanguageModel(shape, len(vocab), config.dropout, n_samples)
    if config.init_from:
        bilm, folder = initial_bilm(config.init_from)
        model = LanguageModel(bilm.config, len(vocab), config.dropout, n_samples)
        model.bilm.load_state_dict(bilm.state_dict())
        if folder is not None and _same_vocabulary(folder / ckpt.VOCAB_NAME, Path(config.vocab)):
            softmax = read_safetensors(folder / WEIGHTS_NAME, prefix="softmax.")
            if set(softmax) == {"weight", "bias"}:
                model.softmax.load_state_dict(softmax)
        return model
    if config.init_from_original:
        bilm = load_original(*config.init_from_original)
        model = LanguageModel(bilm.config, len(vocab), config.dropout, n_samples)
        model.bilm.load_state_dict(bilm.state_dict())
        return model
    elmo_config = ElmoConfig.from_name(config.model) if not config.model.endswith(".json") \
        else ElmoConfig.load(config.model)
    return LanguageModel(elmo_config, len(vocab), config.dropout, n_samples)


def initial_bilm(reference: str) -> tuple[BiLM, Path | None]:
    """`--init-from`'s biLM, and the native folder it came from (None for a TF-Hub module): a native
    model folder (the built-in model's by its name), or a TF-Hub ELMo module folder or .tar.gz."""
    module = tfhub.module_folder(reference)
    if module is not None:
        return tfhub.load_tfhub_module(module), None
    path = builtin_model_dir() if reference == BUILTIN_MODEL else Path(reference).expanduser()
    if path.is_dir() and tfhub.looks_like_module_folder(path):
        return load_model(path), None  # a module folder missing a part: its error names the part
    if path.is_dir():
        return load_pretrained(path), path  # its own errors name what the folder lacks
    raise FileNotFoundError(f"--init-from {reference}: no such folder or module archive; it takes a native model "
                            f"folder (a run's best/, {BUILTIN_MODEL!r}, or a published model written by `elmo convert "
                            "--model NAME --to-native DIR`) or a TF-Hub ELMo module folder or .tar.gz")


def _same_vocabulary(a: Path, b: Path) -> bool:
    return a.is_file() and a.read_bytes() == b.read_bytes()


_FUSED_KERNELS = {"adagrad": "aten::_fused_adagrad_", "adam": "aten::_fused_adam_"}


def has_fused_kernel(optimizer: str, device: torch.device) -> bool:
    """Whether `optimizer` runs as torch's fused kernel on `device`: on the CPU only, where the
    torch in use has one (asked of its dispatcher). Off the CPU torch's foreach path runs: torch
    2.11's CUDA build registers a fused Adagrad kernel that its own Adagrad then refuses at the
    first step (seen on an H200 by scripts/gpu_check.sh), and a fused kernel is one more choice
    that would make a GPU compute what the CPU does not."""
    if device.type != "cpu":
        return False
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return (device.type in _get_fused_kernels_supported_devices()  # what torch's optimizers accept
                and torch._C._dispatch_has_kernel_for_dispatch_key(_FUSED_KERNELS[optimizer], device.type.upper()))
    except (ImportError, AttributeError, RuntimeError):  # a torch without these private queries: the safe path
        return False


def build_optimizer(config: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Adagrad (bilm-tf's) or Adam, as torch's fused kernel where the parameters' device has one
    (one pass over all parameters instead of a dozen elementwise ops each), else torch's foreach
    kernels (`has_fused_kernel`)."""
    parameters = list(model.parameters())
    fused = all(has_fused_kernel(config.optimizer, p.device) for p in parameters)
    if config.optimizer == "adagrad":
        return torch.optim.Adagrad(parameters, lr=config.lr, initial_accumulator_value=config.initial_accumulator,
                                   fused=fused)
    return torch.optim.Adam(parameters, lr=config.lr, fused=fused)


BF16_PRODUCTS = ("lstm_bf16", "softmax_bf16")  # the options whose default the run decides (`products_precision`)


def products_precision(config: TrainConfig, device: torch.device, resumed: dict | None = None) -> TrainConfig:
    """`config` with `lstm_bf16` and `softmax_bf16` decided where they were left unset (None): a new
    run takes bfloat16 products on a CPU with native bfloat16 products (AVX512-BF16 or AMX: faster
    than float32 there, its loss curve within float32's own run-to-run noise:
    bench/results/train-lstm-bf16.md, train-bf16-both-curve.md) and float32 elsewhere (a GPU, a CPU
    without them, where bfloat16 is emulated and slower); a resumed run what it ran with (`resumed`,
    its checkpoint's options: float32 where they predate the option)."""
    unset = [name for name in BF16_PRODUCTS if getattr(config, name) is None]
    if not unset:
        return config
    if resumed is not None:
        return dataclasses.replace(config, **{name: bool(resumed.get(name) or False) for name in unset})
    from elmokit.kernels import bf16_native

    native = device.type == "cpu" and bf16_native()
    return dataclasses.replace(config, **{name: native for name in unset})


def configure_device(config: TrainConfig, model: LanguageModel, device: torch.device) -> None:
    """The run's device options: how the LSTM's products run (`RecurrenceOptions`: both
    directions batched off the CPU, `lstm_bf16`, `cuda_graph` on a CUDA GPU), the training
    softmax's products' dtype (`softmax_bf16`: `LanguageModel.softmax_dtype`), and on a CUDA GPU
    whether float32 products may use TF32 (`tf32`; off by default, so that a GPU computes what the
    CPU does: torch's matmuls default to full float32, its cuDNN convolutions to TF32). The
    CUDA-only options are ignored elsewhere, with a warning."""
    config = products_precision(config, device)  # a run's config comes decided; one made here may leave them unset
    cuda = device.type == "cuda"
    model.recurrence = RecurrenceOptions(lstm_bf16=config.lstm_bf16, cuda_graph=config.cuda_graph and cuda)
    model.softmax_dtype = torch.bfloat16 if config.softmax_bf16 else None
    if cuda:
        torch.set_float32_matmul_precision("high" if config.tf32 else "highest")
        torch.backends.cudnn.allow_tf32 = config.tf32
    elif config.tf32 or config.cuda_graph:
        asked = " and ".join(name for name in ("tf32", "cuda_graph") if getattr(config, name))
        warnings.warn(f"{asked} apply to a CUDA GPU only; the run is on {device}, where they change nothing",
                      stacklevel=2)
    asked = [name for name in BF16_PRODUCTS if getattr(config, name)]
    if asked and device.type == "cpu":
        from elmokit.kernels import bf16_native

        if not bf16_native():
            flags = " and ".join(f"--{name.replace('_', '-')}" for name in asked)
            warnings.warn(f"{' and '.join(asked)} {'is' if len(asked) == 1 else 'are'} slower than float32 on this "
                          f"CPU (no native bfloat16 products: AVX512-BF16 or AMX); train without {flags}",
                          stacklevel=2)


def train_batches(config: TrainConfig, vocab, epoch: int, dist_: Dist):
    """This rank's windows of one epoch; per-rank batch = batch_size / world_size."""
    if config.data_split == "rows" and dist_.world_size > 1:
        return RowShard(LMBatcher(config.train_files, vocab, config.batch_size, config.unroll_steps,
                                  seed=config.seed, epoch=epoch), dist_.rank, dist_.world_size)
    return LMBatcher(config.train_files, vocab, config.batch_size // dist_.world_size, config.unroll_steps,
                     seed=config.seed, epoch=epoch, rank=dist_.rank, world_size=dist_.world_size)


def valid_batches(config: TrainConfig, vocab, dist_: Dist):
    """This rank's share of every validation token, in file order."""
    if config.data_split == "rows" and dist_.world_size > 1:
        return RowShard(eval_batches(config.valid_files, vocab, config.eval_batch_size, config.unroll_steps),
                        dist_.rank, dist_.world_size)
    return eval_batches(config.valid_files, vocab, config.eval_batch_size, config.unroll_steps,
                        rank=dist_.rank, world_size=dist_.world_size)


class RowShard:
    """Rows rank, rank + world_size, ... of every window of a batcher of the global batch."""

    def __init__(self, batcher: LMBatcher, rank: int, world_size: int):
        if batcher.batch_size % world_size:
            raise ConfigError(f"batch size {batcher.batch_size} must be divisible by the {world_size} processes")
        self.batcher, self.rows = batcher, slice(rank, None, world_size)

    def __iter__(self) -> "RowShard":
        return self

    def __next__(self) -> LMBatch:
        batch = next(self.batcher)
        parts = {name: getattr(batch, name)[self.rows] for name in _TENSOR_NAMES}
        return LMBatch(**parts, n_tokens=int(parts["mask"].sum()))

    def state_dict(self) -> dict[str, Any]:
        return self.batcher.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batcher.load_state_dict(state)


def padding_batch(batch_size: int, unroll_steps: int) -> LMBatch:
    """A window without data (mask all False), for a process whose share ran out before the others'."""
    char_ids = torch.zeros(batch_size, unroll_steps, MAX_CHARS, dtype=torch.long, device="cpu")
    targets = torch.zeros(batch_size, unroll_steps, dtype=torch.long, device="cpu")
    mask = torch.zeros(batch_size, unroll_steps, dtype=torch.bool, device="cpu")
    return LMBatch(char_ids, char_ids, targets, targets, mask, 0)
