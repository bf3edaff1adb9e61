"""The highway layer's formula (bilm-tf's), one definition: the token encoder's `Highway` runs it,
and the compiled pass that replaces it in inference (`elmokit.model.fused_cell.highway_`) is
checked against it. A module of its own so that both import it and neither imports the other."""

from __future__ import annotations

import torch


def highway_gate(product: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A highway layer after its product: [transform | carry] (N, 2F) = x W^T + b and x (N, F) ->
    c t + (1 - c) x with c = sigmoid(carry), t = relu(transform), computed as x + c (t - x):
    4 passes, not 6."""
    transform, carry = product.chunk(2, dim=-1)  # (N, F) each
    return torch.addcmul(x, torch.sigmoid(carry), torch.relu(transform) - x)
