"""The stream engine's steps replayed from a CUDA graph: on a GPU, eager PyTorch launches every
kernel of a step from the host (~15 a step of both directions, a few microseconds each), so with
few rows the GPU waits on the launches. `GraphedBlocks` captures `elmokit.inference.engine.run_block`
for a block of steps once, with static buffers, and then runs a whole block with one replay:

    per block   copy the block's inputs and keep mask into the static buffers -> replay ->
                copy the block's outputs out; the state (hidden, cell) stays in its static buffers
                from one block to the next

What is captured is the code every path runs (`run_block`, with its batched products and the
state reset written as a multiplication at every step), so the CPU tests of `run_block` cover it;
only the capture itself (`capture`) needs CUDA. `ELMOKIT_CUDA_GRAPHS=0` turns graphs off (the
same steps then launch eagerly).

Shape notation: D 2 directions, K steps a block, R rows, P projection dim, U steps of the streams.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

GRAPHS_VARIABLE = "ELMOKIT_CUDA_GRAPHS"  # "0": never capture
GRAPH_STEPS = 32  # steps a graph runs at most (fewer where their gate inputs would not fit a budget)
GRAPHS_KEPT = 2  # graphs kept a layer (row counts; the last window of a run usually has fewer rows)


def wanted(device: torch.device) -> bool:
    """Whether the stream engine replays CUDA graphs on `device`: a CUDA device, CUDA available, not
    turned off, and not already inside a capture."""
    return (device.type == "cuda" and torch.cuda.is_available()
            and os.environ.get(GRAPHS_VARIABLE, "1").strip() != "0"
            and not torch.cuda.is_current_stream_capturing())


def capture(run: Callable[[], None]):
    """`run` captured in a CUDA graph (after one warm-up run on a side stream, as torch asks):
    returns the graph, whose `replay()` runs the same kernels on the same buffers."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up: cuBLAS picks its kernels and workspace outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


class GraphedBlocks:
    """A block of `steps` steps of one layer's streams, captured once (`capture`), replayed per block.

    Args:
        run_block: run_block(block_inputs (D, K, R, P), keep (K, R, 1), outputs (K, D, R, P)),
            reading and updating `state` in place.
        state: the static state (hidden, cell and scratch: `engine.StreamState`).
        steps: K.
        like: a tensor (D, U, R, P) of the inputs' dtype and device.
        bias: kept alive with the graph, which reads it.
    """

    def __init__(self, run_block: Callable, state, steps: int, like: torch.Tensor, bias: torch.Tensor):
        _, _, rows, dim = like.shape
        self.state, self.steps, self.bias = state, steps, bias
        self.inputs = like.new_zeros(2, steps, rows, dim)  # (D, K, R, P)
        self.keep = like.new_ones(steps, rows, 1)  # (K, R, 1)
        self.outputs = like.new_zeros(steps, 2, rows, dim)  # (K, D, R, P)
        self.graph = capture(lambda: run_block(self.inputs, self.keep, self.outputs))

    def run(self, inputs: torch.Tensor, keep: torch.Tensor, outputs: torch.Tensor) -> None:
        """inputs (D, U, R, P), keep (U, R, 1) -> outputs (U, D, R, P), from a zero state. The last
        block's steps past U run on the previous block's inputs; their outputs are not copied out."""
        for tensor in (self.state.hidden, self.state.cell):
            tensor.zero_()
        n_steps = inputs.shape[1]
        for first in range(0, n_steps, self.steps):
            count = min(self.steps, n_steps - first)
            self.inputs[:, :count].copy_(inputs[:, first:first + count])
            self.keep[:count].copy_(keep[first:first + count])
            self.graph.replay()
            outputs[first:first + count].copy_(self.outputs[:count])
