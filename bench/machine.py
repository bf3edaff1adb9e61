"""The machine a benchmark ran on, one definition for every page under bench/results/: the CPU's
model and the flags its products depend on (AVX-512, AVX512-BF16, VNNI, AMX), or the GPU; the
matmul rooflines measured in the same run; the load and the other busy processes.

The machines of this project change from session to session (an AMD EPYC without AMX, an Intel
Xeon with it), so a figure means little without the CPU that gave it: every page opens with
`page_header`'s line, and scripts/sync_pages.py copies that line under each table it quotes in
the README.

    from machine import page_header          # bench/ is on sys.path when a bench script runs
    lines = ["# Title", "", page_header("cpu", threads), ...]
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HEADER_PREFIX = "Machine: "  # how the header line starts
ROOFLINES = "Matmul rooflines measured in this run"  # and what it holds (scripts/sync_pages.py finds it by both)
FEATURES = {  # name on the page -> the /proc/cpuinfo flags that give it (any of them)
    "AVX-512": ("avx512f",),
    "AVX512-BF16": ("avx512_bf16",),
    "VNNI": ("avx512_vnni", "avx_vnni"),
    "AMX-BF16": ("amx_bf16",),
    "AMX-INT8": ("amx_int8",),
}


def cpu_flags(flags: str) -> dict[str, bool]:
    """Which of FEATURES a /proc/cpuinfo `flags` line (or just its words) has: {"AVX-512": True, ...}."""
    words = set(flags.split())
    return {name: bool(words.intersection(names)) for name, names in FEATURES.items()}


def cpu_features(flags: str) -> str:
    """What the CPU's flags say about its products: "AVX-512 yes, AVX512-BF16 yes, VNNI yes, AMX-BF16 no, ..."."""
    return ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in cpu_flags(flags).items())


def cpu_fields(cpuinfo: str | None = None) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ("model name", "flags", ...), from `cpuinfo`
    or read here ({} where there is no such file)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def describe_cpu(cpuinfo: str | None = None, cores: int | None = None) -> str:
    """The CPU's model name, cores and features from the text of /proc/cpuinfo (read here when
    None): "Intel(R) Xeon(R) ... (2 cores; AVX-512 yes, ..., AMX-INT8 yes)". Without a model name
    (not Linux, an ARM kernel) the architecture stands for it; without a flags line, "flags unknown"."""
    fields = cpu_fields(cpuinfo)
    model = fields.get("model name") or platform.machine() or "unknown CPU"
    features = cpu_features(fields["flags"]) if "flags" in fields else "flags unknown"
    return f"{model} ({cores or os.cpu_count()} cores; {features})"


def machine(device: str, threads: int) -> str:
    """The device a run used: the CPU (describe_cpu), its torch threads and torch's version; or the GPU."""
    import torch

    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        return (f"{props.name} ({props.total_memory / 2 ** 30:.0f} GiB, {props.multi_processor_count} SMs), "
                f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}; "
                f"host {describe_cpu()}")
    return f"{describe_cpu()}, {threads} thread{'s' if threads != 1 else ''}, torch {torch.__version__}"


def busy_processes(limit: int = 6, own: str | None = None) -> str:
    """The load average and the other processes using over 10% of a core, as `ps` sees them; the
    running bench script's own processes (`own`, default bench/<this script>) are left out."""
    own = own or f"bench/{Path(sys.argv[0]).name}"
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    try:
        listing = subprocess.run(["ps", "-eo", "pid=,pcpu=,comm=,args=", "--sort=-pcpu"], capture_output=True,
                                 text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return f"load average {load}"
    others = []
    for line in listing:
        pid, cpu, command, args = (line.split(None, 3) + [""])[:4]
        if int(pid) != os.getpid() and float(cpu) > 10 and own not in args and command != "ps":
            others.append(f"{command} {float(cpu):.0f}%: {args[:70]}")
    gpu = ""
    try:  # the GPU's other users, where there is one
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=20, check=True)
        gpu = "; GPU processes: " + ("; ".join(line.strip() for line in apps.stdout.splitlines() if line.strip())
                                     or "none")
    except (OSError, subprocess.SubprocessError):
        pass
    return f"load average {load}; other processes over 10% CPU: " + ("; ".join(others[:limit]) or "none") + gpu


def _best_gflops(product, flops: float, repeats: int, trials: int, synchronize) -> float:
    best = 0.0
    for _ in range(trials):
        synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            product()
        synchronize()
        best = max(best, flops * repeats / (time.perf_counter() - start) / 1e9)
    return best


def matmul_gflops(threads: int, device: str, size: int = 2048, repeats: int = 10, trials: int = 8) -> dict[str, float]:
    """The machine's sustained matmul throughput through each kernel the model may use: on the CPU,
    MKL (`torch.mm`, a plain float32 product) and oneDNN (what `elmokit.kernels` runs without
    gradients) in float32 and bfloat16, and in int8 where the CPU has VNNI or AMX `torch._int_mm` and
    oneDNN's quantized linear (GOP/s; `Int8Linear`'s two kernels); on a GPU, `torch.mm` (cuBLAS) in float32 (TF32 off) and bfloat16. The best of
    `trials` timings of `repeats` (size x size) products."""
    import torch

    from elmokit.model.int8 import ZERO_POINT, int8_kernel, int8_native
    from elmokit.kernels import _ONEDNN_DTYPES, ONEDNN, linear

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        a16, b16 = a.bfloat16(), b.bfloat16()
        kernels = {"cublas": lambda: a @ b, "cublas_bf16": lambda: a16 @ b16}
    else:
        kernels = {"mkl": lambda: a @ b}
        if ONEDNN:
            kernels["onednn"] = lambda: linear(a, b)  # no gradients here: oneDNN's kernel
        if torch.bfloat16 in _ONEDNN_DTYPES:
            a16, b16 = a.bfloat16(), b.bfloat16()
            kernels["onednn_bf16"] = lambda: linear(a16, b16)
        if int8_native():  # int8 x int8 -> int32, the product `Int8Linear` runs (GOP/s)
            a8, b8 = (torch.randint(-127, 128, (size, size), dtype=torch.int8) for _ in range(2))
            kernels["int_mm_int8"] = lambda: torch._int_mm(a8, b8.mT)
            if int8_kernel() != "int_mm":  # oneDNN's quantized linear, the other kernel `Int8Linear` may run
                u8 = (a8.to(torch.int16) + ZERO_POINT).to(torch.uint8)
                packed = torch.ops.onednn.qlinear_prepack(b8, [size, size])
                ones, zeros = torch.ones(size), torch.zeros(size, dtype=torch.int64)
                kernels["onednn_int8"] = lambda: torch.ops.onednn.qlinear_pointwise(
                    u8, 1.0, ZERO_POINT, packed, ones, zeros, None, 1.0, 0, torch.float32, "none", [], "")
    with torch.no_grad():
        return {name: _best_gflops(product, 2 * size ** 3, repeats, trials, synchronize)
                for name, product in kernels.items()}


def kernel_dtype(name: str) -> str:
    """The dtype of a matmul_gflops kernel by its name: "onednn_bf16" -> bfloat16, "int_mm_int8" -> int8."""
    return "bfloat16" if name.endswith("bf16") else "int8" if name.endswith("int8") else "float32"


def rooflines(kernels: dict[str, float]) -> dict[str, float]:
    """Each dtype's roofline: the best of its kernels (NaN where none of that dtype was measured)."""
    return {dtype: max([value for name, value in kernels.items() if kernel_dtype(name) == dtype], default=float("nan"))
            for dtype in ("float32", "bfloat16", "int8")}


def roofline_sentence(kernels: dict[str, float]) -> str:
    """"Matmul rooflines measured in this run (...): float32 **68.7** GFLOP/s (mkl 68.7, onednn 60.4); ...",
    the dtypes without a kernel here left out."""
    parts = []
    for dtype, best in rooflines(kernels).items():
        names = [f"{name} {value:.1f}" for name, value in kernels.items() if kernel_dtype(name) == dtype]
        if names:
            parts.append(f"{dtype} **{best:.1f}** {'GOP/s' if dtype == 'int8' else 'GFLOP/s'} ({', '.join(names)})")
    return f"{ROOFLINES} (2048 x 2048, the best of each kernel): " + "; ".join(parts) + "."


def page_header(device: str, threads: int, kernels: dict[str, float] | None = None) -> str:
    """The line that opens every bench page: "Machine: <the CPU and its flags, or the GPU>, <threads>,
    torch <version>. Matmul rooflines measured in this run: ...". `kernels`: matmul_gflops of the
    same run where the script measured them; None measures them now (a shorter measurement)."""
    if kernels is None:
        kernels = matmul_gflops(threads, device, repeats=4, trials=3)
    return f"{HEADER_PREFIX}{machine(device, threads)}. {roofline_sentence(kernels)}"


def is_header(line: str) -> bool:
    """Whether a page's line is page_header's (the machine and the rooflines of its run)."""
    return line.startswith(HEADER_PREFIX) and ROOFLINES in line


def replace_page(output: Path, page: str) -> None:
    """Write a bench page under a temporary name and rename it into place (a run killed midway
    leaves the page of the last finished run)."""
    temporary = output.with_suffix(output.suffix + ".tmp")
    temporary.write_text(page, encoding="utf-8")
    temporary.replace(output)
