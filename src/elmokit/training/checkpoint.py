"""Training checkpoints and trained-model directories.

    checkpoint.pt   everything `elmo train --resume` needs: model, optimizer, schedule, counters,
                    every RNG, and per rank the carried LSTM state and the exact data position.
                    Written by torch.save, read with `torch.load(weights_only=True)`: only tensors
                    and plain Python values, never arbitrary pickled objects.
    a model dir     config.json + model.safetensors (the biLM and `softmax.*`) + vocab.txt
                    + provenance.json (what made it, and which elmokit and torch) + README.md
                    (its model card): what `elmo perplexity`, `elmo export`, `--init-from` and
                    every embedding command read.

Every file is written to a temporary name and renamed into place (`elmokit.io.atomic_path`).
"""

from __future__ import annotations

import errno
import json
import random
import shutil
import warnings
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elmokit.model.config import ConfigError, ElmoConfig
from elmokit.io import atomic_path, atomic_write_text, unfinished_writes
from elmokit.training.lm import LanguageModel
from elmokit.training.metrics import read_metrics
from elmokit.training.model_card import CARD_NAME, software_versions, write_bilm_card
from elmokit.model.errors import check_finite
from elmokit.model.weights import (CONFIG_NAME, PROVENANCE_NAME, WEIGHTS_NAME, WeightFileError, load_pretrained,
                                   read_safetensors, save_pretrained)

CHECKPOINT_NAME = "checkpoint.pt"
VOCAB_NAME = "vocab.txt"
MODEL_DIR_FILES = (CONFIG_NAME, WEIGHTS_NAME, VOCAB_NAME, PROVENANCE_NAME, CARD_NAME)  # what save_model_dir writes
_NDARRAY = "__ndarray__"


# ---------------------------------------------------------------------------------------------
# Plain values only: numpy arrays travel as tensors tagged with their dtype
# ---------------------------------------------------------------------------------------------
def to_plain(value: Any) -> Any:
    """Turn numpy arrays and scalars (e.g. in a batcher's or an RNG's state) into tensors and
    Python numbers, so that `torch.load(weights_only=True)` can read them back."""
    if isinstance(value, np.ndarray):
        return {_NDARRAY: torch.from_numpy(np.ascontiguousarray(value).copy()), "dtype": str(value.dtype)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {key: to_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_plain(item) for item in value)
    return value


def from_plain(value: Any) -> Any:
    """The inverse of `to_plain`."""
    if isinstance(value, dict):
        if _NDARRAY in value:
            return value[_NDARRAY].numpy().astype(value["dtype"], copy=False)
        return {key: from_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(from_plain(item) for item in value)
    return value


def rng_state() -> dict[str, Any]:
    """The state of every random generator training uses (Python, NumPy, torch CPU and CUDA)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return to_plain(state)


def set_rng_state(state: dict[str, Any]) -> None:
    state = from_plain(state)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------
# checkpoint.pt
# ---------------------------------------------------------------------------------------------
def save_checkpoint(path: str | Path, checkpoint: dict[str, Any]) -> None:
    """Atomically write a checkpoint dictionary of tensors and plain values. A failed write (a
    full disk, a quota) is an OSError naming the file and the space left, not torch's RuntimeError;
    the previous checkpoint stays in place."""
    with atomic_path(path) as tmp:
        try:
            torch.save(to_plain(checkpoint), tmp)
        except RuntimeError as error:  # torch's zip writer reports a failed write(2) this way
            if "inline_container" not in str(error) and "write" not in str(error):
                raise
            raise _write_error(Path(path), error) from error


def _write_error(path: Path, error: RuntimeError) -> OSError:
    """What a failed torch.save of `path` means, in one line: the file, the disk, its free space."""
    try:
        free = f"{shutil.disk_usage(path.parent).free:,} bytes free"
    except OSError:
        free = "free space unknown"
    first_line = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    failure = OSError(f"{path}: could not write the checkpoint ({first_line}); is the disk full or over its "
                      f"quota? ({free} on the disk of {path.parent}; the previous checkpoint is unchanged)")
    failure.errno = errno.EIO  # a failed write (torch does not say which): the machine, not the request
    return failure


def load_checkpoint(path: str | Path, required: tuple[str, ...] = ("model", "elmo_config", "vocab_size"),
                    what: str = "an elmokit training checkpoint") -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint` (no arbitrary unpickling): `what`, holding
    the keys `required` (by default, a biLM training run's). Refused (WeightFileError naming the
    file) where a member's bytes fail their CRC-32 (`check_crcs`) or a weight of its "model" is
    NaN or infinite (a run that diverged: nothing to resume or export)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    check_crcs(path)
    try:
        with warnings.catch_warnings():  # torch's remarks on pickle protocols: the error below says it all
            warnings.simplefilter("ignore")
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file
        first_line = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        if "Weights only load failed" in first_line:  # torch's advice to unpickle it is not ours to give
            first_line = "it holds objects other than tensors and plain values, which elmokit never unpickles"
        raise WeightFileError(f"{path}: not a readable elmokit checkpoint, damaged or written by something else "
                              f"({first_line})") from error
    for key in required:
        if not isinstance(checkpoint, dict) or key not in checkpoint:
            raise WeightFileError(f"{path}: not {what} (no {key!r})")
    for name, tensor in (checkpoint["model"].items() if isinstance(checkpoint.get("model"), dict) else ()):
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():  # a run that diverged wrote it
            check_finite(path, f"the model's tensor {name!r}", tensor)
    return checkpoint


def check_crcs(path: Path) -> None:
    """WeightFileError naming `path` and the member whose bytes fail their CRC-32. torch.save writes
    a zip whose members carry one each, but torch.load never checks them: a tensor damaged on the
    disk or in a copy would load (and train on) without a word. Reads the whole file once more; a
    file that is no zip is left to torch.load to name."""
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()  # the first member whose bytes fail their CRC-32
    except (zipfile.BadZipFile, zlib.error, EOFError) as error:
        raise WeightFileError(f"{path}: damaged, its zip structure is broken ({error})") from error
    if damaged is not None:
        raise WeightFileError(f"{path}: damaged: the bytes of {damaged!r} fail their CRC-32 check (changed on the "
                              "disk or in a copy since they were written); restore an intact copy")


def check_ranks_agree(path: Path, reports: list[Any], rank: int) -> None:
    """Refuse a resume on which the processes disagree. `reports[r]` is what rank r read from
    `path`: (step, checkpoint id) of the checkpoint, or the message of the error it got (the file
    missing on its node, a damaged copy). Every rank calls this with the same reports, so every
    rank raises the same error (or none) and no rank is left waiting for the others.

    A rank whose own read failed is left to raise its own error (the caller re-raises it); the
    others raise a ConfigError naming the rank and what it got. Ranks that read different
    checkpoints (another step, another writing) raise a ConfigError naming the steps: the run
    directory must be one filesystem that every node sees, not a copy per node.
    """
    failed = {index: report for index, report in enumerate(reports) if isinstance(report, str)}
    if failed and rank not in failed:
        listed = "; ".join(f"rank {index}: {message}" for index, message in failed.items())
        raise ConfigError(f"{path}: not every process could read the checkpoint ({listed}); every node must "
                          "see the run directory (--output-dir on a filesystem shared by all nodes)")
    if not failed and len(set(reports)) > 1:
        listed = ", ".join(f"rank {index} step {step}" for index, (step, _) in enumerate(reports))
        raise ConfigError(f"{path}: the processes read different checkpoints ({listed}; or the same step written "
                          "twice); every node must see the same run directory (--output-dir on a filesystem "
                          "shared by all nodes, not a copy per node)")


def remove_unfinished_writes(paths: Iterable[Path]) -> list[Path]:
    """Remove the temporary files that writes of `paths` interrupted by a kill left beside them
    (`elmokit.io.unfinished_writes`: a checkpoint's is as large as the checkpoint); called by the
    one process that writes them, before it writes again. Returns what it removed."""
    removed = [temporary for path in paths for temporary in unfinished_writes(path)]
    for temporary in removed:
        temporary.unlink(missing_ok=True)
    return removed


class TrainingDiverged(ValueError):
    """The loss, the gradient or the weights of a run became NaN or infinite: the run stops at
    that step and writes nothing of it (no checkpoint, no best/), so that its last checkpoint
    keeps finite weights to resume from (the CLI: one line, exit 2)."""


def diverged(out_dir: Path, step: int, what: str) -> TrainingDiverged:
    """The error of a run in `out_dir` whose `what` (its loss, its weights) went NaN or infinite
    at `step`, saying what is left to continue from."""
    path = Path(out_dir) / CHECKPOINT_NAME
    left = (f"{path} keeps the last checkpoint before it, with finite weights: --resume it with a lower --lr"
            if path.is_file() else "no checkpoint was written before it: start again with a lower --lr")
    return TrainingDiverged(f"training diverged at step {step}: {what}; the run stops there without writing a "
                            f"checkpoint or best/ of it; {left} (or a smaller --grad-clip)")


def check_finite_weights(model: torch.nn.Module, out_dir: Path, step: int) -> None:
    """`diverged` naming the tensors unless every weight of `model` is finite: called before a
    checkpoint or best/ is written from them (by every rank alike: DDP keeps their weights equal),
    since a step whose loss and gradient were finite can still leave infinite weights."""
    bad = [name for name, tensor in model.state_dict().items()
           if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if bad:
        listed = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise diverged(out_dir, step, f"its update left NaN or infinite values in {listed}")


def model_from_checkpoint(checkpoint: dict[str, Any]) -> LanguageModel:
    """The LanguageModel stored in a checkpoint dictionary (in eval mode)."""
    model = LanguageModel(ElmoConfig.from_dict(checkpoint["elmo_config"]), checkpoint["vocab_size"])
    model.load_state_dict(checkpoint["model"])
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Model directories: the biLM with its softmax and vocabulary
# ---------------------------------------------------------------------------------------------
def provenance(train_config: dict[str, Any], progress: dict[str, Any], result: dict[str, float] | None
               ) -> dict[str, Any]:
    """What a model directory's provenance.json records of the run that made it: its training
    files, vocabulary, steps, tokens and epochs (`progress`), and, with `result` (`evaluate`'s
    ppl, forward_ppl, backward_ppl), its validation."""
    card = {"trained_by": "elmo train", "train_files": train_config["train_files"], "vocab": train_config["vocab"],
            "steps": progress["step"], "tokens": progress["tokens"], "epochs": progress["epoch"]}
    if result is not None:
        card.update(valid_files=train_config["valid_files"], valid_ppl=round(result["ppl"], 3),
                    valid_forward_ppl=round(result["forward_ppl"], 3),
                    valid_backward_ppl=round(result["backward_ppl"], 3))
    return card


def checkpoint_provenance(checkpoint: dict[str, Any], metrics_path: Path) -> dict[str, Any]:
    """`provenance` of a checkpoint's model: its progress, and the run's validation at that very
    step from metrics.jsonl (`metrics_path`) when there is one (a run that ends validates its
    last model; a run stopped between validations has none for it)."""
    progress = checkpoint["progress"]
    result = None
    if metrics_path.is_file():
        at_step = [r for r in read_metrics(metrics_path) if "valid_ppl" in r and r.get("step") == progress["step"]]
        if at_step:
            result = {key: at_step[-1][f"valid_{key}"] for key in ("ppl", "forward_ppl", "backward_ppl")}
    return {**provenance(checkpoint["train_config"], progress, result), "model": "the run's last checkpoint"}


def save_model_dir(model: LanguageModel, directory: str | Path, vocab_path: str | Path,
                   provenance: dict[str, Any] | None = None, *, softmax: bool = True,
                   dtype: torch.dtype | None = None, command: str | None = None) -> Path:
    """Write a native model directory that keeps the softmax (`softmax.weight` (V, P),
    `softmax.bias` (V)) and its vocabulary; `load_pretrained` reads the biLM part of it.
    `softmax=False` keeps only what embedding needs; `dtype` is the storage precision.
    provenance.json records `provenance` and the versions of the software writing it; README.md
    is its model card (`elmokit.training.model_card`), naming `command` as what wrote it."""
    directory = Path(directory)
    save_pretrained(model.bilm, directory, extra_tensors=model.softmax_tensors() if softmax else None, dtype=dtype)
    with atomic_path(directory / VOCAB_NAME) as tmp:
        shutil.copyfile(vocab_path, tmp)
    card = {**(provenance or {}), **software_versions()}
    atomic_write_text(directory / PROVENANCE_NAME, json.dumps(card, indent=2) + "\n")
    n_parameters = model.bilm.n_parameters
    write_bilm_card(directory, model.bilm.config, card, n_parameters, command, softmax)
    return directory


def load_model_dir(directory: str | Path) -> tuple[LanguageModel, Path]:
    """A LanguageModel (eval mode) from a native directory with its softmax, and its vocab path."""
    directory = Path(directory)
    bilm = load_pretrained(directory)
    vocab_path = directory / VOCAB_NAME
    if not vocab_path.is_file():
        raise FileNotFoundError(f"{directory}: no {VOCAB_NAME}; a language model directory needs the "
                                "vocabulary of its softmax (write one with `elmo train` or `elmo export`)")
    softmax = read_safetensors(directory / WEIGHTS_NAME, prefix="softmax.")
    if set(softmax) != {"weight", "bias"}:
        raise WeightFileError(f"{directory / WEIGHTS_NAME}: no softmax (softmax.weight, softmax.bias); "
                              "it holds only a biLM, which cannot score text")
    model = LanguageModel(bilm.config, softmax["weight"].shape[0])
    model.bilm.load_state_dict(bilm.state_dict())
    model.softmax.load_state_dict({name: tensor.float() for name, tensor in softmax.items()})
    return model.eval(), vocab_path


def is_model_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / CONFIG_NAME).is_file() and (path / WEIGHTS_NAME).is_file()
