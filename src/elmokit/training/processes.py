"""The processes of a training run: one, or several under torchrun (DistributedDataParallel,
gloo on the CPU, nccl on GPUs), and the signals that stop it cleanly (SIGINT, SIGTERM: a
checkpoint, then exit)."""

from __future__ import annotations

import ctypes
import os
import platform
import random
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elmokit import kernels

from elmokit.devices import resolve_device
from elmokit.model.config import ConfigError
from elmokit.training.config import TrainConfig

# ---------------------------------------------------------------------------------------------
# Processes and devices
# ---------------------------------------------------------------------------------------------
def seed_everything(seed: int) -> None:
    """Seed every generator a run draws from: Python's `random`, NumPy's global one and torch's
    (the CPU's and every GPU's)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (a small picklable object: numbers, strings, tuples), in rank order;
        `[value]` in a single process."""
        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered


def use_deterministic_kernels() -> None:
    """torch's deterministic mode for this process (`--deterministic`): the CUDA kernels that add
    in a varying order (index_add_, scatter_add_, the embedding's backward) run their deterministic
    versions, and cuBLAS a fixed workspace (CUBLAS_WORKSPACE_CONFIG, read at its first call; a
    value already set is kept). A kernel with no deterministic CUDA version raises a RuntimeError
    naming it rather than run. The CPU's kernels are deterministic already."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False


def setup_distributed(config: TrainConfig) -> Dist:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1)."""
    if config.deterministic:
        use_deterministic_kernels()  # before the first CUDA kernel and cuBLAS call
    if config.threads:
        torch.set_num_threads(config.threads)
    kernels.bound_onednn_caches(kernels.TRAINING_CACHE_CAPACITY)  # before the process's first product
    keep_freed_memory()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = resolve_device(config.device)  # auto and cuda: the GPU of LOCAL_RANK
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **restart_safe_store(rank, world_size))
    if config.batch_size % world_size:
        raise ConfigError(f"batch_size {config.batch_size} must be divisible by the {world_size} processes")
    return Dist(rank, world_size, device)


def restart_safe_store(rank: int, world_size: int) -> dict[str, Any]:
    """`init_process_group`'s store under a restarting torchrun: {} (torch's own) or, where the
    workers share the rendezvous store of torchrun's agent (TORCHELASTIC_USE_AGENT_STORE=True, the
    default of the c10d rendezvous), that store under a prefix of the attempt
    (TORCHELASTIC_RESTART_COUNT).

    Why: torch 2.13's agent keeps one store for every attempt of a job, and `init_process_group`
    writes its keys there unprefixed, so the workers of a restarted attempt find the keys of the
    attempt before (the dead workers' addresses) and gloo's or NCCL's connection setup then fails
    or hangs (pytorch/pytorch#135712; a 2-process gloo job restarted once failed or hung 4 times
    in 5 here, and never in 3 with the prefix). The prefix is what torch itself did before 2.5; it requires every worker
    of an attempt to have the same restart count, which holds while the nodes stay the same (a
    node replaced mid-job starts counting afresh: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 there,
    and every attempt gets a store of its own, docs/scale.md).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                is_master=False)
    return {"store": dist.PrefixStore(f"elmokit/attempt_{attempt}", agent_store), "rank": rank,
            "world_size": world_size}


# glibc's mallopt parameters (malloc.h) and the values a training process sets
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed on 64-bit systems
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Let the C heap keep the large blocks a training step frees, for the next step to reuse.

    glibc's malloc gives blocks over its mmap threshold (adjusted at run time, ~25 MB at most here)
    straight back to the kernel when freed, and trims the heap's top; a step allocates them again
    (the softmax's logits: 640 x 10k-8k floats, 20-25 MB a direction), and every page of them is
    a page fault and a zero-fill: thousands of faults a gutenberg-cpu step, a few percent of its
    time on the 2-core CPU. Setting the mmap threshold to glibc's maximum (32 MB) and the trim
    threshold to 1 GB keeps them in the heap (bench/results/train.md records the faults and the
    step's time with and without it, "The C heap"). Process-wide, so it is done by
    the training process only (`setup_distributed`), never on import. Returns whether it applied
    (glibc only; elsewhere nothing changes).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    applied = [libc.mallopt(parameter, value) for parameter, value in ((_M_MMAP_THRESHOLD, _MMAP_THRESHOLD),
                                                                        (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))]
    return all(applied)


def check_bf16(device: torch.device) -> None:
    """bf16 autocast runs the highway and projection in bfloat16 (the char CNN, the LSTM and the
    softmax stay float32). On a CPU with native bfloat16 (AVX512-BF16) bench/results/train-bf16.md
    measured it within a few percent of float32 (train.md, the run before it); without native
    bfloat16 its products are emulated, slower. Say which."""
    if device.type != "cpu":
        return
    if kernels.bf16_native():
        print("elmo train: warning: --bf16 brings no measurable gain on the CPU: it runs only the highway and "
              "projection in bfloat16 and measured within a few percent of float32, slower or faster from run "
              "to run (bench/results/train-bf16.md, train.md); train without --bf16", file=sys.stderr, flush=True)
    else:
        print("elmo train: warning: --bf16 is slower than float32 on this CPU (no native bfloat16 "
              "instructions); train without --bf16", file=sys.stderr, flush=True)


class TrainingStopped(KeyboardInterrupt):
    """The run stopped on a signal after writing a checkpoint (the CLI exits with status 130)."""


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM (kill, torchrun, a batch scheduler) ask the loop to stop after the
    step it is taking, with a checkpoint written there, so that --resume loses nothing. A second
    signal acts at once, as without this handler. All ranks stop at the same step."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a stop on another rank"

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._receive) for number in self.SIGNALS}
        return self

    def __exit__(self, *exc_info) -> None:
        self._restore()

    def _receive(self, number: int, frame) -> None:
        self.received = number
        self._restore()

    def _restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def requested(self, dist_: Dist) -> bool:
        return dist_.all_sum([float(self.received is not None)])[0] > 0
