"""int8 products for inference on the CPU (`dtype="int8"`): the LSTM's input and recurrent
products in int8 through the CPU's VNNI or AMX-INT8 instructions; the LSTM's projection and the
token encoder's highway and projection in bfloat16 (where the CPU has it); the rest in float32.

    quantize_rows     the one quantization: symmetric int8 per row, scale = max |row| / 127
    Int8Linear        `kernels.PackedLinear`'s interface over int8 operands: the weight quantized
                      once per output channel, the input per row at each call, int32 sums
                      (`torch._int_mm`), the scales, bias and addend applied in float32
    stream_linear     the product a driver of the recurrence repeats (the engine's, the server's):
                      PackedLinear, Int8Linear, or for an int8 layer's projection bfloat16
    module_linear     a Linear's product: bfloat16 where `quantize_modules` marked it, else `kernels.linear`
    quantize_modules  marks a BiLstm's layers for int8 products and Linears for `module_linear`'s
                      bfloat16 ones (the CPU, VNNI or AMX only)

`torch._int_mm` is the maintained route to the hardware's int8 products in torch 2.11-2.13 (the
kernel torchao's dynamic int8 quantization calls; `torch.ao.quantization` is deprecated), and it
takes a scale per row, which oneDNN's quantized linear (one scale per input tensor) does not.
"""

from __future__ import annotations

import weakref

import torch

from elmokit.kernels import PackedLinear, bf16_native, linear, path_counts

INT8_ATTRIBUTE = "int8_products"  # set True on a module whose products run in int8 (`quantize_modules`)
# A marked Linear's bfloat16 weight and bias, by module: made at its first product, again after they change
_LINEAR_PRODUCTS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def int8_native() -> bool:
    """Whether this CPU has int8 dot products: AVX512-VNNI / AVX-VNNI, or AMX-INT8 tiles. Without
    them an int8 product is emulated and slower than float32's, so `dtype="int8"` is refused."""
    checks = ("_is_vnni_supported", "_is_amx_tile_supported")  # torch.cpu's, private
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of each row, the one quantization every int8 product uses:

        scale_r = max_k |x_rk| / 127        q_rk = round(x_rk / scale_r)        x ~ q * scale

    x (R, K) float -> q (R, K) int8, scale (R, 1) float32 (a row of zeros: q 0, any scale)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-30) / 127.0  # (R, 1)
    return (x.float() / scale).round_().to(torch.int8), scale


class Int8Linear:
    """Products with one weight (out, in) in int8, many times: `PackedLinear`'s interface (a call,
    and `add` with the sum fused after the product), for `dtype="int8"` inference on the CPU.

        y = (q_x q_W^T) * scale_x * scale_W^T (+ b)        q_x, scale_x = quantize_rows(x)

    The weight (times `row_scale`, as PackedLinear's) is quantized once per output channel, each
    input per row at every call; the products sum int8 x int8 in int32 (`torch._int_mm`: oneDNN's
    VNNI / AMX-INT8 kernels), the scales, the bias and the addend in float32. Inputs and outputs
    are float32. `rows` is taken for PackedLinear's signature (int8 weights need no row hint).
    """

    def __init__(self, weight: torch.Tensor, rows: int | None = None, row_scale: torch.Tensor | None = None):
        source = weight.detach().float()
        if row_scale is not None:
            source = source * row_scale.float()
        quantized, scale = quantize_rows(source)  # (out, in) int8, (out, 1)
        self.weight_t = quantized.mT  # (in, out): a transposed view, the layout torch._int_mm reads fastest
        self.weight_scale = scale.reshape(1, -1)  # (1, out)
        self.dtype = torch.float32  # of the inputs and outputs

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 sums: torch.Tensor | None = None) -> torch.Tensor:
        """x (R, in) float32 -> (R, out) float32. Given `out` (R, out) float32 and `sums` (R, out)
        int32, both contiguous, the result and the int32 sums are written there: a driver that
        reuses them spares the page faults of fresh buffers (at the gate inputs' 256 x 16,384, a
        fresh one costs about as long as the product itself)."""
        quantized, scale = quantize_rows(x)
        path_counts["int8"] += 1
        sums = torch._int_mm(quantized, self.weight_t, out=sums)  # (R, out) int32
        result = (sums.float() if out is None else out.copy_(sums)).mul_(self.weight_scale).mul_(scale)
        return result if bias is None else result.add_(bias)

    def add(self, addend: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None,
            sums: torch.Tensor | None = None) -> torch.Tensor:
        """addend (R, out) + x @ weight^T, x (R, in) (into `out` and `sums` as `__call__`)."""
        return self(x, out=out, sums=sums).add_(addend)


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
                  projection: bool = False) -> PackedLinear | Int8Linear:
    """The product with `weight` that a driver of the recurrence repeats: `PackedLinear` (oneDNN's
    reordered weight), or for a layer quantized by `quantize_modules` the int8 product (`Int8Linear`),
    except the projection (`projection`), whose product runs in bfloat16 where the CPU has it
    (`WidenedLinear`), else in float32. The projection's input, the cell output o * tanh(c), has
    most values near 0 beside a few near +-1, so its per-row int8 step is coarse for most of them:
    on the built-in model an int8 projection put the layers 0.12-0.13 of their largest value off
    float32, a bfloat16 one 0.03 (the int8 input and recurrent products alone 0.03 and 0.016)."""
    if int8 and projection:
        return WidenedLinear(weight, rows, row_scale) if bf16_native() else PackedLinear(weight, rows, row_scale)
    return Int8Linear(weight, rows, row_scale) if int8 else PackedLinear(weight, rows, row_scale)


def module_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x @ weight^T + bias of a Linear, x (..., in) -> (..., out): `kernels.linear`, or where
    `quantize_modules` marked the module (the token encoder's highway and projection under
    `dtype="int8"`) in bfloat16 where the CPU has it (a bfloat16 copy of the weight made at the
    first call and again after it changes), float32 sums and result. Not int8: on UD English EWT
    dev int8 highway products put the built-in model's layers 0.065 of a sentence's largest value
    off float32 (the budget is 0.05), bfloat16 ones 0.036 (the LSTM's int8 products alone 0.033),
    at 1.9x float32's speed where int8's is 3x. For inference: no gradient flows through it."""
    if not is_int8(module) or not bf16_native():
        return linear(x, module.weight, module.bias)
    weight, bias = module.weight, module.bias
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        raise ValueError("dtype int8's products are for inference only (no gradients): fine-tune in float32")
    key = (weight.data_ptr(), weight._version, weight.device, None if bias is None else bias._version)
    cached = _LINEAR_PRODUCTS.get(module)
    if cached is None or cached[0] != key:
        narrow = (weight.detach().to(torch.bfloat16), None if bias is None else bias.detach().to(torch.bfloat16))
        _LINEAR_PRODUCTS[module] = cached = (key, narrow)
    return linear(x, *cached[1])


def quantize_modules(modules, device: torch.device) -> None:
    """Mark an LSTM's layers (BiLstmLayer) for int8 products and Linears for `module_linear`'s
    bfloat16 ones: `dtype="int8"` (the weights stay float32; the copies are made where the
    products are built). The CPU only, one with VNNI or AMX: a ValueError says why not otherwise."""
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
        _LINEAR_PRODUCTS.pop(module, None)


def is_int8(module) -> bool:
    """Whether `quantize_modules` marked this module (a BiLstmLayer or a Linear)."""
    return bool(getattr(module, INT8_ATTRIBUTE, False))
