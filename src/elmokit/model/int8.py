"""int8 products for inference on the CPU (`dtype="int8"`): the LSTM's input and recurrent
products in int8 through the CPU's VNNI or AMX-INT8 instructions; the LSTM's projection and the
token encoder's char CNN, highway and projection in bfloat16 (where the CPU has it); the rest in float32.

    quantize_rows     the one quantization: symmetric int8 per row, scale = max |row| / 127
    Int8Linear        `kernels.PackedLinear`'s interface over int8 operands: the weight quantized
                      once per output channel, the input per row at each call, int32 sums
                      (`torch._int_mm`), the scales, bias and addend applied in float32
    stream_linear     the product a driver of the recurrence repeats (the engine's, the server's):
                      PackedLinear, Int8Linear, or for an int8 layer's projection bfloat16
    bf16_copies       a marked module's weights in bfloat16, kept until they change (the char CNN's, a Linear's)
    module_linear     a Linear's product: bfloat16 where `quantize_modules` marked it, else `kernels.linear`
    quantize_modules  marks a BiLstm's layers for int8 products and the token encoder's modules for
                      bfloat16 ones (`narrows`; the CPU, VNNI or AMX only)

The hardware's int8 products come through two maintained kernels of torch 2.11-2.13 (`torch.ao.quantization`
is deprecated): `torch._int_mm` (the kernel torchao's dynamic int8 quantization calls) and oneDNN's
quantized linear (`torch.ops.onednn.qlinear_pointwise`, what inductor lowers quantized linears to). The
latter takes one input scale a call; rows divided by their own scales first give it per-row
quantization, with the same integer sums. `Int8Linear` runs the faster at each shape (`choose_kernel`).
"""

from __future__ import annotations

import os
import time
import weakref
from functools import partial

import torch

from elmokit.kernels import PackedLinear, bf16_native, linear, path_counts, weights_key

KERNEL_VARIABLE = "ELMOKIT_INT8_KERNEL"  # "auto" (default: the faster at each shape), "onednn" or "int_mm"
ZERO_POINT = 128  # of the uint8 inputs of oneDNN's quantized linear (`quantize_rows(shifted=True)`)
INT8_ATTRIBUTE = "int8_products"  # set True on a module whose products run in int8 (`quantize_modules`)
# A marked module's bfloat16 weights (`bf16_copies`), by module: made at its first product, again after they change
_BF16_COPIES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def int8_native() -> bool:
    """Whether this CPU has int8 dot products: AVX512-VNNI / AVX-VNNI, or AMX-INT8 tiles. Without
    them an int8 product is emulated and slower than float32's, so `dtype="int8"` is refused."""
    checks = ("_is_vnni_supported", "_is_amx_tile_supported")  # torch.cpu's, private
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def quantize_rows(x: torch.Tensor, shifted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of each row, the one quantization every int8 product uses:

        scale_r = max_k |x_rk| / 127        q_rk = round(x_rk / scale_r)        x ~ q * scale

    x (R, K) float -> q (R, K) int8, scale (R, 1) float32 (a row of zeros: q 0, any scale).
    `shifted`: q + 128 as uint8 instead (1..255, zero point 128), the form oneDNN's quantized
    linear reads its input in (a signed int8 input sends it to a reference kernel, orders of magnitude slower)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-30) / 127.0  # (R, 1)
    if shifted:
        return (x.float() / scale).round_().add_(ZERO_POINT).to(torch.uint8), scale
    return (x.float() / scale).round_().to(torch.int8), scale


class Int8Linear:
    """Products with one weight (out, in) in int8, many times: `PackedLinear`'s interface (a call,
    and `add` with the sum fused after the product), for `dtype="int8"` inference on the CPU.

        y = (q_x q_W^T) * scale_W^T * scale_x (+ b)        q_x, scale_x = quantize_rows(x)

    The weight (times `row_scale`, as PackedLinear's) is quantized once per output channel, each
    input per row at every call; the products sum int8 x int8 in int32, the scales, the bias and
    the addend in float32. Inputs and outputs are float32. Two kernels compute the same integer
    sums (`KERNELS`, chosen by `int8_kernel`): oneDNN's quantized linear (its weight reordered once
    for about `rows` rows; one input scale a call, so the rows go in already divided by their own
    scales, shifted to uint8, and come out times them), or `torch._int_mm` (int32 sums, then the
    scales). `scaled_later`: the caller takes the product before its scales (`unscaled`, then
    `finish` or the fused cell, as the engine's input products of a block of steps are used), so
    the kernels are timed in that form: `torch._int_mm` into the caller's kept int32 buffer against
    oneDNN's float32 product, fresh each call.
    """

    def __init__(self, weight: torch.Tensor, rows: int | None = None, row_scale: torch.Tensor | None = None,
                 scaled_later: bool = False):
        source = weight.detach().float()
        if row_scale is not None:
            source = source * row_scale.float()
        quantized, scale = quantize_rows(source)  # (out, in) int8, (out, 1)
        kernel = int8_kernel()
        if kernel == "auto":
            kernel = choose_kernel(quantized, scale.reshape(1, -1), rows or 1, scaled_later)
        self._take(quantized, scale.reshape(1, -1), kernel, rows or 1)

    @classmethod
    def of_quantized(cls, quantized: torch.Tensor, weight_scale: torch.Tensor, kernel: str, rows: int) -> Int8Linear:
        """The product of an int8 weight (out, in) already quantized, with its scales (1, out), on `kernel`."""
        product = cls.__new__(cls)
        product._take(quantized, weight_scale, kernel, rows)
        return product

    def _take(self, quantized: torch.Tensor, weight_scale: torch.Tensor, kernel: str, rows: int) -> None:
        self.weight_scale = weight_scale  # (1, out)
        self.dtype = torch.float32  # of the inputs and outputs
        if kernel == "onednn":  # the weight reordered for about `rows` rows
            self.packed = torch.ops.onednn.qlinear_prepack(quantized, [rows, quantized.shape[1]])
            self.zero_points = torch.zeros(quantized.shape[0], dtype=torch.int64, device=quantized.device)
            self.weight_t = None
        else:
            self.packed = None
            self.weight_t = quantized.mT  # (in, out): a transposed view, the layout torch._int_mm reads fastest

    @property
    def kernel(self) -> str:
        """"onednn" (the weight packed for oneDNN's quantized linear) or "int_mm"."""
        return "onednn" if self.packed is not None else "int_mm"

    def unscaled(self, x: torch.Tensor, sums: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The product before the scales that remain: with `torch._int_mm`, (int32 sums q_x q_W^T
        (R, out) (into `sums` when given), x's row scales (R, 1), the weight's scales (1, out));
        with oneDNN's quantized linear, (its float32 result, already times the weight's scales,
        the row scales, None). `finish` or the fused cell (`elmokit.model.fused_cell.cell_int8_`)
        scales them."""
        path_counts["int8"] += 1
        if self.packed is not None:
            shifted, scale = quantize_rows(x, shifted=True)
            return torch.ops.onednn.qlinear_pointwise(
                shifted, 1.0, ZERO_POINT, self.packed, self.weight_scale[0], self.zero_points, None,
                1.0, 0, torch.float32, "none", [], ""), scale, None
        quantized, scale = quantize_rows(x)
        return torch._int_mm(quantized, self.weight_t, out=sums), scale, self.weight_scale  # (R, out) int32

    @staticmethod
    def weight_scaled(product: torch.Tensor, weight_scale: torch.Tensor | None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """`unscaled`'s product times the weight's scales, float32 (into `out` when given)."""
        if weight_scale is None:  # oneDNN's: already scaled
            return product
        return torch.mul(product, weight_scale, out=out) if out is not None else product.float().mul_(weight_scale)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 sums: torch.Tensor | None = None) -> torch.Tensor:
        """x (R, in) float32 -> (R, out) float32. Given `out` (R, out) float32 and `sums` (R, out)
        int32, both contiguous, the result (and `torch._int_mm`'s sums) are written there: a driver
        that reuses them spares the page faults of fresh buffers (at the gate inputs' 256 x 16,384,
        a fresh one costs about as long as the product itself)."""
        product, scale, weight_scale = self.unscaled(x, sums)
        product = self.weight_scaled(product, weight_scale)
        into = product if out is None else out  # the same operation either way: the same numbers
        return torch.mul(product, scale, out=into) if bias is None else torch.addcmul(bias, product, scale, out=into)

    @staticmethod
    def finish(product: torch.Tensor, scale: torch.Tensor, weight_scale: torch.Tensor | None, addend: torch.Tensor,
               out: torch.Tensor) -> torch.Tensor:
        """addend + product * scale_W^T * scale into `out` (R, out): `unscaled`'s (product, row
        scales, weight scales or None) scaled, as the call would have."""
        return torch.addcmul(addend, Int8Linear.weight_scaled(product, weight_scale, out=out), scale, out=out)

    def add(self, addend: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None,
            sums: torch.Tensor | None = None) -> torch.Tensor:
        """addend (R, out) + x @ weight^T, x (R, in) (into `out` and `sums` as `__call__`)."""
        product, scale, weight_scale = self.unscaled(x, sums)
        product = self.weight_scaled(product, weight_scale)
        return torch.addcmul(addend, product, scale, out=product if out is None else out)


KERNELS = ("int_mm", "onednn")
# (rows, in, out, scaled_later) -> the faster kernel, timed once a process
_CHOICES: dict[tuple[int, int, int, bool], str] = {}


def choose_kernel(quantized: torch.Tensor, weight_scale: torch.Tensor, rows: int, scaled_later: bool = False) -> str:
    """The faster kernel for the int8 weight `quantized` (out, in) at `rows` rows, timed once a
    process for each (rows, in, out, scaled_later) on products of its own (`_best_time`, after a
    call that builds oneDNN's primitive; both give the same numbers, so the choice moves only the
    speed; the timing calls are not counted in `path_counts`). `scaled_later`: timed as
    `Int8Linear.unscaled` into a kept int32 buffer (how the engine's block input products are
    used), else as the call with its scales."""
    key = (rows, *quantized.shape[::-1], scaled_later)
    if key not in _CHOICES:
        counted = path_counts["int8"]
        device = quantized.device
        generator = torch.Generator(device=device).manual_seed(0)  # not the caller's random state
        x = torch.randn(rows, quantized.shape[1], device=device, generator=generator)
        out = torch.empty(rows, quantized.shape[0], device=device)
        sums = torch.empty(rows, quantized.shape[0], dtype=torch.int32, device=device)
        timings = {}
        for kernel in KERNELS:
            product = Int8Linear.of_quantized(quantized, weight_scale, kernel, rows)
            timings[kernel] = _best_time(partial(product.unscaled, x, sums) if scaled_later
                                         else partial(product, x, out=out, sums=sums))
        _CHOICES[key] = min(timings, key=timings.get)
        path_counts["int8"] = counted
    return _CHOICES[key]


def _best_time(call, trials: int = 5, batch_seconds: float = 2e-3) -> float:
    """Seconds a call: the best of `trials` batches of calls, each batch about `batch_seconds`
    long (a single 100-microsecond call is too noisy to rank two kernels 10-20 % apart)."""
    start = time.perf_counter()
    call()  # oneDNN builds and caches its primitive at the first call
    call()
    calls = max(1, round(batch_seconds / max(time.perf_counter() - start, 1e-9) * 2))
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def int8_kernel() -> str:
    """How `Int8Linear` chooses its kernel: "auto" (the default where this torch has oneDNN's
    quantized linear, `torch.ops.onednn`: the faster of it and `torch._int_mm` at each product's
    shape, `choose_kernel`), or the one `ELMOKIT_INT8_KERNEL` names ("onednn", "int_mm"); "int_mm"
    (the kernel torchao's dynamic int8 quantization calls) where oneDNN's is absent. Both sum the
    same int8 products in int32; bench/results/embed-int8.md times them at the recurrence's shapes."""
    requested = os.environ.get(KERNEL_VARIABLE, "auto").strip().lower() or "auto"
    if requested not in ("auto", "onednn", "int_mm"):
        raise ValueError(f"{KERNEL_VARIABLE} must be 'auto', 'onednn' or 'int_mm', got {requested!r}")
    available = (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")
                 and hasattr(torch.ops.onednn, "qlinear_prepack"))
    return requested if available else "int_mm"


class WidenedLinear(PackedLinear):
    """`PackedLinear` with a bfloat16 weight for float32 inputs and outputs: the product in
    bfloat16 (the CPU's AVX512-BF16 or AMX), the result widened to float32."""

    def __init__(self, weight: torch.Tensor, rows: int, row_scale: torch.Tensor | None = None):
        super().__init__(weight.detach().to(torch.bfloat16), rows,
                         None if row_scale is None else row_scale.to(torch.bfloat16))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return super().__call__(x.to(self.dtype), None if bias is None else bias.to(self.dtype)).float()

    def add(self, addend: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self(x).add_(addend)


def stream_linear(weight: torch.Tensor, rows: int, row_scale: torch.Tensor | None = None, int8: bool = False,
                  projection: bool = False, scaled_later: bool = False) -> PackedLinear | Int8Linear:
    """The product with `weight` that a driver of the recurrence repeats: `PackedLinear` (oneDNN's
    reordered weight), or for a layer quantized by `quantize_modules` the int8 product (`Int8Linear`),
    except the projection (`projection`), whose product runs in bfloat16 where the CPU has it
    (`WidenedLinear`), else in float32. The projection's input, the cell output o * tanh(c), has
    most values near 0 beside a few near +-1, so its per-row int8 step is coarse for most of them:
    on the built-in model an int8 projection put the layers 0.12-0.13 of their largest value off
    float32, a bfloat16 one 0.03 (the int8 input and recurrent products alone 0.03 and 0.016)."""
    if int8 and projection:
        return WidenedLinear(weight, rows, row_scale) if bf16_native() else PackedLinear(weight, rows, row_scale)
    return Int8Linear(weight, rows, row_scale, scaled_later) if int8 else PackedLinear(weight, rows, row_scale)


def bf16_copies(module: torch.nn.Module, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """bfloat16 copies of a marked module's weights (`quantize_modules`), made at its first call and
    again after one of them changes (`kernels.weights_key`; kept by module). For inference: no
    gradient flows through them."""
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors):
        raise ValueError("dtype int8's products are for inference only (no gradients): fine-tune in float32")
    key = weights_key(tensors)
    cached = _BF16_COPIES.get(module)
    if cached is None or cached[0] != key:
        _BF16_COPIES[module] = cached = (key, tuple(tensor.detach().to(torch.bfloat16) for tensor in tensors))
    return cached[1]


def narrows(module: torch.nn.Module) -> bool:
    """Whether `module`'s products run in bfloat16: `quantize_modules` marked it (the token
    encoder's under `dtype="int8"`) and the CPU has bfloat16 products."""
    return is_int8(module) and bf16_native()


def module_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x @ weight^T + bias of a Linear, x (..., in) -> (..., out): `kernels.linear`, or where
    `quantize_modules` marked the module (the token encoder's highway and projection under
    `dtype="int8"`) in bfloat16 where the CPU has it (`bf16_copies` of the weight and bias),
    float32 sums and result. Not int8: int8 highway products put the built-in model's layers past
    int8's error budget on real text (tests/test_int8.py's budget tests; bench/results/int8_quality.md),
    bfloat16 ones keep them inside it. For inference: no gradient flows through it."""
    if narrows(module) and torch.is_grad_enabled() and x.requires_grad:
        raise ValueError("dtype int8's products are for inference only (no gradients): fine-tune in float32")
    return linear(x, *module_weights(module))


def module_weights(module: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight and bias `module_linear`'s product runs with: the module's own, or where
    `quantize_modules` marked it (and the CPU has bfloat16 products) their `bf16_copies`."""
    if not narrows(module):
        return module.weight, module.bias
    weight, *bias = bf16_copies(module, *[t for t in (module.weight, module.bias) if t is not None])
    return weight, bias[0] if bias else None


def quantize_modules(modules, device: torch.device) -> None:
    """Mark an LSTM's layers (BiLstmLayer) for int8 products and the token encoder's modules (its
    char CNN, `module_linear`'s Linears) for bfloat16 ones: `dtype="int8"` (the weights stay float32;
    the copies are made where the products are built). The CPU only, one with VNNI or AMX: a
    ValueError says why not otherwise."""
    if device.type != "cpu":
        raise ValueError(f"dtype int8 runs on the CPU only (its products are the CPU's VNNI/AMX "
                         f"int8 kernels), not on {device}; on a GPU use bfloat16")
    if not int8_native():
        raise ValueError("dtype int8 needs a CPU with int8 dot products (AVX512-VNNI, AVX-VNNI or "
                         "AMX-INT8); this one has none, where int8 is slower than float32: use "
                         "float32, or bfloat16 where the CPU has AVX512-BF16 or AMX")
    for module in modules:
        setattr(module, INT8_ATTRIBUTE, True)


def unquantize_modules(modules) -> None:
    """Undo `quantize_modules`: the modules' products in their weights' dtype again."""
    for module in modules:
        module.__dict__.pop(INT8_ATTRIBUTE, None)
        _BF16_COPIES.pop(module, None)


def is_int8(module) -> bool:
    """Whether `quantize_modules` marked this module (a BiLstmLayer or a Linear)."""
    return bool(getattr(module, INT8_ATTRIBUTE, False))
