"""The scalar mix (AllenNLP's `ScalarMix`): what a task learns on top of the biLM's L+1 layers."""

from __future__ import annotations

import torch
from torch import nn


# ---------------------------------------------------------------------------------------------
# Scalar mix: what a task learns on top of the layers
# ---------------------------------------------------------------------------------------------
class ScalarMix(nn.Module):
    """mix = gamma * sum_k softmax(w)_k * h_k over the L+1 layers (Peters et al. 2018, eq. 1).

    With `do_layer_norm`, each layer is first normalised with one mean and one variance over all
    unmasked elements of the batch. `initial_scalar_parameters` given with `trainable=False`
    freezes w and gamma (= `initial_gamma`, 1 by default), as AllenNLP's `scalar_mix_parameters`
    does; a TF-Hub module's trained mix is its `aggregation/weights` and `aggregation/scaling`.
    """

    def __init__(self, n_layers: int, do_layer_norm: bool = False,
                 initial_scalar_parameters: list[float] | None = None, trainable: bool = True,
                 initial_gamma: float = 1.0):
        super().__init__()
        initial = [0.0] * n_layers if initial_scalar_parameters is None else list(initial_scalar_parameters)
        if len(initial) != n_layers:
            raise ValueError(f"scalar_mix_parameters must have {n_layers} values "
                             f"(one per layer), got {len(initial)}: {initial}")
        self.do_layer_norm = do_layer_norm
        self.scalar_parameters = nn.Parameter(torch.tensor(initial, dtype=torch.float32),
                                              requires_grad=trainable)
        self.gamma = nn.Parameter(torch.tensor(float(initial_gamma)), requires_grad=trainable)

    def forward(self, layers: list[torch.Tensor], mask: torch.Tensor | None = None) -> torch.Tensor:
        """layers: L+1 tensors (B, S, D); mask (B, S) bool, needed for the layer norm."""
        if len(layers) != self.scalar_parameters.numel():
            raise ValueError(f"ScalarMix expects {self.scalar_parameters.numel()} layers, got {len(layers)}")
        if self.do_layer_norm:
            if mask is None:
                raise ValueError("ScalarMix(do_layer_norm=True) needs the mask")
            layers = [_masked_layer_norm(layer, mask) for layer in layers]
        return scalar_mix(layers, self.scalar_parameters, self.gamma)


def scalar_mix(layers: list[torch.Tensor], scalar_parameters: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """gamma * sum_k softmax(scalar_parameters)_k * layers[k]: the mix of `ScalarMix`, for callers
    whose parameters live elsewhere (a Keras layer's variables)."""
    weights = torch.softmax(scalar_parameters, dim=0)
    return gamma * sum(weight * layer for weight, layer in zip(weights, layers))


def _masked_layer_norm(layer: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One scalar mean and variance over every unmasked element of the batch."""
    mask = mask.unsqueeze(-1).to(layer.dtype)  # (B, S, 1)
    count = mask.sum() * layer.shape[-1]
    masked = layer * mask
    mean = masked.sum() / count
    variance = (((masked - mean) * mask) ** 2).sum() / count
    return (layer - mean) / torch.sqrt(variance + 1e-13)
