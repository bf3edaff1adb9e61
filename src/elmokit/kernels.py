"""Matrix products on the CPU: oneDNN's kernels, which torch ships, where they apply.

torch sends a dense fp32 product on the CPU to MKL, and MKL runs its AVX2 code on AMD processors,
where oneDNN's AVX-512 code is faster (bench/results/train.md records both paths for the roofline
and for every product of the step, "The kernels of the step"; bench/results/embed.md the
inference products; each page names the CPU it ran on).

Three entry points, for inference and training alike:
    * `linear(x, weight, bias)`: x W^T + b. Without gradients, oneDNN's kernel (the op torch's
      own compiler emits for frozen `nn.Linear` layers). With gradients (training), an autograd
      Function whose forward and backward products are oneDNN's too (`matmul` below); under an
      autocast region, `F.linear`, so that autocast chooses the dtype as it does for nn.Linear.
    * `matmul(a, b)`: a @ b of two 2-D tensors without gradients, for hand-written backward
      passes (elmokit.training's recurrence and softmax). oneDNN computes x w^T with any strides;
      the product runs as linear(a, b^T) or as linear(b^T, a)^T (a transposed view), whichever
      the layouts favour (see `matmul`).
    * `PackedLinear`: the weight reordered once for a stream of products with the same weight.
Off the CPU, for other dtypes, or in a torch built without oneDNN, everything is `F.linear` /
`torch.mm` / `addmm`. In float32 both paths compute in float32 and differ only in the order of
the sums; bfloat16 weights (reduced-precision inference, `BiLM.to(torch.bfloat16)`) give
bfloat16 products, through oneDNN where the CPU has bf16 support.

Which path runs:
    * `ELMOKIT_KERNELS=torch` in the environment forces the plain path (`F.linear`) everywhere.
    * Under `torch.compile` (`torch.compiler.is_compiling()`) the plain path is traced: the
      compiler chooses its own kernels (inductor emits oneDNN's for frozen linears where it can),
      and lowering the private ops with the checks' data-dependent branches fails.
    * The oneDNN ops are private to torch (`torch.ops.mkldnn`), so they are not trusted blindly:
      the first product of each kind (plain, matmul, reordered weight, reordered weight plus an
      addend) and dtype that goes through oneDNN is computed again with `F.linear` in float32 and
      compared. If it differs, or raises, oneDNN is switched off for the rest of the process
      with one warning, and that product's `F.linear` result is returned: a torch whose private
      ops changed still gives correct results, only slower.
    * `path_counts` counts the products each path ran ("onednn", "torch"); `onednn_active()`
      says whether oneDNN would run now.

oneDNN's primitive caches: oneDNN keeps a compiled primitive for every product shape it has run,
in two caches of 1,024 entries each (oneDNN's and ideep's); an embedding run meets a new row
count at nearly every call, and 2,000 of them held ~0.7 GB. When elmokit first runs a product
through oneDNN it sets ONEDNN_PRIMITIVE_CACHE_CAPACITY and LRU_CACHE_CAPACITY to 64 in
`os.environ` (values already set are kept): oneDNN reads them when it builds its first
primitive, so they bound the caches only if nothing in the process used oneDNN before. A training
process (`elmo train`, `training.processes.setup_distributed`) sets 256 instead, before its first
product: a training step runs more shapes than 64 (the char CNN's, the LSTM's per-step and
all-steps products and their gradients, the softmax's, at row counts that change with the
window's distinct tokens and targets), and with 64 the caches evict and rebuild primitives every
step (a gutenberg-cpu step measured markedly slower; 128 entries as fast as 1,024). Importing
elmokit changes nothing; set them yourself (before anything runs) to choose other sizes.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch.autograd import forward_ad

KERNELS_VARIABLE = "ELMOKIT_KERNELS"  # "torch": the plain path only; "auto" (default): oneDNN where it applies
CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
CACHE_CAPACITY = 64  # entries: every shape a biLM reuses
TRAINING_CACHE_CAPACITY = 256  # entries: a training step's shapes, with room for the row counts that vary
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # of max |F.linear result| + 1


def _onednn_linear_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


ONEDNN = _onednn_linear_available()  # this torch has the ops
_ONEDNN_DTYPES = {torch.float32} | (
    {torch.bfloat16} if ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() else set())

path_counts: Counter = Counter()  # products run by each path: "onednn", "torch"
_verified: set[tuple[str, torch.dtype]] = set()  # (kind, dtype) whose first oneDNN product was checked
_state = {"disabled": None, "caches_set": False}  # disabled: why oneDNN was switched off, or None


# The private ops, one place (tests replace these to play a torch whose ops changed).
def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn_reorder(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def _onednn_add_linear(addend: torch.Tensor, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise.binary(x, addend, packed, None, "add")


def bf16_native() -> bool:
    """Whether this CPU has native bfloat16 products (AVX512-BF16 or AMX); without them oneDNN and
    torch emulate bfloat16, slower than float32."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's, private
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def warn_if_bfloat16_is_emulated() -> None:
    """One warning line when this CPU has no native bfloat16 products (`bf16_native`): torch
    emulates them there, slower than float32, and the user asked for bfloat16 to be faster."""
    if not bf16_native():
        logging.getLogger(__name__).warning(
            "dtype bfloat16 is slower than float32 on this CPU, which has no native bfloat16 products "
            "(AVX512-BF16 or AMX) for torch to use; float32 (--dtype float32, the default) is faster and exact")


def onednn_active() -> bool:
    """Whether products on the CPU go through oneDNN now (those without gradients, and `linear`'s
    with gradients through `LinearFunction`)."""
    requested = os.environ.get(KERNELS_VARIABLE, "auto").strip().lower() or "auto"
    if requested not in ("auto", "torch"):
        raise ValueError(f"{KERNELS_VARIABLE} must be 'torch' or 'auto', got {requested!r}")
    return ONEDNN and requested == "auto" and _state["disabled"] is None and not torch.compiler.is_compiling()


def bound_onednn_caches(capacity: int = CACHE_CAPACITY) -> None:
    """Set oneDNN's two primitive-cache capacities in os.environ, unless already set."""
    for variable in CACHE_VARIABLES:
        os.environ.setdefault(variable, str(capacity))
    _state["caches_set"] = True


def switched_off() -> str | None:
    """Why oneDNN was switched off in this process (a product that failed or differed), or None."""
    return _state["disabled"]


def reset() -> None:
    """Forget the checks, a switch-off and the counts (for tests)."""
    path_counts.clear()
    _verified.clear()
    _state["disabled"] = None


def _onednn_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A product oneDNN can run: on the CPU, one of its dtypes, not empty, oneDNN switched on."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in _ONEDNN_DTYPES
            and x.numel() > 0 and weight.numel() > 0  # oneDNN has no empty product: torch's gives zeros
            and onednn_active())


def _takes_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    takes = (not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
             and _onednn_runs(x, weight))
    if takes and not _state["caches_set"]:
        bound_onednn_caches()
    return takes


def _checked(kind: str, onednn: Callable[[], torch.Tensor], reference: Callable[[], torch.Tensor],
             plain: Callable[[], torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The oneDNN product; the first one of its kind and dtype is compared with `reference`
    (the same product by F.linear in float32). On a difference or an error oneDNN is switched
    off and `plain` (F.linear in the inputs' dtype) is returned."""
    if (kind, dtype) in _verified:
        try:
            result = onednn()
        except Exception as error:  # noqa: BLE001 - a shape or layout this torch's op refuses
            return _plain_after(f"{kind} product failed: {type(error).__name__}: {error}", plain)
        path_counts["onednn"] += 1
        return result
    try:
        result = onednn()
    except Exception as error:  # noqa: BLE001 - any failure of a private op means: do not use it
        return _plain_after(f"{kind} product failed: {type(error).__name__}: {error}", plain)
    with torch.autocast("cpu", enabled=False):  # the float32 reference, also inside a bf16 autocast region
        expected = reference()
    if result.shape != expected.shape or result.dtype != dtype:
        return _plain_after(f"{kind} product gave {tuple(result.shape)} {result.dtype}, expected "
                            f"{tuple(expected.shape)} {dtype}", plain)
    if result.numel():
        difference = float((result.float() - expected).abs().max())
        allowed = CHECK_TOLERANCE.get(dtype, 1e-4) * (1.0 + float(expected.abs().max()))
        if not difference <= allowed:  # also NaN
            return _plain_after(f"{kind} product differs from F.linear by {difference:.3g} "
                                f"(allowed {allowed:.3g})", plain)
        _verified.add((kind, dtype))
    path_counts["onednn"] += 1
    return result


def _switch_off(reason: str) -> None:
    """Stop using oneDNN in this process, with one warning saying why."""
    if _state["disabled"] is None:
        _state["disabled"] = reason
        warnings.warn(f"elmokit.kernels: oneDNN switched off, products go through F.linear ({reason}; "
                      f"torch {torch.__version__})", RuntimeWarning, stacklevel=4)


def _plain_after(reason: str, plain: Callable[[], torch.Tensor]) -> torch.Tensor:
    _switch_off(reason)
    path_counts["torch"] += 1
    return plain()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias, as `F.linear`: x (..., in), weight (out, in), bias (out,) -> (..., out).

    A weight of another dtype than x (bfloat16 weights, float32 activations) computes the product
    in the weight's dtype and returns it in x's dtype. With gradients, `LinearFunction` (oneDNN in
    both passes) where oneDNN would take the product, else `F.linear`.
    """
    if x.dtype != weight.dtype:
        return linear(x.to(weight.dtype), weight, bias).to(x.dtype)
    if _trains_through_onednn(x, weight, bias):
        return LinearFunction.apply(x, weight, bias)
    if not _takes_onednn(x, weight):
        path_counts["torch"] += 1
        return F.linear(x, weight, bias)
    return _checked("linear", lambda: _onednn_linear(x, weight, bias),
                    lambda: F.linear(x.float(), weight.float(), None if bias is None else bias.float()),
                    lambda: F.linear(x, weight, bias), x.dtype)


def _trains_through_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """A product that needs gradients and that oneDNN would take without them; not under autocast
    (which chooses the dtype through F.linear), forward-mode AD or torch.func's transforms (which
    F.linear supports and `LinearFunction` does not)."""
    return (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
            and not torch.is_autocast_enabled("cpu") and forward_ad._current_level < 0
            and not torch._C._are_functorch_transforms_active() and _onednn_runs(x, weight))


class LinearFunction(torch.autograd.Function):
    """x W^T + b with gradients, every product through oneDNN (`linear` / `matmul`):

        dx = dy W      dW = dy^T x      db = sum_rows dy

    A backward pass run with create_graph (double backward) computes the same products with
    torch's differentiable ones (`matmul` takes the plain path when its inputs need gradients).

    apply(x (..., in), weight (out, in), bias (out,) or None) -> (..., out)
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear(x, weight, bias)  # grad mode is off in a Function's forward: the oneDNN product

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        grad_rows = grad_output.reshape(-1, weight.shape[0])  # (R, out)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = matmul(grad_rows, weight).view(*x.shape)
        if ctx.needs_input_grad[1]:
            grad_weight = matmul(grad_rows.mT, x.reshape(-1, weight.shape[1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_rows.sum(dim=0)
        return grad_x, grad_weight, grad_bias


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t itself if its rows or its columns are contiguous, else a contiguous copy."""
    return t if t.is_contiguous() or t.mT.is_contiguous() else t.contiguous()


def matmul_flipped(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `matmul` runs a @ b as linear(b^T, a)^T rather than linear(a, b^T) (a, b with their
    rows or columns contiguous): x's rows contiguous first, then the longer output rows."""
    direct_rows, flipped_rows = a.is_contiguous(), b.mT.is_contiguous()
    return flipped_rows if direct_rows != flipped_rows else a.shape[0] > b.shape[1]


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for 2-D tensors a (m, k), b (k, n) -> (m, n), without gradients; any strides.

    oneDNN computes x w^T, so a @ b runs either as linear(a, b^T) or as linear(b^T, a)^T (the
    result then a transposed view), as `matmul_flipped` chooses: measured on this project's CPU
    over the training products, the faster one is the one whose x has its rows contiguous (k
    along memory), and where neither or both have, the one with the longer output rows (the
    larger of m, n last). bench/results/train.md ("The kernels of the step") times both.
    """
    if not _takes_onednn(a, b):
        path_counts["torch"] += 1
        return torch.mm(a, b)
    a, b = _dense(a), _dense(b)
    product = (lambda: _onednn_linear(b.mT, a, None).mT) if matmul_flipped(a, b) else (
        lambda: _onednn_linear(a, b.mT, None))
    return _checked("matmul", product, lambda: torch.mm(a.float(), b.float()), lambda: torch.mm(a, b), a.dtype)


class WeightsKey:
    """What identifies the values of some tensors for a copy made from them (`weights_key`). Equal
    keys: the same storages, in-place versions, dtypes and devices. The key holds the storages it
    names, so that while a copy is kept under it no other tensor can be given the same memory: a
    float32 -> bfloat16 -> float32 round trip (new storages, versions at 0) could otherwise land at
    the old addresses and pass for the old values."""

    __slots__ = ("values", "_storages")

    def __init__(self, tensors: Iterable[torch.Tensor]):
        tensors = list(tensors)
        self.values = tuple((tensor.data_ptr(), tensor._version, tensor.dtype, tensor.device) for tensor in tensors)
        self._storages = tuple(tensor.untyped_storage() for tensor in tensors)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WeightsKey) and self.values == other.values

    def __hash__(self) -> int:
        return hash(self.values)

    def __repr__(self) -> str:
        return f"WeightsKey({len(self.values)} tensors)"


def weights_key(tensors: Iterable[torch.Tensor]) -> WeightsKey:
    """What identifies the values of `tensors` for a copy made from them (a reordered, narrowed or
    precomputed one: `elmokit.inference.engine.layer_products`, `elmokit.model.int8.bf16_copies`,
    `elmokit.inference.cache.TokenCache`): each tensor's storage, in-place version, dtype and device.
    An edit in place (an optimizer's step, `copy_` under `torch.no_grad()`, `load_state_dict`), a
    new tensor or a move changes it, and the copy is made again; an edit through `.data` does not
    (`.data` bypasses the version counter, as it bypasses autograd): after one, edit in place instead."""
    return WeightsKey(tensors)


class PackedLinear:
    """Products with one weight (out, in), many times: the weight is reordered once into oneDNN's
    blocked layout, tuned for about `rows` rows (any row count gives the right result).
    `row_scale` (out, 1) multiplies the weight's rows first (the product is with weight * row_scale).

    Without gradients only (inference, and training's hand-written forward passes; inputs of the
    weight's dtype and device): the reordered copy does not follow later changes to `weight`, so
    build it where the weight is fixed (`elmokit.inference.engine.layer_products` keys its cache
    on `weights_key`; training's recurrence builds one a pass).
    """

    def __init__(self, weight: torch.Tensor, rows: int, row_scale: torch.Tensor | None = None):
        self.source, self.row_scale = weight.detach(), row_scale  # a view of the caller's weight: no copy
        self.dtype = self.source.dtype
        self.weight = self.packed = None  # one of the two: the weight itself, or the reordered copy
        if _takes_onednn(self.source, self.source):
            try:
                self.packed = _onednn_reorder(self._scaled(), rows)
            except Exception as error:  # noqa: BLE001
                _switch_off(f"weight reorder failed: {type(error).__name__}: {error}")

    def _scaled(self) -> torch.Tensor:
        return self.source if self.row_scale is None else self.source * self.row_scale

    def _plain_weight(self) -> torch.Tensor:
        if self.weight is None and torch.compiler.is_compiling():  # traced: the eager object keeps its packing
            return self._scaled()
        if self.weight is None:  # oneDNN was switched off after this product was packed
            self.weight, self.packed = self._scaled(), None
        return self.weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight^T + bias: x (R, in) -> (R, out)."""
        if self.packed is None or not onednn_active():
            path_counts["torch"] += 1
            return F.linear(x, self._plain_weight(), bias)
        return _checked("packed", lambda: _onednn_linear(x, self.packed, bias),
                        lambda: F.linear(x.float(), self._scaled().float(), None if bias is None else bias.float()),
                        lambda: F.linear(x, self._plain_weight(), bias), self.dtype)

    def add(self, addend: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """addend + x @ weight^T, the sum fused into the product: addend (R, out), x (R, in)."""
        if self.packed is None or not onednn_active():
            path_counts["torch"] += 1
            return torch.addmm(addend, x, self._plain_weight().T)
        return _checked("packed_add", lambda: _onednn_add_linear(addend, x, self.packed),
                        lambda: torch.addmm(addend.float(), x.float(), self._scaled().float().T),
                        lambda: torch.addmm(addend, x, self._plain_weight().T), self.dtype)

