"""The error of a model file that cannot be used, and the finiteness check every weight reader
applies (`elmokit.model.weights` for ELMo's files, `elmokit.model.manylangs_files` for
ELMoForManyLangs'); a module of its own so that both import it without importing each other."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


class WeightFileError(ValueError):
    """A weight file is missing, unreadable, or does not match its options."""


def check_finite(path: Path, what: str, array: np.ndarray | torch.Tensor) -> None:
    """WeightFileError naming `path` and `what` unless every value of `array` is finite."""
    finite = np.isfinite(array) if isinstance(array, np.ndarray) else torch.isfinite(array)
    if not finite.all():
        count = int(array.size if isinstance(array, np.ndarray) else array.numel()) - int(finite.sum())
        raise WeightFileError(f"{path}: {what} holds {count:,} NaN or infinite values")
