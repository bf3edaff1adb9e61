"""Sequence tagger (POS, NER): ContextEncoder -> linear tag scores -> softmax or CRF.

Shape notation: B batch, T tokens, K tags.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elmokit.tasks.crf import CRF
from elmokit.tasks.encoder import Batch, ContextEncoder


class Tagger(nn.Module):
    """One tag per token. With `use_crf`, tags are scored jointly by a linear-chain CRF (trained
    on the sentence log-likelihood, decoded with Viterbi); else each token independently."""

    def __init__(self, encoder: ContextEncoder, n_tags: int, use_crf: bool = False):
        super().__init__()
        self.encoder = encoder
        self.tag_scores = nn.Linear(encoder.output_dim, n_tags)
        self.crf = CRF(n_tags) if use_crf else None

    def forward(self, batch: Batch) -> torch.Tensor:
        """-> emissions (B, T, K)."""
        return self.tag_scores(self.encoder(batch))

    def loss(self, batch: Batch) -> torch.Tensor:
        """Mean loss of the batch plus the ELMo mix penalty; labels (B, T)."""
        emissions = self(batch)
        if self.crf is not None:
            loss = self.crf.neg_log_likelihood(emissions, batch.labels, batch.mask)
        else:
            loss = F.cross_entropy(emissions[batch.mask], batch.labels[batch.mask])
        return loss + self.encoder.penalty()

    @torch.no_grad()
    def predict(self, batch: Batch) -> list[list[int]]:
        """The predicted tag ids of each sentence (its real length)."""
        return self.decode(self(batch), batch.mask)

    @torch.no_grad()
    def decode(self, emissions: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
        """emissions (B, T, K), mask (B, T) -> the best tag ids of each sentence: the Viterbi path
        with a CRF, else each token's best tag."""
        if self.crf is not None:
            return self.crf.viterbi(emissions, mask)
        best = emissions.argmax(dim=-1).tolist()
        return [row[:n] for row, n in zip(best, mask.sum(dim=1).tolist())]
