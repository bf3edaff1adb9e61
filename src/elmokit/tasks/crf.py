"""A linear-chain CRF: the forward algorithm (log-partition), the score of a tag path, Viterbi,
and each position's tag marginals (forward-backward).

Vectorised over the batch; the only loop is over time. Sequences are right-padded and every row
has at least one real position (mask[:, 0] is true).

Shape notation: B batch, T positions, K tags.
"""

from __future__ import annotations

import torch
from torch import nn


class CRF(nn.Module):
    """score(y) = start[y_0] + sum_t emissions[t, y_t] + sum_t transitions[y_{t-1}, y_t] + end[y_last];
    p(y | x) = exp(score(y)) / Z with Z = sum over all tag paths."""

    def __init__(self, n_tags: int):
        super().__init__()
        self.n_tags = n_tags
        self.transitions = nn.Parameter(torch.zeros(n_tags, n_tags))  # (K, K) from -> to
        self.start = nn.Parameter(torch.zeros(n_tags))  # (K,)
        self.end = nn.Parameter(torch.zeros(n_tags))  # (K,)

    def log_partition(self, emissions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """log Z of each row: emissions (B, T, K), mask (B, T) bool -> (B,)."""
        alpha = self.start + emissions[:, 0]  # (B, K)
        for t in range(1, emissions.shape[1]):
            scores = alpha.unsqueeze(2) + self.transitions + emissions[:, t].unsqueeze(1)  # (B, K, K)
            alpha = torch.where(mask[:, t:t + 1], torch.logsumexp(scores, dim=1), alpha)  # (B, K)
        return torch.logsumexp(alpha + self.end, dim=1)

    def path_score(self, emissions: torch.Tensor, tags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """score of the given tags (B, T) (padding ignored) -> (B,)."""
        mask_float = mask.to(emissions.dtype)
        emitted = emissions.gather(2, tags.unsqueeze(2)).squeeze(2)  # (B, T)
        score = self.start[tags[:, 0]] + (emitted * mask_float).sum(dim=1)
        transitions = self.transitions[tags[:, :-1], tags[:, 1:]]  # (B, T-1)
        score = score + (transitions * mask_float[:, 1:]).sum(dim=1)
        last = tags.gather(1, (mask.sum(dim=1) - 1).unsqueeze(1)).squeeze(1)  # (B,)
        return score + self.end[last]

    def neg_log_likelihood(self, emissions: torch.Tensor, tags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean over the batch of -log p(tags | emissions)."""
        return (self.log_partition(emissions, mask) - self.path_score(emissions, tags, mask)).mean()

    @torch.no_grad()
    def marginals(self, emissions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """p(y_t = k | x) at every real position, by forward-backward: emissions (B, T, K), mask
        (B, T) -> (B, T, K), each real position's row summing to 1, zero at padding.

        alpha_t(k) = log sum of the scores of the paths up to t that end in k (as `log_partition`);
        beta_t(k) = log sum of the scores of the continuations from k at t to the end (end[k] at the
        last real position); p(y_t = k) = exp(alpha_t(k) + beta_t(k) - log Z)."""
        alpha = self.start + emissions[:, 0]  # (B, K)
        alphas = [alpha]
        for t in range(1, emissions.shape[1]):
            scores = alpha.unsqueeze(2) + self.transitions + emissions[:, t].unsqueeze(1)  # (B, K, K)
            alpha = torch.where(mask[:, t:t + 1], torch.logsumexp(scores, dim=1), alpha)
            alphas.append(alpha)
        beta = self.end.expand_as(alpha)  # (B, K): a padded row keeps end[k] back to its last real position
        betas = [beta]
        for t in range(emissions.shape[1] - 1, 0, -1):
            scores = self.transitions + (emissions[:, t] + beta).unsqueeze(1)  # (B, K from, K to)
            beta = torch.where(mask[:, t:t + 1], torch.logsumexp(scores, dim=2), beta)
            betas.append(beta)
        log_z = torch.logsumexp(alpha + self.end, dim=1)  # (B,)
        log_marginals = torch.stack(alphas, 1) + torch.stack(betas[::-1], 1) - log_z[:, None, None]  # (B, T, K)
        return log_marginals.exp() * mask.unsqueeze(-1)

    @torch.no_grad()
    def viterbi(self, emissions: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
        """The best tag path of each row (a list of its real length)."""
        batch_size, n_positions, _ = emissions.shape
        best = self.start + emissions[:, 0]  # (B, K)
        backpointers = []
        for t in range(1, n_positions):
            scores = best.unsqueeze(2) + self.transitions  # (B, K from, K to)
            top, pointer = scores.max(dim=1)  # (B, K)
            running = mask[:, t:t + 1]
            best = torch.where(running, top + emissions[:, t], best)
            # a finished row points each tag to itself, so backtracking passes through unchanged
            identity = torch.arange(self.n_tags, device=emissions.device).expand(batch_size, -1)
            backpointers.append(torch.where(running, pointer, identity))
        last = (best + self.end).argmax(dim=1)  # (B,)
        path = [last]
        for pointer in reversed(backpointers):
            last = pointer.gather(1, last.unsqueeze(1)).squeeze(1)
            path.append(last)
        path = torch.stack(path[::-1], dim=1).tolist()  # (B, T)
        lengths = mask.sum(dim=1).tolist()
        return [row[:n] for row, n in zip(path, lengths)]
