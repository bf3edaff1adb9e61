"""Where and in what precision elmokit runs: the one reading of `device=` / `--device` and of
`dtype=` / `--dtype` that every entry point shares (Elmo, ElmoEmbedder, HubElmo, `elmo embed`,
`elmo similar`, `elmo task`, `elmo train`, `elmo perplexity`).

    device   "cpu", "cuda", "cuda:N", "auto" (the GPU if torch sees one, else the CPU), a
             torch.device, or None (the CPU). Under torchrun, "cuda" and "auto" take the GPU of the
             process's LOCAL_RANK. AllenNLP's `cuda_device` (-1 = the CPU, N = cuda:N) is an alias.
    dtype    "float32" (the default, exact), "bfloat16": the weights and their products in
             bfloat16, the activations, the LSTM state and the outputs in float32 (inference only),
             or "int8" (inference on a CPU with VNNI or AMX): the LSTM's input and recurrent
             products in int8, the weights quantized per output channel once, the inputs per row
             at each product, sums in int32 (`elmokit.int8.Int8Linear`); the LSTM's projection and
             the token encoder's char CNN, highway and projection in bfloat16 where the CPU has it;
             everything else in float32.
"""

from __future__ import annotations

import contextlib
import os
import re

import torch

DEVICE_HELP = "cpu, cuda, cuda:N or auto (the GPU if there is one; under torchrun, LOCAL_RANK's)"
DEVICE_PATTERN = r"auto|cpu|cuda(:[0-9]+)?"  # the names a config file may hold
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


DEFAULT_DEVICE = "auto"  # every command's, and a spaCy pipe's given none: the GPU when torch sees one
DEVICE_VARIABLE = "ELMOKIT_DEVICE"  # replaces that default (the tests set cpu)


def default_device() -> str:
    """The device of a command given no --device (and of a spaCy pipe given none): ELMOKIT_DEVICE
    if set, else `DEFAULT_DEVICE`."""
    name = os.environ.get(DEVICE_VARIABLE, "").strip() or DEFAULT_DEVICE
    try:
        check_device_name(name)
    except ValueError:
        raise ValueError(f"{DEVICE_VARIABLE} must be {DEVICE_HELP}; got {name!r}") from None
    return name


def check_device_name(name: str) -> None:
    """ValueError unless `name` is one of the device names a saved config may hold (whether that
    device exists is checked when the run starts, on the machine it runs on)."""
    if not isinstance(name, str) or re.fullmatch(DEVICE_PATTERN, name) is None:
        raise ValueError(f"device must be {DEVICE_HELP}; got {name!r}")


def resolve_device(device: str | torch.device | None = None, cuda_device: int | None = None) -> torch.device:
    """The torch.device that `device` (or AllenNLP's `cuda_device`, an alias) names.

    Raises ValueError for an unknown name, for both given, or for a GPU that torch cannot see.
    """
    if cuda_device is not None and cuda_device != -1:
        if device is not None:
            raise ValueError(f"give device= or cuda_device= (its AllenNLP alias), not both: "
                             f"got device={device!r}, cuda_device={cuda_device}")
        if cuda_device < -1:
            raise ValueError(f"cuda_device must be -1 (the CPU) or a GPU index >= 0, got {cuda_device}")
        device = f"cuda:{cuda_device}"
    if device is None:
        return torch.device("cpu")
    if isinstance(device, str):
        name = device.strip().lower()
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        if name == "cuda":
            name = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        if re.fullmatch(DEVICE_PATTERN, name) is None:  # torch.device would also take meta, xla, ...
            raise ValueError(f"device must be {DEVICE_HELP}; got {device!r}")
        device = torch.device(name)
    if not isinstance(device, torch.device) or device.type not in ("cpu", "cuda"):  # torch.device("mps") too
        raise ValueError(f"device must be {DEVICE_HELP}; got {device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} asked for, but torch sees no CUDA GPU "
                         f"(torch {torch.__version__}); use device='cpu' (or 'auto')")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {device} asked for, but torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def resolve_dtype(dtype: str | torch.dtype | None = None) -> torch.dtype:
    """torch.float32 (None, "float32"), torch.bfloat16 ("bfloat16") or torch.int8 ("int8": int8
    products, see the module's docstring); anything else is an error."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.int8, got {dtype}")
    return dtype


def one_thread_in_forked_children() -> None:
    """From now on, every child forked from this process runs torch on one thread.

    torch's CPU build runs its parallel operations on GNU OpenMP's thread pool, which does not
    survive a fork: a child forked after the parent's pool has run hangs at its first parallel
    operation (spaCy's `nlp.pipe(n_process=N)` and `multiprocessing`'s fork workers fork the
    process that loaded the model). On one thread a child never enters the pool; N such workers on
    N cores is also the split a machine wants. `load_model` calls it: every process that loaded a
    biLM. Registered once a process; a child whose parent ran on one thread is left as it is.
    """
    if not _fork_guard["registered"] and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_one_thread_after_fork)
        _fork_guard["registered"] = True


_fork_guard = {"registered": False}


def _one_thread_after_fork() -> None:
    if torch.get_num_threads() > 1:
        torch.set_num_threads(1)


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" / "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def without_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """A region where autocast is off for `device_type` (the weights' own dtypes), also on a device
    that has no autocast (meta: `torch.autocast` refuses it)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def memory_bytes(device: torch.device) -> int | None:
    """Bytes of memory of `device`: the GPU's, or this machine's (None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
