"""The biLM training objective: a BiLM with one softmax shared by both directions (bilm-tf's).

    forward / backward char ids -> unique tokens -> TokenEncoder (once a window)
        -> forward and backward LSTM stacks over their streams, state carried between windows
        -> dropout -> ONE softmax (V, P) shared by both directions
        -> forward NLL, backward NLL; loss = their mean

Shape notation (as in model.py): B rows of the batch, U unroll steps, W 50 char ids a token,
P projection dim, V vocabulary size, D 2 directions, K sampled negatives, N counted targets.

Training uses the full softmax or a sampled softmax (log-uniform negatives shared by the whole
batch, as TensorFlow's `sampled_softmax_loss`); evaluation always uses the full softmax.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from elmokit.model.chars import MAX_CHARS
from elmokit.model.config import ElmoConfig
from elmokit.model.lstm import LstmState
from elmokit.model.bilm import BiLM
from elmokit.training.recurrence import RecurrenceOptions, forward_streams
from elmokit.training.softmax import GatherRows, full_softmax_nll, full_softmax_nll_sum, sampled_softmax_nll_sum


class LMOutput(NamedTuple):
    """loss: mean of the two directions' mean NLL over the batch's targets (the sampled softmax
    in training when configured, else the full one); forward_nll / backward_nll: each direction's
    summed NLL (scalars with grad, so a caller can normalise by a global count); n_targets: the
    targets per direction (true entries of the mask); state: the LSTM state after the window."""

    loss: torch.Tensor
    forward_nll: torch.Tensor
    backward_nll: torch.Tensor
    n_targets: int
    state: LstmState


# ---------------------------------------------------------------------------------------------
# Log-uniform (Zipfian) negative sampler, as TensorFlow's `log_uniform_candidate_sampler`
# ---------------------------------------------------------------------------------------------
class LogUniformSampler:
    """P(k) = log((k + 2) / (k + 1)) / log(V + 1) over a vocabulary sorted by descending frequency.

    `sample(K)` draws until K distinct ids are found (TF's `unique=True`) and returns them with the
    number of draws it took; `expected_count` is TF's expected count of an id in those draws, whose
    log the sampled softmax subtracts from the logits. Uses the global torch RNG, so a checkpoint's
    RNG state replays it.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.log_range = math.log(vocab_size + 1)

    def probability(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.double()
        return (torch.log1p(1.0 / (ids + 1.0)) / self.log_range)

    def expected_count(self, ids: torch.Tensor, n_tries: int, n_samples: int) -> torch.Tensor:
        """TF's `ExpectedCountHelper`: P(k) K when the K ids took K draws (no repeat), else
        1 - (1 - P(k))^tries, float64."""
        if n_tries == n_samples:
            return self.probability(ids) * n_samples
        return -torch.expm1(n_tries * torch.log1p(-self.probability(ids)))

    def sample(self, n_samples: int) -> tuple[torch.Tensor, int]:
        """K distinct ids in order of first draw, and how many draws it took."""
        if not 0 < n_samples < self.vocab_size:
            raise ValueError(f"n_samples must be in 1..{self.vocab_size - 1} (vocabulary size "
                             f"{self.vocab_size}), got {n_samples}")
        draws = self._draw(2 * n_samples)
        while True:
            ids, inverse = torch.unique(draws, return_inverse=True)
            if ids.numel() >= n_samples:
                break
            draws = torch.cat([draws, self._draw(n_samples)])
        positions = torch.arange(draws.numel(), device=draws.device)
        first = torch.full((ids.numel(),), draws.numel(), device=draws.device).scatter_reduce(0, inverse, positions, "amin")
        first = first.sort().values[:n_samples]  # the first draw of each of the first K ids
        return draws[first], int(first[-1]) + 1

    def _draw(self, n: int) -> torch.Tensor:
        uniform = torch.rand(n, dtype=torch.float64, device="cpu")  # the CPU generator, as checkpoints replay it
        ids = torch.exp(uniform * self.log_range).long() - 1
        return ids.clamp_(0, self.vocab_size - 1)


# ---------------------------------------------------------------------------------------------
# The language model
# ---------------------------------------------------------------------------------------------
def unique_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows of an integer matrix and where each row went: rows (N, W) -> unique (M, W),
    inverse (N,) with unique[inverse] == rows.

    `torch.unique(rows, dim=0)` compares rows one pair at a time on the CPU (a few small operations
    a row, for each of a training step's token rows); here each row is hashed to one int64 (a
    polynomial in its ids, wrapping), the hashes are de-duplicated, and the result is checked
    exactly against the rows, falling back to `torch.unique(dim=0)` on a collision.
    """
    hashes = (rows * _ROW_HASH_WEIGHTS[:rows.shape[1]].to(rows.device)).sum(dim=1)  # (N,)
    keys, inverse = torch.unique(hashes, return_inverse=True)
    first = torch.empty(len(keys), dtype=torch.long, device=rows.device)
    first.scatter_(0, inverse, torch.arange(len(rows), device=rows.device))  # a row of each key
    unique = rows[first]
    if not torch.equal(unique[inverse], rows):  # two distinct rows with one hash
        return torch.unique(rows, dim=0, return_inverse=True)
    return unique, inverse


def _row_hash_weights(width: int) -> torch.Tensor:
    """Odd multipliers g^k mod 2^64 (g the 64-bit golden-ratio constant), as signed int64."""
    values = [pow(0x9E3779B97F4A7C15, k, 1 << 64) for k in range(width)]  # odd: powers of an odd number
    return torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in values], dtype=torch.long, device="cpu")


_ROW_HASH_WEIGHTS = _row_hash_weights(MAX_CHARS)


class LanguageModel(nn.Module):
    """BiLM + one softmax (weight (V, P), bias (V)) shared by the forward and backward LMs.

    Args:
        config: the biLM shape.
        vocab_size: V, the softmax size (the vocabulary of targets, sorted by frequency).
        dropout: on every LSTM layer input and on the top layer's output (before the softmax).
        n_samples: K negatives of the sampled softmax in training; 0 (or K >= V) = full softmax.

    `sparse_softmax_grad` (default False), set by the trainer, which keeps the softmax weight's
    `.grad` between steps (zeroed): the sampled softmax's rows' gradient then arrives sparse and is
    added in place into it (`GatherRows`) instead of building a new dense (V, P) gradient a step.
    `recurrence` (default `RecurrenceOptions()`), set by the trainer: how the LSTM's products run
    (batched directions, bfloat16 products, CUDA graphs; `elmokit.training.recurrence`).
    `softmax_dtype` (default None), set by the trainer: torch.bfloat16 for the training softmax's
    products with bfloat16 operands (`elmokit.training.softmax.Products`; scoring stays float32).
    """

    TYPE_BUCKET = 32  # the token encoder runs on the window's distinct tokens, padded to a multiple of this

    def __init__(self, config: ElmoConfig, vocab_size: int, dropout: float = 0.1, n_samples: int = 0):
        super().__init__()
        self.bilm = BiLM(config, dropout=dropout)
        projection_dim = config.lstm.projection_dim
        self.softmax = nn.Linear(projection_dim, vocab_size)  # weight (V, P), bias (V)
        self.dropout = dropout
        self.n_samples = n_samples if 0 < n_samples < vocab_size else 0
        self.sampler = LogUniformSampler(vocab_size) if self.n_samples else None
        self.sparse_softmax_grad = False
        self.recurrence = RecurrenceOptions()
        self.softmax_dtype: torch.dtype | None = None
        with torch.no_grad():  # as bilm-tf: normal(0, 1/sqrt(P)) weights, zero bias
            nn.init.normal_(self.softmax.weight, 0.0, 1.0 / math.sqrt(projection_dim))
            nn.init.zeros_(self.softmax.bias)

    @property
    def vocab_size(self) -> int:
        return self.softmax.out_features

    def forward(self, batch, state: LstmState | None = None) -> LMOutput:
        """One window of an `LMBatch`.

        Args:
            batch: forward_char_ids / backward_char_ids (B, U, W), forward_targets /
                backward_targets (B, U) vocab ids, mask (B, U) bool (False: the row has no data).
            state: the state returned for the previous window of the same rows; zeros if None.

        Returns:
            an `LMOutput`; its state is detached (truncated backpropagation through time) and
            zero for rows whose last position is masked (their stream has ended).
        """
        hidden, state = self.contextualize(batch.forward_char_ids, batch.backward_char_ids, state)
        hidden = F.dropout(hidden, self.dropout, self.training)  # (D, B, U, P)
        mask = batch.mask.to(hidden.device)  # (B, U)
        targets = (batch.forward_targets.to(hidden.device), batch.backward_targets.to(hidden.device))
        nll = self.nll_sums([hidden[d][mask] for d in range(2)], [targets[d][mask] for d in range(2)],
                            sampled=self.training)
        count = int(mask.sum())
        loss = 0.5 * (nll[0] + nll[1]) / max(count, 1)
        alive = mask[:, -1].to(state.hidden.dtype)  # (B,)
        state = LstmState((state.hidden * alive[:, None]).detach(), (state.cell * alive[:, None]).detach())
        return LMOutput(loss, nll[0], nll[1], count, state)

    def contextualize(self, forward_char_ids: torch.Tensor, backward_char_ids: torch.Tensor,
                      state: LstmState | None) -> tuple[torch.Tensor, LstmState]:
        """Top-layer outputs of both directions over their streams: (D, B, U, P) and the state."""
        char_ids = torch.stack([forward_char_ids, backward_char_ids])  # (D, B, U, W)
        flat = char_ids.reshape(-1, MAX_CHARS)
        unique_ids, inverse = unique_rows(flat)  # each token type once
        # padded to a multiple of TYPE_BUCKET rows: a few recurring shapes instead of a new one every
        # step, which otherwise fragments the CPU heap (RSS grew ~5 MB a step, bounded this way)
        n_types = len(unique_ids)
        unique_ids = F.pad(unique_ids, (0, 0, 0, -n_types % self.TYPE_BUCKET))
        token_embeddings = self.bilm.token_encoder(unique_ids)[inverse]  # (D*B*U, P)
        tokens = token_embeddings.view(*char_ids.shape[:-1], -1)  # (D, B, U, P)
        layers, state = forward_streams(self.bilm.lstm, tokens, state, self.recurrence)
        return layers[-1], state

    def nll_sums(self, hiddens: list[torch.Tensor], targets: list[torch.Tensor], sampled: bool = False
                 ) -> list[torch.Tensor]:
        """Summed negative log-likelihood of each (hidden (N, P), targets (N,)) part (the two
        directions): the full softmax, or with `sampled` (and n_samples > 0) the sampled softmax,
        each part with its own sample; computed by `elmokit.training.softmax` without holding the
        (N, V) logits.

        Sampled, the rows of the softmax that all parts need (their negatives and their targets)
        are taken out of the (V, P) weight by one index (`GatherRows`), so the backward pass adds
        one gradient of those rows a step into the weight's, instead of filling one dense (V, P)
        gradient per index (four a direction).
        """
        weight, bias = self.softmax.weight, self.softmax.bias
        if not (sampled and self.sampler is not None):
            return [full_softmax_nll_sum(hidden, weight, bias, part, self.softmax_dtype)
                    for hidden, part in zip(hiddens, targets)]
        draws = [self.sampler.sample(self.n_samples) for _ in hiddens]  # (K,) ids and tries, in part order
        pieces = [piece for (negatives, _), part in zip(draws, targets) for piece in (negatives.to(part.device), part)]
        sizes = [len(piece) for piece in pieces]
        rows = torch.cat(pieces)  # one gather of everything the parts use
        weight_rows = GatherRows.apply(weight, rows, self.sparse_softmax_grad).split(sizes)
        bias_rows = bias[rows].split(sizes)
        log_q = lambda ids, n_tries: torch.log(  # noqa: E731
            self.sampler.expected_count(ids, n_tries, self.n_samples)).float()
        sums = []
        for index, (hidden, part, (_, n_tries)) in enumerate(zip(hiddens, targets, draws)):
            negatives = pieces[2 * index]  # on the targets' device
            (negative_weight, target_weight), (negative_bias, target_bias) = (
                weight_rows[2 * index:2 * index + 2], bias_rows[2 * index:2 * index + 2])
            true_logits = (hidden * target_weight).sum(-1) + target_bias - log_q(part, n_tries)  # (N,)
            column = torch.full((self.vocab_size,), -1, dtype=torch.long, device=hidden.device)
            column[negatives] = torch.arange(len(negatives), device=hidden.device)
            sums.append(sampled_softmax_nll_sum(hidden, negative_weight, negative_bias - log_q(negatives, n_tries),
                                                true_logits, column[part], self.softmax_dtype))
        return sums

    def target_nll(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Negative log-likelihood of each target under the full softmax: hidden (N, P), targets
        (N,) -> (N,) float32, without gradients (scoring: `elmokit.training.perplexity`)."""
        return full_softmax_nll(hidden, self.softmax.weight, self.softmax.bias, targets)

    def softmax_tensors(self) -> dict[str, torch.Tensor]:
        """The softmax under the names a native model directory stores it (`softmax.`)."""
        return {"softmax.weight": self.softmax.weight.detach(), "softmax.bias": self.softmax.bias.detach()}
