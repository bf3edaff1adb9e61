# Why this file is long: one compiled library for every driver of the cell (the engine, the server,
# training forward and backward), and for each the checks that decide whether a call may run it,
# with the build, cache and self-check that decide whether it runs at all.
"""The LSTM cell's elementwise work in one compiled pass, for the CPU drivers of the recurrence.

    cell_(gates, cell, output, cell_clip, addend)    float32 or bfloat16 gates (i, f, o, 2j), whole or two terms
    cell_int8_(input, recurrent, bias, cell, output, cell_clip)   int8 products' int32 sums and scales
    train_forward_(gates, acts, cell_prev, cell_next, tanh_cell, cell_output, cell_clip)   training's
    train_backward_(grad_m, cell_grad, acts, cell_prev, cell_next, tanh_cell, gate_grads, cell_clip)   step
    softmax_rows_(logits, bias, targets, grad, bias_grad)   the training softmax's rows after its product
    highway_(product, x)                             the token encoder's highway layer after its product
    window_max_(products)                            the char CNN's max over windows
    available(), status()                            whether it runs here, and if not why
    tracing()                                        whether torch traces now (the passes then leave it to eager code)

Both compute `elmokit.model.cell`'s step (`activate_doubled_gates_` then `cell_step` with
`tanh_via_sigmoid`) in one pass over the gates: c_t replaces c_{t-1} in `cell`, m_t = σ(o) tanh(c_t)
goes to `output` in float32 or bfloat16 (the projection's input, so no cast follows). Eager torch
makes about a dozen passes over a step's (R, 4C) gates for the same work (sigmoid, the candidate's
2σ - 1, the products and sums of the cell, the clip, tanh, the cast; for int8 the scaling of the
int32 sums too), each reading and writing memory and each a dispatch from Python. Training's two
passes (`elmokit.training.recurrence`, float32) do the same for its step forward, writing what the
backward pass reads (the activated gates, c_t, tanh(c_t), m_t), and backward, the four gates'
gradients and the cell's from dL/dm_t (the derivative of the same formulas, torch.clamp's rule at
the clip). The same library holds the training softmax's work between its products (each row's
max, sum, nll and softmax - onehot, the bias gradient summed), `elmokit.training.softmax`'s
full form, and for inference the token encoder's work around its products: a highway layer's gate
(`elmokit.model.highway.highway_gate`: four passes and, with bfloat16 products, two casts in eager
torch) and the char CNN's max over windows (torch's amax over the middle axis is slow in bfloat16).
Each returns False (None) where the compiled pass does not run (also while torch traces: compile,
export, torch.func); the caller then runs the eager code. One library holds them all: a pass that
differs from its eager code at the load's self-check switches every pass off, with one warning.

The pass is `csrc/lstm_cell.cpp`, built at its first use with the machine's C++ compiler (`CXX`, else
g++, c++ or clang++; `-O3 -march=native -fopenmp`: vectorized for this CPU, threads from the
process's own OpenMP runtime, which torch loaded) into `<cache>/.kernels/<key>/`, the key a hash of
the source, the compiler's version, the flags and the CPU's name and flags, so that later processes
load it instead of building it (bench/results/embed-fused-cell.md times both) and a folder shared
by different CPUs holds one build each. The build is
written to a temporary name and renamed into place (two processes building at once both succeed).

Where it cannot run (no compiler, a failed build, a folder it cannot write to and no temporary one,
a library that does not load), one warning says why and every driver runs the eager cell:
the same formulas, slower. It is not trusted blindly: when loaded, each kind of call (float32,
bfloat16 and int8 gates; float32 and bfloat16 outputs) is compared with the eager cell on random
gates; a difference past float32 rounding switches it off with one warning. `ELMOKIT_FUSED_CELL=0`
turns it off (for comparisons: bench/embed.py --cells fused eager).

Its numbers: sigmoid from its own exp (relative error under 2 float32 ulps; torch's is of the same
order), so c_t and m_t differ from the eager cell's by a few float32 ulps, far inside every dtype's
budget (tests/test_fused_cell.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from importlib import resources
from pathlib import Path

import torch

from elmokit.cachedir import cache_dir

SWITCH = "ELMOKIT_FUSED_CELL"  # "0" turns the compiled pass off
SOURCE = "csrc/lstm_cell.cpp"  # in the package
FLAGS = ("-std=c++17", "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
VERSION = 8  # elmokit_fused_cell_version() of the source this module calls
CHECK_TOLERANCE = 1e-5  # of the self-check against the eager cell (values of order 1)

_LOCK = threading.Lock()
_STATE: dict[str, object] = {}  # "library": ctypes.CDLL | None, "reason": why not, once loaded or refused


def available() -> bool:
    """Whether the compiled pass runs here now (built or loaded at the first call): not while torch
    traces (`tracing`), where no library is built, loaded or called."""
    return not tracing() and _library() is not None


def status() -> tuple[bool, str]:
    """(runs, why): whether the compiled pass runs in this process, and where it was loaded from or
    why not. Builds it at the first call."""
    library = _library()
    return library is not None, str(_STATE.get("reason", ""))


def cell_(gates: torch.Tensor, cell: torch.Tensor, output: torch.Tensor, cell_clip: float,
          addend: torch.Tensor | None = None) -> bool:
    """One step of the cell from its pre-activations: gates (R, 4C) (i, f, o, 2j), float32 or
    bfloat16, each row contiguous (rows may be further apart), or with `addend` (of the gates' dtype
    and shape, rows contiguous) their sum, gates + addend in float32 as they are read (the engine's
    recurrent product and gate inputs: `elmokit.inference.engine.recurrent_gates`); cell (R, C)
    float32 contiguous, c_{t-1} in, c_t out; output (R, C) float32 or bfloat16 contiguous, m_t.
    False (nothing written) where the compiled pass does not run here, or for tensors it does not
    take (another device, dtype, shape or layout)."""
    rows, cell_dim = cell.shape if cell.dim() == 2 else (0, 0)
    if tracing() or not (_takes(cell, output) and _gate_rows(gates, rows, cell_dim)
            and (addend is None or (addend.dtype == gates.dtype and _gate_rows(addend, rows, cell_dim)))):
        return False
    library = _library()
    if library is None:
        return False
    _run(library, gates, cell, output, cell_clip, torch.get_num_threads(), addend)
    return True


def tracing() -> bool:
    """Whether torch is tracing (torch.compile, torch.export and the ONNX export built on it) or a
    torch.func transform is active: the passes read raw pointers, which only real tensors have, so
    every one of them leaves such calls to the eager code."""
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


def _gate_rows(gates: torch.Tensor, rows: int, cell_dim: int) -> bool:
    """Gates `cell_` takes: (rows, 4C) float32 or bfloat16 on the CPU, each row contiguous."""
    return (gates.dtype in _GATE_KINDS and gates.device.type == "cpu" and gates.shape == (rows, 4 * cell_dim)
            and gates.stride(-1) == 1)


def cell_int8_(input_product: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
               recurrent_product: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], bias: torch.Tensor,
               cell: torch.Tensor, output: torch.Tensor, cell_clip: float) -> bool:
    """`cell_` with the gates of two int8 products, never written in float32:

        gates = bias + (input_sums * input_weight_scale) * input_row_scale
                     + (recurrent_sums * recurrent_weight_scale) * recurrent_row_scale

    Each product as `Int8Linear.unscaled` gives it: (int32 sums (R, 4C), row scales (R, 1), weight
    scales (1, 4C)), or (a float32 product already times its weight scales (oneDNN's quantized
    linear), row scales, None); bias (4C,) float32; all contiguous. The order of the operations is
    `elmokit.model.int8.Int8Linear`'s (the input product with the bias, then `add`)."""
    if not _takes(cell, output):
        return False
    rows, cell_dim = cell.shape
    expected = [(bias, torch.float32, 4 * cell_dim)]
    for product, row_scales, weight_scales in (input_product, recurrent_product):
        integer = weight_scales is not None
        expected += [(product, torch.int32 if integer else torch.float32, rows * 4 * cell_dim),
                     (row_scales, torch.float32, rows)] + ([(weight_scales, torch.float32, 4 * cell_dim)] if integer else [])
    if not all(t.device.type == "cpu" and t.dtype == dtype and t.numel() == size and t.is_contiguous()
               for t, dtype, size in expected):
        return False
    library = _library()
    if library is None:
        return False
    _run_int8(library, input_product, recurrent_product, bias, cell, output, cell_clip, torch.get_num_threads())
    return True


def train_forward_(gates: torch.Tensor | list[torch.Tensor], acts: torch.Tensor, cell_prev: torch.Tensor,
                   cell_next: torch.Tensor, tanh_cell: torch.Tensor, cell_output: torch.Tensor,
                   cell_clip: float, addends: list[torch.Tensor] | torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> bool:
    """Training's step forward, both directions: gates (D, R, 4C) or D x (R, 4C), the pre-activations
    (i, f, o, j) in float32, or with bfloat16 products their three terms: `bias` (D, 4C) float32 +
    gates, bfloat16 + `addends`, bfloat16 ((D, R, 4C) or D x (R, 4C)), added in float32 in that order as
    they are read; each row contiguous -> acts (D, R, 4C) (σ(i), σ(f), σ(o), tanh(j)), cell_next
    clip(f c_{t-1} + i j), tanh_cell (each (D, R, C), float32) and cell_output o tanh(c_t) (D, R, C)
    float32 or bfloat16, from cell_prev (D, R, C); on the CPU, each direction's (R, .) contiguous.
    False (nothing written) where the pass does not run here or does not take these tensors."""
    directions = list(gates.unbind(0)) if isinstance(gates, torch.Tensor) else list(gates)
    if isinstance(addends, torch.Tensor):
        addends = list(addends.unbind(0))
    terms = addends is not None or bias is not None  # bfloat16 products and the float32 bias, summed here
    gate_dtype = torch.bfloat16 if terms else torch.float32
    if not (_train_buffers(cell_prev, (acts, cell_prev, cell_next, tanh_cell), (4, 1, 1, 1))
            and _train_buffers(cell_prev, (cell_output,), (1,), _OUTPUT_KINDS) and len(directions) == len(cell_prev)
            and all(_rows_of(pre, acts.shape[1:], gate_dtype) for pre in directions)
            and (not terms or (addends is not None and bias is not None and len(addends) == len(directions)
                               and all(_rows_of(add, acts.shape[1:], torch.bfloat16) for add in addends)
                               and _on_cpu_float32(bias) and bias.shape == (len(directions), acts.shape[-1])
                               and bias.stride(-1) == 1))):
        return False
    adds = addends or [None] * len(directions)
    return _each_direction("elmokit_lstm_train_forward", cell_prev, cell_clip, lambda d: (
        directions[d].data_ptr(), int(terms), directions[d].stride(0), None if bias is None else bias[d].data_ptr(),
        _pointer(adds[d]), 0 if adds[d] is None else adds[d].stride(0), acts[d].data_ptr(), cell_prev[d].data_ptr(),
        cell_next[d].data_ptr(), tanh_cell[d].data_ptr(), cell_output[d].data_ptr(), _OUTPUT_KINDS[cell_output.dtype]))


def train_backward_(grad_m: torch.Tensor | list[torch.Tensor], cell_grad: torch.Tensor, acts: torch.Tensor,
                    cell_prev: torch.Tensor, cell_next: torch.Tensor, tanh_cell: torch.Tensor,
                    gate_grads: torch.Tensor, cell_clip: float, bias_grad: torch.Tensor) -> bool:
    """Training's step backward, both directions: from grad_m dL/dm_t ((D, R, C) or D x (R, C),
    float32 or bfloat16: the products as they come) and cell_grad, the cell's gradient from step t+1
    (D, R, C), and the forward pass's acts, c_{t-1}, c_t and tanh(c_t) of the step: the gates'
    gradients into gate_grads (D, R, 4, C) (i, f, o, j), float32 or bfloat16 (the next products'
    operand), their float32 sum over the R rows added into bias_grad (D, 4C), and dL/dc_{t-1} over
    cell_grad. On the CPU, each direction's (R, .) contiguous; False (nothing written) where the
    pass does not run here or does not take these tensors."""
    if not (gate_grads.dim() == 4 and gate_grads.shape[2] == 4 and gate_grads.stride(2) == gate_grads.shape[3]):
        return False  # (D, R, 4, C) whose (4, C) are one row of 4C: a view of it is written, never a copy
    parts = list(grad_m.unbind(0)) if isinstance(grad_m, torch.Tensor) else list(grad_m)
    buffers = (cell_grad, acts, cell_prev, cell_next, tanh_cell)
    if not (_train_buffers(cell_prev, buffers, (1, 4, 1, 1, 1))
            and _train_buffers(cell_prev, (gate_grads.flatten(-2),), (4,), _OUTPUT_KINDS)
            and len(parts) == len(cell_prev) and len({part.dtype for part in parts}) == 1
            and all(_rows_of(part, cell_prev.shape[1:], parts[0].dtype) and part.is_contiguous() for part in parts)
            and _on_cpu_float32(bias_grad) and bias_grad.shape == (len(parts), acts.shape[-1])
            and bias_grad.is_contiguous()):
        return False
    flat_grads = gate_grads.flatten(-2)
    return _each_direction("elmokit_lstm_train_backward", cell_prev, cell_clip, lambda d: (
        parts[d].data_ptr(), _GATE_KINDS[parts[d].dtype], *(t[d].data_ptr() for t in buffers),
        flat_grads[d].data_ptr(), _OUTPUT_KINDS[flat_grads.dtype], bias_grad[d].data_ptr()))


def _each_direction(function: str, cell_prev: torch.Tensor, cell_clip: float, pointers) -> bool:
    """The library's training `function` on each direction d of cell_prev (D, R, C), with the
    pointers(d) its buffers give; False where the library does not run here."""
    library = _library()
    if library is None:
        return False
    rows, cell_dim = cell_prev.shape[1:]
    threads = torch.get_num_threads()
    for d in range(len(cell_prev)):
        getattr(library, function)(*pointers(d), rows, cell_dim, float(cell_clip), threads)
    return True


def highway_(product: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A highway layer after its product, inference: `elmokit.model.highway.highway_gate`'s
    x + σ(carry) (relu(transform) - x) in one pass, from the product [transform | carry] (N, 2F)
    float32 or bfloat16 and x (N, F) float32, both contiguous on the CPU. Returns (the new x in
    float32, the same in the product's dtype: the next product's operand, x itself in float32),
    or None (nothing computed) where the pass does not run here or does not take these tensors."""
    if tracing() or not (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous()
            and product.device.type == "cpu" and product.dtype in _GATE_KINDS
            and product.shape == (x.shape[0], 2 * x.shape[1]) and product.is_contiguous()):
        return None
    library = _library()
    if library is None:
        return None
    out = torch.empty_like(x)
    narrow = None if product.dtype == torch.float32 else x.new_empty(x.shape, dtype=product.dtype)
    library.elmokit_highway(product.data_ptr(), _GATE_KINDS[product.dtype], x.data_ptr(), out.data_ptr(),
                            _pointer(narrow), x.shape[0], x.shape[1], torch.get_num_threads())
    return out, out if narrow is None else narrow


def window_max_(products: torch.Tensor) -> torch.Tensor | None:
    """The char CNN's max over windows, inference: (n, L, f) window products, float32 or bfloat16,
    contiguous on the CPU -> (n, f) in their dtype, `products.amax(dim=1)` (NaN propagated) in one
    pass; None where the pass does not run here or does not take them."""
    if tracing() or not (products.device.type == "cpu" and products.dtype in _GATE_KINDS and products.dim() == 3
            and products.is_contiguous() and products.shape[1] > 0):
        return None
    library = _library()
    if library is None:
        return None
    tokens, windows, width = products.shape
    out = products.new_empty(tokens, width)
    library.elmokit_window_max(products.data_ptr(), _GATE_KINDS[products.dtype], out.data_ptr(), tokens, windows,
                               width, torch.get_num_threads())
    return out


def softmax_rows_(logits: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, grad: torch.Tensor,
                  bias_grad: torch.Tensor) -> torch.Tensor | None:
    """The training softmax's elementwise work on a block of rows (`elmokit.training.softmax`):
    logits (n, V) float32 or bfloat16 (products, before `bias` (V,) float32 when given), targets
    (n,) int64 -> each row's nll (n,) float32, log sum_k exp(logit_k - max) + max - logit_target,
    returned; its gradient softmax - onehot(target) into grad (n, V) of the logits' dtype (for
    float32 it may be the logits themselves, written over); the sum of the rows' float32 gradients
    added into bias_grad (V,) float32. All contiguous, on the CPU. None (nothing written) where the
    pass does not run here or does not take these tensors."""
    if not (logits.dim() == 2 and logits.dtype in _GATE_KINDS and logits.device.type == "cpu"
            and logits.is_contiguous() and grad.shape == logits.shape and grad.dtype == logits.dtype
            and grad.device.type == "cpu" and grad.is_contiguous() and _on_cpu_float32(bias_grad)
            and bias_grad.shape == logits.shape[1:] and bias_grad.is_contiguous()
            and (bias is None or (_on_cpu_float32(bias) and bias.shape == logits.shape[1:] and bias.is_contiguous()))
            and targets.dtype == torch.int64 and targets.device.type == "cpu" and targets.shape == logits.shape[:1]
            and targets.is_contiguous() and len(logits)
            and 0 <= int(targets.min()) <= int(targets.max()) < logits.shape[1]):
        return None
    library = _library()
    if library is None:
        return None
    nll = torch.empty(len(logits), dtype=torch.float32, device=logits.device)
    library.elmokit_softmax_rows(logits.data_ptr(), _GATE_KINDS[logits.dtype], _pointer(bias), targets.data_ptr(),
                                 grad.data_ptr(), bias_grad.data_ptr(), nll.data_ptr(), *logits.shape,
                                 torch.get_num_threads())
    return nll


def _on_cpu_float32(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and tensor.dtype == torch.float32


def _train_buffers(cell_prev: torch.Tensor, buffers: tuple[torch.Tensor, ...], widths: tuple[int, ...],
                   dtypes=(torch.float32,)) -> bool:
    """Whether training's buffers are what its passes take: on the CPU, of `dtypes`, each of shape
    (D, R, width x C) for cell_prev's (D, R, C), each direction's (R, .) contiguous."""
    if cell_prev.dim() != 3:
        return False
    n_dirs, rows, cell_dim = cell_prev.shape
    return all(t.device.type == "cpu" and t.dtype in dtypes and t.shape == (n_dirs, rows, width * cell_dim)
               and all(t[d].is_contiguous() for d in range(n_dirs)) for t, width in zip(buffers, widths, strict=True))


def _rows_of(tensor: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> bool:
    """Whether a direction's (R, width) operand is on the CPU, of this shape and dtype, each row contiguous."""
    return (tensor.device.type == "cpu" and tensor.dtype == dtype and tensor.shape == shape
            and tensor.stride(-1) == 1)


_GATE_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_OUTPUT_KINDS = {torch.float32: 0, torch.bfloat16: 1}


def _takes(cell: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether the pass takes this cell state and output: on the CPU, the cell float32 (R, C), the
    output of its shape in a kind the pass writes, both contiguous."""
    return (cell.device.type == "cpu" and cell.dtype == torch.float32 and cell.dim() == 2 and cell.is_contiguous()
            and output.device.type == "cpu" and output.dtype in _OUTPUT_KINDS and output.shape == cell.shape
            and output.is_contiguous())


def _run(library: ctypes.CDLL, gates: torch.Tensor, cell: torch.Tensor, output: torch.Tensor, cell_clip: float,
         threads: int, addend: torch.Tensor | None = None) -> None:
    """The library's float32 / bfloat16 call, on tensors `cell_` checked."""
    rows, cell_dim = cell.shape
    library.elmokit_lstm_cell(gates.data_ptr(), _GATE_KINDS[gates.dtype], gates.stride(0), _pointer(addend),
                              0 if addend is None else addend.stride(0), cell.data_ptr(), output.data_ptr(),
                              _OUTPUT_KINDS[output.dtype], rows, cell_dim, float(cell_clip), threads)


def _run_int8(library: ctypes.CDLL, input_product: tuple, recurrent_product: tuple, bias: torch.Tensor,
              cell: torch.Tensor, output: torch.Tensor, cell_clip: float, threads: int) -> None:
    """The library's int8 call, on tensors `cell_int8_` checked."""
    rows, cell_dim = cell.shape
    (inputs, input_rows, input_weights), (recurrent, recurrent_rows, recurrent_weights) = input_product, \
        recurrent_product
    library.elmokit_lstm_cell_int8(
        inputs.data_ptr(), input_rows.data_ptr(), _pointer(input_weights), bias.data_ptr(), recurrent.data_ptr(),
        recurrent_rows.data_ptr(), _pointer(recurrent_weights), cell.data_ptr(), output.data_ptr(),
        _OUTPUT_KINDS[output.dtype], rows, cell_dim, float(cell_clip), threads)


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


# ---------------------------------------------------------------------------------------------
# Building, loading and checking the library
# ---------------------------------------------------------------------------------------------
def _library() -> ctypes.CDLL | None:
    if "library" in _STATE:
        return _STATE["library"]  # type: ignore[return-value]
    with _LOCK:
        if "library" not in _STATE:
            library, reason = _load()
            if library is not None:
                with torch.device("cpu"):  # the checks' tensors on the CPU, whatever the default device
                    problem = _self_check(library)
                if problem:
                    library, reason = None, f"it differs from the eager cell ({problem})"
            if library is None and reason != "off":
                warnings.warn(f"elmokit: the LSTM cell's compiled pass does not run ({reason}); the eager cell "
                              "runs instead: the same numbers, slower", RuntimeWarning, stacklevel=3)
            _STATE.update(library=library, reason=reason)
    return _STATE["library"]  # type: ignore[return-value]


def _load() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get(SWITCH, "1").strip() == "0":
        return None, "off"
    compiler = _compiler()
    if compiler is None:
        return None, "no C++ compiler: set CXX or install g++"
    try:
        source = _source()
    except OSError as error:  # an installation without the package's csrc/ files
        return None, f"its source is missing ({error})"
    key = hashlib.sha256(b"\0".join([source, _compiler_version(compiler), " ".join(FLAGS).encode(),
                                     _cpu_fingerprint()])).hexdigest()[:20]
    for folder in (cache_dir() / ".kernels" / key, Path(tempfile.gettempdir()) / f"elmokit-kernels-{os.getuid()}" / key):
        path = folder / "lstm_cell.so"
        try:
            if not path.exists():
                _build(compiler, source, path)
        except subprocess.CalledProcessError as error:
            return None, f"{compiler} failed: {error.stderr.strip().splitlines()[-1] if error.stderr.strip() else error}"
        except OSError:
            continue  # a folder it cannot write to: the next one
        try:
            library = ctypes.CDLL(str(path))
        except OSError as error:
            return None, f"{path} does not load ({error})"
        if library.elmokit_fused_cell_version() != VERSION:
            return None, f"{path} is version {library.elmokit_fused_cell_version()}, this elmokit calls {VERSION}"
        _declare(library)
        return library, f"loaded from {path}"
    return None, f"no folder to build it in ({cache_dir() / '.kernels'} nor a temporary one is writable)"


def _source() -> bytes:
    return resources.files("elmokit").joinpath(SOURCE).read_bytes()


def _build(compiler: str, source: bytes, path: Path) -> None:
    """Compile `source` into `path`: a temporary name in its folder, then renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".build-", suffix=".so")
    os.close(handle)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            written = Path(scratch) / "lstm_cell.cpp"
            written.write_bytes(source)
            subprocess.run([compiler, *FLAGS, "-o", temporary, str(written)], check=True, capture_output=True,
                           text=True, timeout=300)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _compiler() -> str | None:
    named = os.environ.get("CXX")
    if named:
        return shutil.which(named)
    return next((found for name in ("g++", "c++", "clang++") if (found := shutil.which(name))), None)


def _compiler_version(compiler: str) -> bytes:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return b""


def _cpu_fingerprint() -> bytes:
    """The CPU's name and instruction sets (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
        return "\n".join(dict.fromkeys(wanted)).encode()
    except OSError:
        return f"{platform.machine()} {platform.processor()}".encode()


def _declare(library: ctypes.CDLL) -> None:
    pointer, size, number = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.elmokit_lstm_cell.argtypes = [pointer, number, size, pointer, size, pointer, pointer, number, size, size,
                                          ctypes.c_float, number]
    library.elmokit_lstm_cell.restype = None
    library.elmokit_lstm_cell_int8.argtypes = [pointer] * 9 + [number, size, size, ctypes.c_float, number]
    library.elmokit_lstm_cell_int8.restype = None
    library.elmokit_lstm_train_forward.argtypes = [pointer, number, size, pointer, pointer, size] + [pointer] * 5 + [
        number, size, size, ctypes.c_float, number]
    library.elmokit_lstm_train_forward.restype = None
    library.elmokit_lstm_train_backward.argtypes = [pointer, number] + [pointer] * 6 + [number, pointer, size, size,
                                                                                     ctypes.c_float, number]
    library.elmokit_lstm_train_backward.restype = None
    library.elmokit_softmax_rows.argtypes = [pointer, number] + [pointer] * 5 + [size, size, number]
    library.elmokit_softmax_rows.restype = None
    library.elmokit_highway.argtypes = [pointer, number, pointer, pointer, pointer, size, size, number]
    library.elmokit_highway.restype = None
    library.elmokit_window_max.argtypes = [pointer, number, pointer, size, size, size, number]
    library.elmokit_window_max.restype = None


def _self_check(library: ctypes.CDLL) -> str:
    """'' where every kind of call gives the eager cell's numbers on random gates, else what differs."""
    from elmokit.model import cell as lstm_cell

    generator = torch.Generator(device="cpu").manual_seed(0)  # the pass is the CPU's
    rows, cell_dim, clip = 3, 40, 3.0
    gates = torch.randn(rows, 4 * cell_dim, generator=generator) * 4
    previous = torch.randn(rows, cell_dim, generator=generator) * 3
    for gate_dtype in _GATE_KINDS:
        typed = gates.to(gate_dtype)
        expected_cell, expected = lstm_cell.cell_step(lstm_cell.activate_doubled_gates_(typed.to(torch.float32, copy=True)),
                                                      previous.clone(), clip, tanh=lstm_cell.tanh_via_sigmoid)
        # the same sum as two terms (`cell_`'s addend): the first rounded to the dtype, the rest exact in it
        first = (gates * 0.75).to(gate_dtype)
        rest = (typed.to(torch.float32) - first.to(torch.float32)).to(gate_dtype)
        summed = first.to(torch.float32) + rest.to(torch.float32)
        summed_cell, summed_expected = lstm_cell.cell_step(lstm_cell.activate_doubled_gates_(summed), previous.clone(),
                                                           clip, tanh=lstm_cell.tanh_via_sigmoid)
        for output_dtype in _OUTPUT_KINDS:
            cell, output = previous.clone(), torch.empty(rows, cell_dim, dtype=output_dtype)
            _run(library, typed, cell, output, clip, 1)
            problem = _differs(f"{gate_dtype} gates, {output_dtype} output", cell, output, expected_cell,
                               expected.to(output_dtype))
            if problem:
                return problem
            cell, output = previous.clone(), torch.empty(rows, cell_dim, dtype=output_dtype)
            _run(library, first, cell, output, clip, 1, rest)
            problem = _differs(f"{gate_dtype} gates in two terms, {output_dtype} output", cell, output, summed_cell,
                               summed_expected.to(output_dtype))
            if problem:
                return problem
    sums = [torch.randint(-20000, 20000, (rows, 4 * cell_dim), generator=generator, dtype=torch.int32) for _ in "ab"]
    row_scales = [torch.rand(rows, 1, generator=generator) * 1e-3 for _ in "ab"]
    weight_scales = [torch.rand(1, 4 * cell_dim, generator=generator) * 1e-1 for _ in "ab"]
    bias = torch.randn(4 * cell_dim, generator=generator)
    gates = torch.addcmul(torch.addcmul(bias, sums[0] * weight_scales[0], row_scales[0]),
                          sums[1] * weight_scales[1], row_scales[1])
    expected_cell, expected = lstm_cell.cell_step(lstm_cell.activate_doubled_gates_(gates), previous.clone(), clip,
                                                  tanh=lstm_cell.tanh_via_sigmoid)
    for integer_input in (True, False):
        for integer_recurrent in (True, False):
            products = [(sums[i], row_scales[i], weight_scales[i]) if integer
                        else (sums[i] * weight_scales[i], row_scales[i], None)
                        for i, integer in enumerate((integer_input, integer_recurrent))]
            cell, output = previous.clone(), torch.empty(rows, cell_dim)
            _run_int8(library, products[0], products[1], bias, cell, output, clip, 1)
            problem = _differs(f"int8 gates (input {'int32' if integer_input else 'float32'}, recurrent "
                               f"{'int32' if integer_recurrent else 'float32'})", cell, output, expected_cell, expected)
            if problem:
                return problem
    return (_train_problem(library) or _softmax_problem(library) or _highway_problem(library)
            or _window_max_problem(library))


def _window_max_problem(library: ctypes.CDLL) -> str:
    """'' where the max over windows is torch's amax (NaN included) on random products, else what differs."""
    generator = torch.Generator(device="cpu").manual_seed(4)
    products = torch.randn(3, 5, 37, generator=generator)
    products[1, 2, 4] = float("nan")
    for dtype in _GATE_KINDS:
        given = products.to(dtype)
        out = given.new_empty(3, 37)
        library.elmokit_window_max(given.data_ptr(), _GATE_KINDS[dtype], out.data_ptr(), 3, 5, 37, 1)
        if not torch.equal(out.nan_to_num(7.0), given.amax(dim=1).nan_to_num(7.0)):
            return f"the max over windows ({dtype} products) is not torch's amax"
    return ""


def _highway_problem(library: ctypes.CDLL) -> str:
    """'' where the highway pass gives `highway_gate`'s numbers on random products, else what differs."""
    from elmokit.model.highway import highway_gate

    generator = torch.Generator(device="cpu").manual_seed(3)
    rows, dim = 3, 45
    x, product = torch.randn(rows, dim, generator=generator), torch.randn(rows, 2 * dim, generator=generator) * 4
    for dtype in _GATE_KINDS:
        given = product.to(dtype)
        expected = highway_gate(given.to(torch.float32), x)
        out, narrow = torch.empty_like(x), None if dtype == torch.float32 else torch.empty(rows, dim, dtype=dtype)
        library.elmokit_highway(given.data_ptr(), _GATE_KINDS[dtype], x.data_ptr(), out.data_ptr(), _pointer(narrow),
                                rows, dim, 1)
        worst = (out - expected).abs().max().item()
        if narrow is not None:  # the same values rounded once: equal, or one bfloat16 step apart
            worst = max(worst, ((narrow.float() - out).abs() / (out.abs() * 2 ** -8 + 1e-30)).max().item()
                        * CHECK_TOLERANCE)
        if not worst <= CHECK_TOLERANCE:
            return f"the highway layer ({dtype} product): {worst:.3g} off"
    return ""


def _softmax_problem(library: ctypes.CDLL) -> str:
    """'' where the training softmax's pass gives torch's softmax, nll and bias gradient on random
    logits (float32 written over, bfloat16 with the bias added), else what differs."""
    generator = torch.Generator(device="cpu").manual_seed(2)
    rows, width = 5, 37
    logits, bias = torch.randn(rows, width, generator=generator) * 4, torch.randn(width, generator=generator)
    targets = torch.randint(0, width, (rows,), generator=generator)
    for dtype in _GATE_KINDS:
        given = logits.to(dtype)
        full = given.float() + (0 if dtype == torch.float32 else bias)
        expected = torch.softmax(full, dim=1)
        expected[torch.arange(rows), targets] -= 1
        expected_nll = torch.logsumexp(full, dim=1) - full[torch.arange(rows), targets]
        grad = given if dtype == torch.float32 else torch.empty_like(given)
        bias_grad = torch.ones(width)
        nll = torch.empty(rows)
        library.elmokit_softmax_rows(given.data_ptr(), _GATE_KINDS[dtype], None if dtype == torch.float32
                                     else bias.data_ptr(), targets.data_ptr(), grad.data_ptr(), bias_grad.data_ptr(),
                                     nll.data_ptr(), rows, width, 1)
        rounding = CHECK_TOLERANCE if dtype == torch.float32 else 4e-3  # the gradient stored in bfloat16
        worst = max((grad.float() - expected).abs().max().item() / rounding,
                    (bias_grad - 1 - expected.sum(dim=0)).abs().max().item() / CHECK_TOLERANCE,
                    (nll - expected_nll).abs().max().item() / CHECK_TOLERANCE)
        if not worst <= 1:
            return f"the training softmax ({dtype} logits): {worst:.1f} times its tolerance off"
    return ""


def _train_problem(library: ctypes.CDLL) -> str:
    """'' where training's two passes give, on random inputs, the values and the gradients that
    autograd finds through `elmokit.model.cell`'s step in float64 (the first direction all float32,
    the second as `--lstm-bf16` runs it: bfloat16 products in, m_t and the gates' gradients out in
    bfloat16); else what differs."""
    from elmokit.model import cell as lstm_cell

    generator = torch.Generator(device="cpu").manual_seed(1)
    n_dirs, rows, cell_dim, clip = 2, 3, 40, 1.5
    pre, previous, grad_m, grad_cell = (torch.randn(n_dirs, rows, width * cell_dim, generator=generator) * 2
                                        for width in (4, 1, 1, 1))
    bias = torch.randn(4 * cell_dim, generator=generator)
    inputs, addend = pre[1].to(torch.bfloat16), (pre[1] / 3).to(torch.bfloat16)  # bias + two bfloat16 products
    pre[1] = (bias + inputs.float()) + addend.float()
    low_grad_m = grad_m[1].to(torch.bfloat16)
    grad_m[1] = low_grad_m.float()
    with torch.inference_mode(False), torch.enable_grad():  # its first call may come under either
        gates, cell_prev = pre.double().requires_grad_(), previous.double().requires_grad_()
        expected_acts = lstm_cell.activate_gates(gates)
        expected_cell, expected_output = lstm_cell.cell_step(expected_acts, cell_prev, clip)
        expected_gates_grad, expected_cell_grad = torch.autograd.grad(
            (expected_cell, expected_output), (gates, cell_prev), (grad_cell.double(), grad_m.double()))
    acts, cell_next, tanh_cell = (torch.empty(n_dirs, rows, width * cell_dim) for width in (4, 1, 1))
    outputs = [torch.empty(rows, cell_dim), torch.empty(rows, cell_dim, dtype=torch.bfloat16)]
    gate_grads = [torch.empty(rows, 4 * cell_dim), torch.empty(rows, 4 * cell_dim, dtype=torch.bfloat16)]
    carried, bias_grad = grad_cell.clone(), torch.ones(n_dirs, 4 * cell_dim)
    given = [(pre[0], 0, None, None, grad_m[0]), (inputs, 1, bias, addend, low_grad_m)]
    for d, (gate_terms, low, gate_bias, add, dm) in enumerate(given):
        library.elmokit_lstm_train_forward(gate_terms.data_ptr(), low, 4 * cell_dim, _pointer(gate_bias), _pointer(add),
                                           4 * cell_dim, acts[d].data_ptr(), previous[d].data_ptr(),
                                           cell_next[d].data_ptr(), tanh_cell[d].data_ptr(), outputs[d].data_ptr(),
                                           low, rows, cell_dim, clip, 1)
        library.elmokit_lstm_train_backward(dm.data_ptr(), low, carried[d].data_ptr(), acts[d].data_ptr(),
                                            previous[d].data_ptr(), cell_next[d].data_ptr(), tanh_cell[d].data_ptr(),
                                            gate_grads[d].data_ptr(), low, bias_grad[d].data_ptr(), rows, cell_dim,
                                            clip, 1)
    rounded = 1e-2  # one bfloat16 rounding of values below 2
    for name, found, expected, tolerance in (
            ("activated gates", acts, expected_acts, CHECK_TOLERANCE),
            ("cell", cell_next, expected_cell, CHECK_TOLERANCE),
            ("output", outputs[0], expected_output[0], CHECK_TOLERANCE),
            ("bfloat16 output", outputs[1], expected_output[1], rounded),
            ("gates' gradient", gate_grads[0], expected_gates_grad[0], CHECK_TOLERANCE),
            ("bfloat16 gates' gradient", gate_grads[1], expected_gates_grad[1], rounded * 4),
            ("bias' gradient", bias_grad - 1, expected_gates_grad.sum(dim=1), CHECK_TOLERANCE * rows),
            ("cell's gradient", carried, expected_cell_grad, CHECK_TOLERANCE)):
        worst = (found.double() - expected.detach()).abs().max().item()
        if not worst <= tolerance:
            return f"training's step: its {name} off by {worst:.2e}"
    return ""


def _differs(kind: str, cell, output, expected_cell, expected_output) -> str:
    tolerance = CHECK_TOLERANCE if output.dtype == torch.float32 else 1e-2  # one bfloat16 rounding either way
    worst_cell = (cell - expected_cell).abs().max().item()
    worst_output = (output.float() - expected_output.float()).abs().max().item()
    if worst_cell > CHECK_TOLERANCE or worst_output > tolerance:
        return f"{kind}: cell off by {worst_cell:.2e}, output by {worst_output:.2e}"
    return ""
