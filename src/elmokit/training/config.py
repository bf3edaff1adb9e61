"""The typed configuration of a training run (`elmo train`): one dataclass, JSON on disk.

Every field is also a command-line option of `elmo train` (generated from the fields and their
help texts), and the run saves it as `train_config.json` beside its checkpoint.
"""

from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from elmokit.jsonfiles import read_json
from elmokit.model.config import ConfigError
from elmokit.training.corpus import require_tokens
from elmokit.textfiles import expand_paths
from elmokit.devices import check_device_name, max_threads
from elmokit.io import atomic_write_text

_TYPES = {  # a field's declared type -> (does a value have it, how messages name it)
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, float) and math.isfinite(v), "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "bool | None": (lambda v: v is None or isinstance(v, bool), "true, false or null (the default: decided by the run)"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "list[str]": (lambda v: isinstance(v, list) and all(isinstance(item, str) for item in v), "a list of strings"),
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _field(default: Any, help: str) -> Any:
    """A TrainConfig field with its help text (the command line is generated from the fields)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


MAX_UNROLL_STEPS = 4096  # tokens a row per window: activations for backpropagation grow with it


@dataclass
class TrainConfig:
    """Everything a training run depends on; saved as `train_config.json` in the output dir.

    Defaults follow the original recipe (bilm-tf's): Adagrad lr 0.2 with initial accumulator 1.0,
    global gradient norm 10, dropout 0.1, 20-token windows, sampled softmax with 8192 negatives.
    """

    output_dir: str = _field("", "directory of the run: checkpoint, metrics, curves, best model")
    train_files: list[str] = _field([], "training corpus: files or globs, one tokenized sentence a line")
    valid_files: list[str] = _field([], "validation files or globs (perplexity, best model, early stop)")
    vocab: str = _field("", "vocab.txt of the softmax (from `elmo vocab`), sorted by frequency")
    model: str = _field("small", "a preset name (gutenberg-cpu: the built-in model's shape, the one that trains fast on a "
                                 "CPU; small, medium, original: the released shapes) or an ElmoConfig JSON file")
    init_from: str = _field("", "start from a native model dir (its softmax is kept if its vocab.txt is ours) or a TF-Hub "
                                "ELMo module folder or .tar.gz (docs/loading.md)")
    init_from_original: list[str] = _field([], "start from an original OPTIONS.json WEIGHTS.hdf5 (new softmax)")
    optimizer: str = _field("adagrad", "adagrad (the original) or adam")
    lr: float = _field(0.2, "learning rate")
    initial_accumulator: float = _field(1.0, "Adagrad's initial accumulator value")
    warmup_steps: int = _field(0, "linear learning-rate warm-up over this many steps")
    lr_decay: float = _field(1.0, "multiply the lr by this after an evaluation without improvement")
    anneal_start: int = _field(0, "from this step on the lr falls linearly to 0 over anneal_steps (0 = never)")
    anneal_steps: int = _field(0, "the length of that fall, in steps (the last part of a run's budget)")
    grad_clip: float = _field(10.0, "clip gradients to this global norm (0 = no clipping)")
    dropout: float = _field(0.1, "dropout on every LSTM input and on the softmax input")
    batch_size: int = _field(128, "rows of a global batch (all processes together)")
    unroll_steps: int = _field(20, "tokens a row per window (truncated backpropagation through time)")
    epochs: int = _field(10, "passes over the training files")
    max_tokens: int = _field(0, "stop after this many training tokens (0 = no budget)")
    softmax: str = _field("sampled", "sampled (training only; evaluation is always full) or full")
    n_samples: int = _field(8192, "negatives of the sampled softmax (full softmax if >= the vocabulary)")
    bf16: bool = _field(False, "bfloat16 autocast of the token encoder's highway and projection (the char CNN, "
                               "the LSTM and the softmax stay float32)")
    lstm_bf16: bool | None = _field(None, "the LSTM's products in bfloat16 (both directions in one batched "
                                          "product: oneDNN's on a CPU with AVX512-BF16 or AMX), its cell and recurrent "
                                          "state, gates, sums and master weights in float32. Unset: on where the run's "
                                          "CPU has native bfloat16 products (AVX512-BF16 or AMX), float32 elsewhere "
                                          "(a GPU, a CPU without them); the run records what it chose")
    softmax_bf16: bool | None = _field(None, "the training softmax's products in bfloat16 (the logits, the hidden "
                                             "states' and the weight's gradients, operands and results rounded to "
                                             "bfloat16, summed in float32 inside oneDNN's kernels on a CPU with "
                                             "AVX512-BF16 or AMX); the bias, the softmax and the loss in float32; "
                                             "evaluation stays float32. Unset: as lstm_bf16's")
    tf32: bool = _field(False, "CUDA only: float32 products on TF32 tensor cores (torch.backends "
                               "allow_tf32; faster, ~1e-3 relative error a product); ignored on the CPU")
    cuda_graph: bool = _field(False, "CUDA only: replay each LSTM layer's forward and backward from CUDA graphs "
                                     "captured once (static window shapes); ignored on the CPU")
    seed: int = _field(0, "seed of the weights, the dropout, the sampler and the data order")
    deterministic: bool = _field(False, "deterministic kernels only (torch.use_deterministic_algorithms, "
                                        "CUBLAS_WORKSPACE_CONFIG): a resumed run exact on CUDA too; slower there")
    data_split: str = _field("files", "how processes share the corpus: files (each reads its own shards "
                              "or lines) or rows (each reads everything and keeps its rows of the global "
                              "batch: the same batches whatever the number of processes)")
    eval_every: int = _field(0, "steps between evaluations (0 = at the end of each epoch only)")
    eval_batch_size: int = _field(64, "rows of an evaluation batch")
    patience: int = _field(0, "stop after this many evaluations without improvement (0 = never)")
    log_every: int = _field(10, "steps between lines of metrics.jsonl")
    checkpoint_every: int = _field(100, "steps between checkpoints (a multiple of log_every)")
    device: str = _field("auto", "cpu, cuda, cuda:N, or auto (the GPU when torch sees one, else the CPU; "
                                 "ELMOKIT_DEVICE changes the default)")
    threads: int = _field(0, "torch.set_num_threads (0 = torch's default)")
    progress: bool = _field(True, "show a progress bar")

    def __post_init__(self) -> None:
        def require(condition: bool, message: str) -> None:
            if not condition:
                raise ConfigError(message)

        self._check_types()
        require(self.optimizer in ("adagrad", "adam"), f"optimizer must be adagrad or adam, got {self.optimizer!r}")
        require(self.softmax in ("sampled", "full"), f"softmax must be sampled or full, got {self.softmax!r}")
        require(self.data_split in ("files", "rows"), f"data_split must be files or rows, got {self.data_split!r}")
        for name in ("batch_size", "unroll_steps", "epochs", "log_every", "checkpoint_every", "eval_batch_size"):
            require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("max_tokens", "eval_every", "patience", "warmup_steps", "anneal_start", "anneal_steps",
                     "n_samples", "threads"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        require(self.unroll_steps <= MAX_UNROLL_STEPS, f"unroll_steps must be at most {MAX_UNROLL_STEPS} (memory "
                f"grows with the window; bilm-tf trained with 20), got {self.unroll_steps}")
        require(not self.max_tokens or self.unroll_steps <= self.max_tokens,
                f"unroll_steps ({self.unroll_steps}) must be at most max_tokens ({self.max_tokens}): one step "
                "trains a window of unroll_steps tokens a row, past the token budget")
        require(self.threads <= max_threads(), f"threads must be at most {max_threads()} (4 a CPU core of this "
                f"machine, at least 64), got {self.threads}")
        require(0 <= self.seed < 2 ** 32, f"seed must be in [0, 2**32) (the range torch seeds), got {self.seed}")
        require(self.lr > 0, f"lr must be > 0, got {self.lr}")
        require(0 < self.lr_decay <= 1, f"lr_decay must be in (0, 1], got {self.lr_decay}")
        require((self.anneal_start > 0) == (self.anneal_steps > 0),
                f"anneal_start and anneal_steps go together (both > 0, or both 0), got {self.anneal_start} "
                f"and {self.anneal_steps}")
        require(0 <= self.dropout < 1, f"dropout must be in [0, 1), got {self.dropout}")
        require(self.grad_clip >= 0, f"grad_clip must be >= 0, got {self.grad_clip}")
        require(self.checkpoint_every % self.log_every == 0,
                f"checkpoint_every ({self.checkpoint_every}) must be a multiple of log_every ({self.log_every})")
        try:
            check_device_name(self.device)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        require(not (self.init_from and self.init_from_original), "give init_from or init_from_original, not both")
        require(len(self.init_from_original) in (0, 2),
                f"init_from_original needs [options.json, weights.hdf5], got {self.init_from_original}")

    def _check_types(self) -> None:
        """Every field of the type it is declared with (a JSON file can hold anything): `"8"`,
        `null`, `1.5` or `true` for an int is refused, an int for a float is taken as a float."""
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.type == "float" and _is_number(value):
                value = float(value)
                setattr(self, spec.name, value)
            has_type, type_name = _TYPES[spec.type]
            if not has_type(value):
                raise ConfigError(f"{spec.name} must be {type_name}, got {json.dumps(value, default=repr)}")

    def with_absolute_paths(self) -> "TrainConfig":
        """This config with its files as absolute paths (a relative one read from the working folder
        now, `..` and `~` resolved), so that the run's saved train_config.json names the same files
        when it is resumed from another folder; a glob keeps its own pattern after the working
        folder's name (that one escaped). A name stays a name: a preset `model` (not a .json file),
        the built-in model or a URL as `init_from`, URLs in `init_from_original`."""
        from elmokit.model.builtin import BUILTIN_MODEL
        from elmokit.sources.download import is_url

        def absolute(path: str) -> str:
            return os.path.abspath(os.path.expanduser(path)) if path else path

        def absolute_pattern(pattern: str) -> str:  # read as a glob (`expand_paths`): the folder's name escaped
            expanded = os.path.expanduser(pattern)
            return os.path.normpath(expanded if os.path.isabs(expanded) else
                                    os.path.join(glob.escape(os.getcwd()), expanded))

        def absolute_unless_named(path: str) -> str:
            return path if path == BUILTIN_MODEL or is_url(path) else absolute(path)

        return replace(self, output_dir=absolute(self.output_dir), vocab=absolute(self.vocab),
                       train_files=[absolute_pattern(p) for p in self.train_files],
                       valid_files=[absolute_pattern(p) for p in self.valid_files],
                       model=absolute(self.model) if self.model.endswith(".json") else self.model,
                       init_from=absolute_unless_named(self.init_from),
                       init_from_original=[absolute_unless_named(p) for p in self.init_from_original])

    def check_paths(self) -> None:
        """Raise a clear error for a missing output dir, vocabulary or corpus, or a corpus
        without a single token."""
        if not self.output_dir:
            raise ConfigError("output_dir is required (--output-dir)")
        if not self.train_files:
            raise ConfigError("train_files is required (--train FILE_OR_GLOB ...)")
        if not self.vocab:
            raise ConfigError("vocab is required (--vocab vocab.txt; build one with `elmo vocab`)")
        if not Path(self.vocab).is_file():
            raise FileNotFoundError(f"vocabulary file not found: {self.vocab}")
        require_tokens(expand_paths(self.train_files), "the training corpus (--train)")
        if self.valid_files:
            require_tokens(expand_paths(self.valid_files), "the validation corpus (--valid)")

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> "TrainConfig":
        """Read a JSON file; `overrides` (e.g. from the command line) win over its values."""
        path = Path(path)
        try:
            data = read_json(path)  # JSONFileError (a ValueError) naming the file: bad JSON, UTF-8, nesting
        except FileNotFoundError:
            raise FileNotFoundError(f"training config not found: {path}") from None
        except IsADirectoryError:
            raise IsADirectoryError(f"training config is a directory, expected a JSON file: {path}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object of training options, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{path}: unknown training options {unknown}")
        try:
            return cls(**{**data, **overrides})
        except ConfigError as error:  # messages start with the option's name: name the file if it set it
            if str(error).split(" ", 1)[0] in overrides:
                raise
            raise ConfigError(f"{path}: {error}") from None

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(asdict(self), indent=2) + "\n")
