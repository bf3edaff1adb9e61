"""Where and in what precision elmokit runs: the one reading of `device=` / `--device` and of
`dtype=` / `--dtype` that every entry point shares (Elmo, ElmoEmbedder, HubElmo, `elmo embed`,
`elmo similar`, `elmo task`, `elmo train`, `elmo perplexity`); and of `threads=` / `--threads`,
the torch threads a model runs on the CPU (`use_threads`, `default_threads`).

    device   "cpu", "cuda", "cuda:N", "auto" (the GPU if torch sees one, else the CPU), a
             torch.device, or None (the CPU). Under torchrun, "cuda" and "auto" take the GPU of the
             process's LOCAL_RANK. AllenNLP's `cuda_device` (-1 = the CPU, N = cuda:N) is an alias.
    dtype    "float32" (the default, exact), "bfloat16": the weights and their products in
             bfloat16, the activations, the LSTM state and the outputs in float32 (inference only),
             or "int8" (inference on a CPU with VNNI or AMX): the LSTM's input and recurrent
             products in int8, the weights quantized per output channel once, the inputs per row
             at each product, sums in int32 (`elmokit.model.int8.Int8Linear`); the LSTM's projection and
             the token encoder's char CNN, highway and projection in bfloat16 where the CPU has it;
             everything else in float32.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import statistics
import time
from pathlib import Path

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


# ---------------------------------------------------------------------------------------------
# Threads: how many torch runs a model on, when the caller gives no count
# ---------------------------------------------------------------------------------------------
PROC = Path("/proc")  # where the process's CPUs, cgroups and the machine's load are read (tests point them elsewhere)
CGROUP_ROOT = Path("/sys/fs/cgroup")
BUSY_WINDOW_S = 0.05  # over which `busy_cpus` measures the CPU time other processes use
_threads_given = {"count": None}  # the count last given to `use_threads`: later defaults leave it


def max_threads() -> int:
    """The most torch threads an option may ask for: 4 a CPU core, at least 64. Beyond it OpenMP
    fails (20000: libgomp cannot make them) or the process crashes (100000: a segfault that leaves
    a stale lock and a half-made run)."""
    return max(64, 4 * (os.cpu_count() or 1))


def check_threads(threads: int, name: str = "threads") -> None:
    """ValueError naming `name` (`--threads`, `threads`) unless 1 <= threads <= max_threads()."""
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= max_threads():
        raise ValueError(f"{name} must be from 1 to {max_threads()} (4 a CPU core, at least 64), got {threads!r}")


def use_threads(threads: int | None, device: torch.device) -> int:
    """Set the torch threads a model about to run on `device` gets; returns torch's count then.

    `threads` given: that many (`torch.set_num_threads`, for the whole process, as torch has it),
    and later models built without a count keep it. None, on the CPU: `default_threads()`, never
    more than torch has now (a count the process lowered itself, `torch.set_num_threads(1)` or a
    forked worker's one, stays), and nothing at all where OMP_NUM_THREADS is set (the user's choice,
    which torch read) or a count was given before. On a GPU, None changes nothing.
    """
    if threads is not None:
        check_threads(threads)
        torch.set_num_threads(threads)
        _threads_given["count"] = threads
    elif device.type == "cpu" and _threads_given["count"] is None and "OMP_NUM_THREADS" not in os.environ:
        chosen = min(torch.get_num_threads(), default_threads())
        if chosen != torch.get_num_threads():
            torch.set_num_threads(chosen)
    return torch.get_num_threads()


def default_threads() -> int:
    """The threads for a process given no count: the CPUs it may use (`usable_cpus`: its affinity
    and its cgroup's CPU quota) and that other processes leave free (the machine's CPUs less
    `busy_cpus`, rounded), at least 1.

    Why not torch's own (every core): on a machine other work keeps busy, a parallel region waits
    for its slowest thread, and a thread that has to share its core with another process makes
    every step wait for its turn; one thread per free core avoids that (bench/results/threads.md).
    """
    machine, busy, usable = os.cpu_count() or 1, busy_cpus(), usable_cpus()
    chosen = max(1, min(usable, int(machine - busy + 0.5)))
    logging.getLogger(__name__).debug(f"default threads: {chosen} ({usable} CPUs usable by affinity and cgroup "
                                      f"quota; {busy:.2f} of the machine's {machine} busy with other work)")
    return chosen


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (`os.sched_getaffinity`, what taskset and
    cpusets give it), at most its cgroup's CPU quota rounded down (`cgroup_cpu_quota`), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cpus, int(quota))) if quota is not None else cpus


def cgroup_cpu_quota() -> float | None:
    """The CPUs a second that this process's cgroups allow it (quota / period): the tightest limit
    along its cgroup's path, read from cgroup v2's `cpu.max` or v1's `cpu.cfs_quota_us` and
    `cpu.cfs_period_us` (the folders of /proc/self/cgroup under /sys/fs/cgroup; inside a container
    the path may not exist, its root folder then being the container's own). None: no limit, or
    none readable."""
    try:
        lines = (PROC / "self" / "cgroup").read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2: one hierarchy
            mounts, read = [CGROUP_ROOT], _v2_quota
        elif "cpu" in controllers.split(","):  # cgroup v1's cpu controller, mounted by its name
            mounts, read = [CGROUP_ROOT / controllers, CGROUP_ROOT / "cpu"], _v1_quota
        else:
            continue
        parts = [part for part in path.strip().split("/") if part not in ("", ".", "..")]
        for mount in mounts:
            for depth in range(len(parts), -1, -1):  # the cgroup, then each of its parents
                folder = mount.joinpath(*parts[:depth])
                if folder.is_dir():
                    limits.append(read(folder))
    limits = [limit for limit in limits if limit is not None]
    return min(limits) if limits else None


def _v2_quota(folder: Path) -> float | None:
    """`cpu.max` ("QUOTA PERIOD" in microseconds, or "max PERIOD": no limit) as CPUs."""
    try:
        quota, period = (folder / "cpu.max").read_text(encoding="utf-8").split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    """`cpu.cfs_quota_us` / `cpu.cfs_period_us` as CPUs (a quota of -1: no limit)."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text(encoding="utf-8"))
        period = int((folder / "cpu.cfs_period_us").read_text(encoding="utf-8"))
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def busy_cpus(readings: int = 5) -> float:
    """The CPUs other processes keep busy: the larger of the machine's runnable threads now (the
    median of a few readings of /proc/loadavg's run queue, less this process's own running
    threads) and the CPU time they used over the readings' window (/proc/stat's busy time of
    every CPU less this process's own, per second of it: `BUSY_WINDOW_S`). The run queue sees
    work that runs at this instant, the window work that comes and goes. Not the load average: a
    minute's decaying mean, it still counts a process that ended seconds ago, so a job started
    right after another (a benchmark's next configuration) took one thread of two free ones and
    ran at about half speed. 0 where neither can be read."""
    before, now = _cpu_ticks(), []
    started = time.perf_counter()
    for i in range(readings):
        fields = _read(PROC / "loadavg").split()
        if len(fields) < 4:
            return 0.0
        now.append(int(fields[3].split("/")[0]) - _own_running_threads())
        if i + 1 < readings:
            time.sleep(BUSY_WINDOW_S / (readings - 1))
    after, elapsed = _cpu_ticks(), time.perf_counter() - started
    window = 0.0
    if before is not None and after is not None and elapsed > 0:
        others = (after[0] - before[0]) - (after[1] - before[1])  # ticks the machine was busy, less this process's
        window = others / os.sysconf("SC_CLK_TCK") / elapsed
    return max(0.0, statistics.median(now), window)


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy clock ticks of every CPU since boot, from /proc/stat's first line: all but idle and
    iowait; this process's user + system ticks, from /proc/self/stat), or None where unreadable."""
    machine = _read(PROC / "stat").split("\n", 1)[0].split()
    own = _stat_fields(_read(PROC / "self" / "stat"))
    if len(machine) < 5 or machine[0] != "cpu" or len(own) < 13:
        return None
    ticks = [int(value) for value in machine[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(ticks) - ticks[3] - ticks[4], int(own[11]) + int(own[12])


def _own_running_threads() -> int:
    """This process's threads in state R (running or runnable): at least the one reading."""
    running = 0
    try:
        for task in (PROC / "self" / "task").iterdir():
            running += _stat_fields(_read(task / "stat"))[:1] == ["R"]
    except OSError:
        pass
    return max(1, running)


def _stat_fields(stat: str) -> list[str]:
    """The fields of a /proc/.../stat line after the command name (which may hold spaces):
    [state, ppid, ...], field N of proc(5) at index N - 3."""
    return stat.rpartition(")")[2].split()


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""
