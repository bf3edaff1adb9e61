"""Sentences laid end to end in R streams (`stream_layout`), the layout the inference engine
(`elmokit.inference.engine`) runs: every row of the recurrence busy until the end, each sentence
still from a zero state."""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np
import torch


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
