"""The ELMo LSTM cell and how its layers stack (bilm-tf's): the one definition of each.

    pre-activations   g = x W_in^T + h_{t-1} W_rec^T + b + FORGET_BIAS on f       gates (i, f, o, j)
    cell              c_t = clip(σ(f) * c_{t-1} + σ(i) * tanh(j), cell_clip)
    output            m_t = σ(o) * tanh(c_t)
    projection        h_t = clip(m_t W_proj^T, proj_clip)          (the recurrent state, before any residual)
    layers            every layer's input dropped (bilm-tf's DropoutWrapper); from layer 2 on the
                      output adds that dropped input (ResidualWrapper inside the DropoutWrapper)

A clip of 0 means none. Every path that runs the LSTM is a driver of these functions (it calls
`cell_step`, `clip_` and, but for the server, `run_layers`); none re-states a formula. Each exists
because the others cannot do its job:

    elmokit.model.lstm (BiLstm.forward)   the reference step loop: right-padded batches packed so
                                        ended rows drop out, an optional carried state (the
                                        original's stateful mode), gradients through autograd;
                                        `Elmo` fine-tuning and stateful embedding run it
    elmokit.inference.engine            stateless inference: many sentences streamed end to end
                                        through R rows (no row idles on padding), the cell in place
                                        with one sigmoid for the four gates, oneDNN products with
                                        weights reordered once; bfloat16 weights run here only
    elmokit.inference.cuda_graphs       the engine's `run_block` captured once and replayed on a
                                        GPU, where launching each small kernel from the host would
                                        leave the GPU waiting (the same code, not a new driver)
    elmokit.training.recurrence         LM training: a hand-written forward and backward through
                                        time, every weight gradient one product over all steps
                                        (autograd over the step loop keeps ~20 intermediates a
                                        step); its backward is these functions' derivative,
                                        checked against autograd through `elmokit.model.lstm`
    elmokit.training.cuda_graphs        that recurrence's forward and backward captured as CUDA
                                        graphs (`elmo train --cuda-graph`), again the same code
    elmokit.serve.recurrence            `elmo serve`: every layer advances one step at a time so a
                                        request's sentence joins any free row at the next step and
                                        leaves at its last (continuous batching); the engine needs
                                        its sentences known in advance. It adds the residual itself
                                        (one step of all layers at once), as `run_layers` does
    elmokit.model.fused_cell            the engine's and the server's step on the CPU: `cell_step`
                                        after `activate_doubled_gates_`, with `tanh_via_sigmoid`,
                                        as one compiled pass over a step's gates (csrc/lstm_cell.cpp,
                                        where eager torch makes a dozen). The one restatement of
                                        these formulas, in C++: checked against these functions each
                                        time it loads, and where it differs it does not run
    elmokit.inference.onnx_export       the ONNX export: a `scan` over the steps that an ONNX
                                        `Scan` can hold, for ONNX's own LSTM operator has no
                                        projection and clips the gate inputs, not the cell

The drivers choose where results go (`out=` buffers, in place) and how the products run; the
formulas are here. Shape notation: C cell dim, P projection dim; `...` any leading axes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

FORGET_BIAS = 1.0  # added to the forget gate at run time; the stored bias excludes it (as the original files)
N_GATES = 4  # (i, f, o, j): input, forget, output gates (sigmoid), then the candidate (tanh)


def forget_offset(cell_dim: int, device: torch.device) -> torch.Tensor:
    """(4C,): FORGET_BIAS at the forget gate's slots, 0 elsewhere (added to the stored bias)."""
    offset = torch.zeros(N_GATES * cell_dim, device=device)
    offset[cell_dim:2 * cell_dim] = FORGET_BIAS
    return offset


def split_gates(gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(..., 4C) -> four (..., C) views: input, forget, output, candidate."""
    return gates.chunk(N_GATES, dim=-1)


def activate_gates(gates: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(..., 4C) pre-activations -> (σ(i), σ(f), σ(o), tanh(j)), into `out` when given."""
    three = 3 * (gates.shape[-1] // N_GATES)
    if out is None:
        return torch.cat([torch.sigmoid(gates[..., :three]), torch.tanh(gates[..., three:])], dim=-1)
    torch.sigmoid(gates[..., :three], out=out[..., :three])
    torch.tanh(gates[..., three:], out=out[..., three:])
    return out


def tanh_via_sigmoid(values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """tanh(x) = 2 σ(2x) - 1 (torch's sigmoid is faster than its tanh on the CPU; absolute error a
    few float32 ulps of 1)."""
    return torch.mul(values, 2, out=out).sigmoid_().mul_(2).sub_(1)


def activate_doubled_gates_(gates: torch.Tensor) -> torch.Tensor:
    """`activate_gates` in place for gates whose candidate arrives doubled, (i, f, o, 2j) (the
    engine doubles the candidate's weight rows, exact in binary floating point; training doubles
    the slot with `double_candidate_`), so that one sigmoid covers all four: tanh(j) = 2 σ(2j) - 1."""
    return candidate_from_sigmoid_(gates.sigmoid_())


def double_candidate_(gates: torch.Tensor) -> torch.Tensor:
    """(..., 4C) pre-activations (i, f, o, j) -> (i, f, o, 2j) in place (exact: a power of two)."""
    cell_dim = gates.shape[-1] // N_GATES
    gates.narrow(-1, 3 * cell_dim, cell_dim).mul_(2)
    return gates


def candidate_from_sigmoid_(acts: torch.Tensor) -> torch.Tensor:
    """(σ(i), σ(f), σ(o), σ(2j)) -> (σ(i), σ(f), σ(o), tanh(j)) in place: the candidate's slot
    2 σ(2j) - 1."""
    cell_dim = acts.shape[-1] // N_GATES
    acts.narrow(-1, 3 * cell_dim, cell_dim).mul_(2).sub_(1)
    return acts


def clip_(values: torch.Tensor, limit: float) -> torch.Tensor:
    """values clamped in place to [-limit, limit]; a limit of 0 is no clip. The gradient passes
    where a value was not clipped (`torch.clamp`)."""
    return values.clamp_(-limit, limit) if limit else values


def cell_step(acts: torch.Tensor, cell_prev: torch.Tensor, cell_clip: float, *,
              cell_next: torch.Tensor | None = None, tanh_cell: torch.Tensor | None = None,
              cell_output: torch.Tensor | None = None,
              tanh: Callable[..., torch.Tensor] = torch.tanh) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the cell from its activated gates: acts (..., 4C) = (σ(i), σ(f), σ(o), tanh(j)),
    cell_prev (..., C) -> (c_t, m_t), both (..., C).

    c_t = clip(f * c_{t-1} + i * j, cell_clip), m_t = o * tanh(c_t). The optional buffers receive
    c_t (may be `cell_prev` itself: updated in place), tanh(c_t) and m_t; without them the results
    are new tensors (differentiable). `tanh` is torch.tanh or `tanh_via_sigmoid`.
    """
    input_gate, forget_gate, output_gate, candidate = split_gates(acts)
    cell = torch.mul(forget_gate, cell_prev, out=cell_next).addcmul_(input_gate, candidate)
    clip_(cell, cell_clip)
    tanh_of_cell = tanh(cell, out=tanh_cell if tanh_cell is not None else cell_output)
    return cell, torch.mul(output_gate, tanh_of_cell, out=cell_output)


def run_layers(layers: Any, inputs: torch.Tensor, dropout: float, training: bool,
               run_layer: Callable[[Any, torch.Tensor, int], tuple[torch.Tensor, Any]]
               ) -> tuple[list[torch.Tensor], list[Any]]:
    """The stack: each layer's input dropped (in training, p = dropout), the layer run by
    `run_layer(layer, dropped_input, index) -> (output, final)`, and from layer 2 on the output
    plus that dropped input (the residual); the next layer reads that sum.

    Returns every layer's output (with its residual) and every `final` (a driver's final state)."""
    outputs, finals = [], []
    layer_input = inputs
    for index, layer in enumerate(layers):
        dropped = F.dropout(layer_input, dropout, training) if dropout and training else layer_input
        output, final = run_layer(layer, dropped, index)
        if index > 0:
            output = output + dropped  # residual from layer 2 on, of the dropped input (bilm-tf)
        outputs.append(output)
        finals.append(final)
        layer_input = output
    return outputs, finals
