"""Training's recurrence replayed from CUDA graphs (`elmo train --cuda-graph`).

A window's LSTM layer (20 steps of both directions forward, then backward) launches a few
hundred small kernels from the host; with 128 rows a GPU finishes each long before the next is
launched. `graphed` captures one layer's `elmokit.training.recurrence.LstmLayerFunction` (forward
and backward) once per shape with `torch.cuda.make_graphed_callables`, and every later window
replays the two graphs: the inputs are copied into static buffers, the weights are read where
they are (the optimizer updates them in place), the gradients come back through autograd as
before. Dropout, the residual, the token encoder and the softmax stay eager.

What is captured is the same `LstmLayerFunction` the CPU runs (with `BatchedProducts`), so the CPU
tests of that function cover what the graphs compute; only the capture needs CUDA. Evaluation
(no gradients) runs eagerly.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

GRAPHS_KEPT = 2  # shapes kept a layer (a run's windows have one shape; a last, smaller one may come)
_GRAPHED: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()  # layer -> {key: callable}


def should_capture(inputs: torch.Tensor) -> bool:
    """A CUDA tensor that needs gradients, CUDA available and not inside another capture."""
    return (inputs.device.type == "cuda" and torch.cuda.is_available() and torch.is_grad_enabled()
            and inputs.requires_grad and not torch.cuda.is_current_stream_capturing())


def graphed(owner: nn.Module, function: Callable, args: tuple[torch.Tensor, ...], key) -> Callable:
    """`function` (tensors in, a tuple of tensors out) as a graphed callable for args of these
    shapes, dtypes and gradient needs, made once and kept with `owner` (GRAPHS_KEPT of them).
    Parameters are captured where they are; every other argument through a static copy. Captured
    and replayed outside autocast (torch's capture refuses autocast's cache; the recurrence runs
    in float32 under `--bf16` anyway)."""
    graphs = _GRAPHED.setdefault(owner, {})
    full_key = (key, tuple((tuple(a.shape), a.dtype, a.requires_grad, a.data_ptr() if isinstance(a, nn.Parameter)
                            else None) for a in args))
    if full_key not in graphs:
        while len(graphs) >= GRAPHS_KEPT:
            graphs.pop(next(iter(graphs)))
        samples = tuple(a if isinstance(a, nn.Parameter) else a.detach().clone().requires_grad_(a.requires_grad)
                        for a in args)
        with torch.autocast("cuda", enabled=False):
            graphs[full_key] = torch.cuda.make_graphed_callables(function, samples)
    return _without_autocast(graphs[full_key])


def _without_autocast(function: Callable) -> Callable:
    def run(*args):
        with torch.autocast("cuda", enabled=False):
            return function(*args)
    return run
