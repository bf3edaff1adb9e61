"""Matrix products for inference on the CPU: oneDNN's kernels, which torch ships, where they apply.

torch sends a dense fp32 product on the CPU to MKL, and MKL runs its AVX2 code on AMD processors.
On this project's AMD EPYC (Zen 5, 2 threads) a 2048 x 2048 product reaches ~190 GFLOP/s through
MKL and ~400 through oneDNN (AVX-512). The LSTM step's (32, 512) x (512, 16384) product runs at
~90 GFLOP/s through MKL, ~170-240 through oneDNN and ~290-330 through oneDNN with the weight
reordered once into its blocked layout (`bench/embed.py` measures these in every run).

`linear` / `add_linear` take oneDNN's kernel (the op torch's own compiler emits for frozen
`nn.Linear` layers) when no gradient is needed; `PackedLinear` also keeps the reordered weight for
a stream of products with the same weight. With gradients, off the CPU, for other dtypes, or in a
torch built without oneDNN, everything is `F.linear` / `addmm`. All compute in fp32 (no
reduced-precision shortcut): they differ only in the order of the sums.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# oneDNN keeps a compiled primitive for every product shape it has run, in two caches of 1,024
# entries each (oneDNN's and ideep's); an embedding run meets a new row count at nearly every
# call, and 2,000 of them held ~0.7 GB. 64 entries hold every shape a biLM reuses. Read when
# oneDNN first runs a product, so set here, before that; a value the user set is kept.
for _variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_variable, "64")


def _onednn_linear_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


ONEDNN = _onednn_linear_available()


def _takes_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias, as `F.linear`: x (..., in), weight (out, in), bias (out,) -> (..., out)."""
    if _takes_onednn(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class PackedLinear:
    """Products with one weight (out, in), many times: the weight is reordered once into oneDNN's
    blocked layout, tuned for about `rows` rows (any row count gives the right result).

    For inference only (no gradients; inputs of the weight's dtype and device): the reordered copy
    does not follow later changes to `weight`, so build it where the weight is fixed
    (`BiLstmLayer.stream` keys its cache on the weights' versions).
    """

    def __init__(self, weight: torch.Tensor, rows: int):
        weight = weight.detach()
        self.weight = self.packed = None  # one of the two: the reordered copy, or the weight itself
        if _takes_onednn(weight, weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight^T + bias: x (R, in) -> (R, out)."""
        if self.packed is None:
            return F.linear(x, self.weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def add(self, addend: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """addend + x @ weight^T, the sum fused into the product: addend (R, out), x (R, in)."""
        if self.packed is None:
            return torch.addmm(addend, x, self.weight.T)
        return torch.ops.mkldnn._linear_pointwise.binary(x, addend, self.packed, None, "add")
