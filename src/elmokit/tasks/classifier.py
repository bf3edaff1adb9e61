"""Sentence classifier (sentiment): ContextEncoder -> max or mean pooling over tokens -> linear.

Shape notation: B batch, T tokens, D encoder output dim, K classes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elmokit.tasks.encoder import Batch, ContextEncoder

POOLINGS = ("max", "mean")


def pool(hidden: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """(B, T, D) over real tokens (mask (B, T)) -> (B, D)."""
    keep = mask.unsqueeze(-1)  # (B, T, 1)
    if how == "max":
        return hidden.masked_fill(~keep, float("-inf")).amax(dim=1)
    if how == "mean":
        return (hidden * keep).sum(dim=1) / mask.sum(dim=1, keepdim=True).clamp(min=1)
    raise ValueError(f"pooling must be one of {POOLINGS}, got {how!r}")


class Classifier(nn.Module):
    """One class per sentence from the pooled encoder states (`pooling` "max" or "mean")."""

    def __init__(self, encoder: ContextEncoder, n_classes: int, pooling: str = "max"):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.encoder = encoder
        self.pooling = pooling
        self.class_scores = nn.Linear(encoder.output_dim, n_classes)

    def forward(self, batch: Batch) -> torch.Tensor:
        """-> class scores (B, K)."""
        return self.class_scores(pool(self.encoder(batch), batch.mask, self.pooling))

    def loss(self, batch: Batch) -> torch.Tensor:
        """Mean cross-entropy plus the ELMo mix penalty; labels (B,)."""
        return F.cross_entropy(self(batch), batch.labels) + self.encoder.penalty()

    @torch.no_grad()
    def predict(self, batch: Batch) -> list[int]:
        return self(batch).argmax(dim=-1).tolist()
