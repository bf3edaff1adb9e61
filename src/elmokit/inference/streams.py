"""Sentences laid end to end in R streams (`stream_layout`), the layout the inference engine
(`elmokit.inference.engine`) runs: every row of the recurrence busy until the end, each sentence
still from a zero state; and how many rows where the caller leaves it to the engine
(`default_rows`)."""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple

import numpy as np
import torch

GATE_BUDGET = 1 << 23  # floats of precomputed gate inputs held at once by `engine.stream_layer` (32 MB)
STREAM_POSITIONS = 128  # positions a stream carries in one call, for `default_rows` (~5 sentences of 25 tokens)
FEWEST_DEFAULT_ROWS = 32  # `default_rows`' floor (within the gate budget), however short the call
MAX_DEFAULT_ROWS = 4096  # `default_rows`' ceiling whatever the budgets


class StreamLayout(NamedTuple):
    """Sentences laid end to end in R streams, read one step of every stream at a time.

    Each sentence still starts from a zero state (`starts` marks where the state is reset), so
    the results are those of one sentence at a time, but all R rows of the recurrence stay busy
    until the end instead of idling while the longest sentence of a batch finishes.
    """

    forward_index: torch.Tensor  # (U, R) flat position read at each step of each stream; N = none
    backward_index: torch.Tensor  # (U, R) the same, every sentence read from its end
    starts: torch.Tensor  # (U, R) bool: a sentence starts here
    reset_steps: list[bool]  # (U,) any start at this step


def stream_layout(sizes: np.ndarray, rows: int) -> StreamLayout:
    """Place sentences of `sizes` positions (boundaries included) in `rows` streams: the longest
    first, each in the stream that is shortest so far, so the streams end close together."""
    n_sentences, n_positions = len(sizes), int(sizes.sum())
    rows = max(1, min(rows, n_sentences))
    stream, offset = np.empty(n_sentences, np.int64), np.empty(n_sentences, np.int64)
    heap = [(0, row) for row in range(rows)]
    for sentence in np.argsort(-sizes, kind="stable"):  # one step per sentence, not per token
        total, row = heapq.heappop(heap)
        stream[sentence], offset[sentence] = row, total
        heapq.heappush(heap, (total + int(sizes[sentence]), row))
    n_steps = max(total for total, _ in heap)

    first = np.cumsum(sizes) - sizes  # flat position of each sentence's first position
    sentence = np.repeat(np.arange(n_sentences), sizes)  # (N,)
    within = np.arange(n_positions) - first[sentence]
    step, row = offset[sentence] + within, stream[sentence]
    forward = np.full((n_steps, rows), n_positions, np.int64)
    forward[step, row] = np.arange(n_positions)
    backward = np.full((n_steps, rows), n_positions, np.int64)
    backward[step, row] = first[sentence] + sizes[sentence] - 1 - within
    starts = np.zeros((n_steps, rows), bool)
    starts[offset, stream] = True
    return StreamLayout(torch.from_numpy(forward), torch.from_numpy(backward),
                         torch.from_numpy(starts), starts.any(axis=1).tolist())


def default_rows(cell_dim: int, positions: int) -> int:
    """The rows of the recurrence where the caller leaves the choice to the engine, for a call of
    `positions` positions (at most its budget) through an LSTM of `cell_dim` cells: the most the
    budgets allow, a power of two.

    More rows make a step's products larger (a step reads the recurrent and projection weights
    once, whatever the rows: more work for each byte read, closer to the kernel's peak, most of all
    where the products are fast: AMX, a GPU) and share a step's fixed costs, so they pay until the
    budgets stop them: memory (a step's gate inputs of both directions, 2 R 4C floats, within
    `GATE_BUDGET`: the `original` shape 256 rows) and the streams' length (about `STREAM_POSITIONS`
    positions a stream, the power of two nearest: the streams end within one sentence of each
    other, so streams of a few sentences would idle for much of the last one; a power of two, so
    that calls of similar sizes run one row count: `engine.layer_products` keeps the weights
    reordered for one), but never fewer than `FEWEST_DEFAULT_ROWS` (below, a step's products wait
    on reading the weights; `stream_layout` makes no more streams than there are sentences).
    ElmoEmbedder's 16,384 positions a call give 128 rows; measured against 32 and 64 rows in
    bench/results/embed-rows.md. The vectors do not depend on the rows."""
    by_length = 1 << round(math.log2(max(positions / STREAM_POSITIONS, 1)))  # the nearest power of two
    by_memory = 1 << max(0, (GATE_BUDGET // (2 * 4 * cell_dim)).bit_length() - 1)  # the power of two within
    return min(max(by_length, FEWEST_DEFAULT_ROWS), by_memory, MAX_DEFAULT_ROWS)
