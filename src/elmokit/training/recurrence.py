# Why this file is long: the recurrence's forward and backward pass through time, written out, with
# the two ways its products run (a direction at a time, both directions batched) and the eager
# cell the compiled passes stand in for, which the backward pass mirrors line by line.
"""How training runs the biLM's recurrence: one LSTM layer of both directions, forward and
backward through time written out by hand (one `torch.autograd.Function`).

Autograd over a step loop records ~20 small operations a step and keeps a copy of every
intermediate; `nn.LSTM(proj_size)` on the CPU is no faster (and cannot clip). Here a layer's
forward pass runs

    gate inputs   G = X W_in^T + b                     one product for all U steps     (D, U, B, 4C)
    every step    g = G_t + h_{t-1} W_rec^T            (i, f, o, j) = (σ, σ, σ, tanh)(g)
                  c_t = clip(f * c_{t-1} + i * j)       m_t = o * tanh(c_t)
                  h_t = clip(m_t W_proj^T)

writing each step into preallocated (D, U, B, .) buffers, and its backward pass runs the same
steps in reverse for the gradients that flow through time (dh, dc), while every weight
gradient is one product over all U steps at the end:

    dW_in = dG^T X      dW_rec = dG^T H_{t-1}      db = sum dG      dW_proj = dH^T M      dX = dG W_in

On the CPU every float32 product goes through `elmokit.kernels` (oneDNN's kernels, faster than
MKL's there: bench/results/train.md, "The kernels of the step"), one direction at a time (torch's
float32 batched product is MKL's: `DirectionProducts`), while each elementwise operation of a step
covers both directions (a leading D axis). The forward pass's recurrent product has its weight
reordered once a pass (`PackedLinear`, G_t added in the same call); the other per-step products
take their weights as they are (reordering a transposed weight costs several of the 20 steps'
products it would speed up: the same page). Off the CPU, and on it with bfloat16 operands
(`lstm_bf16`; oneDNN's batched bfloat16 product beats its per-direction ones there:
bench/results/train-lstm-bf16.md), both directions run in one batched product (`BatchedProducts`),
on a CUDA GPU optionally replayed from CUDA graphs (`cuda_graph`, `elmokit.training.cuda_graphs`):
`RecurrenceOptions`. The products are the only difference: the steps, the elementwise work and
the gradients are one code for every device.
The forward pass is `elmokit.model.cell`'s (gates in its order (i, f, o, j), the forget-gate
offset already in `bias`, its `cell_step` and `clip_`, its `run_layers` for dropout and the
residual), on the CPU every tanh as 2 σ(2x) - 1 as in inference (`forward_cell`); the backward pass is their
derivative written out (tests/test_lm.py checks it against autograd through the step loop of
`elmokit.model.lstm`, which runs the same functions with torch.tanh: a few float32 ulps apart).
Clipping follows `torch.clamp`: the gradient passes where the value was not clipped. On the CPU a step's
elementwise work is one compiled pass each way (`elmokit.model.fused_cell`), the functions below elsewhere;
the backward pass sums the bias' gradient as it goes, and with bfloat16 products writes the gates'
gradients in bfloat16, the operand of every product that reads them.

Shape notation: D 2 directions, U steps, B rows, P projection dim, C cell dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from elmokit.devices import without_autocast
from elmokit.kernels import PackedLinear, linear, matmul
from elmokit.training import cuda_graphs
from elmokit.model import cell as lstm_cell
from elmokit.model import fused_cell
from elmokit.model.lstm import BiLstm, LstmState


class LstmLayerFunction(torch.autograd.Function):
    """outputs (D, U, B, P), final hidden (D, B, P), final cell (D, B, C) of one layer.

    apply(inputs (D, U, B, P), hidden (D, B, P), cell (D, B, C), input_weight (D, 4C, P),
          recurrent_weight (D, 4C, P), bias (D, 1, 4C), projection (D, P, C), cell_clip, proj_clip,
          products: `DirectionProducts` or `BatchedProducts`)
    """

    @staticmethod
    def forward(ctx, inputs, hidden, cell, input_weight, recurrent_weight, bias, projection,
                cell_clip: float, proj_clip: float, products=None):
        products = products or DirectionProducts()
        n_dirs, n_steps, n_rows, dim = inputs.shape
        cell_dim = projection.shape[2]
        weights = products.weights(input_weight, recurrent_weight, projection)  # in the products' dtype
        flat_inputs = inputs.reshape(n_dirs, n_steps * n_rows, dim)
        step_inputs = products.gate_inputs(flat_inputs, weights[0], bias, n_steps, n_rows)  # G_t = X_t W_in^T + b
        acts = inputs.new_empty(n_dirs, n_steps, n_rows, 4 * cell_dim)  # the activated gates
        cells = inputs.new_empty(n_dirs, n_steps + 1, n_rows, cell_dim)  # c_0 .. c_U
        cells[:, 0] = cell
        tanh_cells = inputs.new_empty(n_dirs, n_steps, n_rows, cell_dim)
        # m_t, kept only as the projection's operand (and its weight gradient's): in the products' dtype
        cell_outputs = inputs.new_empty(n_dirs, n_steps, n_rows, cell_dim, dtype=products.operand_dtype(inputs.dtype))
        hiddens = inputs.new_empty(n_dirs, n_steps + 1, n_rows, dim)  # h_0 .. h_U
        hiddens[:, 0] = hidden
        recurrent = products.recurrent(weights[1], n_rows)  # G_t + h_{t-1} W_rec^T
        # per-step views made in one call each: (D, B, .) tensors, steps 0 .. U-1 (or U)
        step_acts, step_cells, step_tanh_cells = acts.unbind(1), cells.unbind(1), tanh_cells.unbind(1)
        step_outputs, step_hiddens = cell_outputs.unbind(1), hiddens.unbind(1)
        for step in range(n_steps):
            terms = recurrent(step_inputs[step], step_hiddens[step])
            buffers = (step_acts[step], step_cells[step], step_cells[step + 1], step_tanh_cells[step],
                       step_outputs[step])
            if not fused_cell.train_forward_(terms.gates, *buffers, cell_clip, terms.addends, terms.bias):
                forward_cell(terms.summed(), *buffers, cell_clip)  # the eager cell, where the compiled pass does not run
            lstm_cell.clip_(products.project(step_outputs[step], weights[2], step_hiddens[step + 1]),
                            proj_clip)  # h_t (D, B, P)
        ctx.save_for_backward(flat_inputs, *weights, acts, cells, tanh_cells, cell_outputs, hiddens)
        ctx.clips, ctx.products = (cell_clip, proj_clip), products
        return hiddens[:, 1:], hiddens[:, -1].clone(), cells[:, -1].clone()

    @staticmethod
    def backward(ctx, grad_outputs, grad_hidden, grad_cell):
        flat_inputs, input_weight, recurrent_weight, projection, acts, cells, tanh_cells, cell_outputs, hiddens = \
            ctx.saved_tensors
        (cell_clip, proj_clip), products = ctx.clips, ctx.products
        n_dirs, n_steps, n_rows, cell_dim = tanh_cells.shape
        dim, dtype = hiddens.shape[-1], hiddens.dtype
        forget_gate = acts[..., cell_dim:2 * cell_dim]  # (D, U, B, C)
        fused = acts.device.type == "cpu" and acts.dtype == torch.float32 and fused_cell.available()
        if fused:  # the compiled pass writes the gates' gradients as the products read them, and sums the bias'
            grad_gates = acts.new_empty(n_dirs, n_steps, n_rows, 4, cell_dim, dtype=products.operand_dtype(dtype))
            grad_bias = acts.new_zeros(n_dirs, 4 * cell_dim)
        else:  # the eager cell's factors, all steps at once (the compiled pass makes its own)
            factors, through_tanh = gate_factors(acts, cells, tanh_cells)
            cell_mask = (cells[:, 1:].abs() < cell_clip).to(cells.dtype) if cell_clip else None
            grad_gates = acts.new_empty(n_dirs, n_steps, n_rows, 4, cell_dim)
            grad_m = cells.new_empty(n_dirs, n_rows, cell_dim)
        hidden_mask = (hiddens[:, 1:].abs() < proj_clip).to(dtype) if proj_clip else None
        if grad_outputs is None:
            grad_outputs = hiddens.new_zeros(n_dirs, n_steps, n_rows, dim)
        grad_hiddens = hiddens.new_empty(n_dirs, n_steps, n_rows, dim)  # dL/d(projection before its clip)
        recurrent_grad = grad_hidden if grad_hidden is not None else hiddens.new_zeros(n_dirs, n_rows, dim)
        cell_grad = grad_cell.clone(memory_format=torch.contiguous_format) if grad_cell is not None else \
            cells.new_zeros(n_dirs, n_rows, cell_dim)  # the fused pass writes dL/dc_{t-1} over it
        for step in reversed(range(n_steps)):  # both directions in every elementwise operation
            grad_h = torch.add(grad_outputs[:, step], recurrent_grad, out=grad_hiddens[:, step])  # (D, B, P)
            if hidden_mask is not None:
                grad_h.mul_(hidden_mask[:, step])
            step_grads = grad_gates[:, step]  # (D, B, 4, C)
            if fused:  # grad_h W_proj as each direction's product comes, float32 or bfloat16
                if not fused_cell.train_backward_(products.times_each(grad_h, projection), cell_grad, acts[:, step],
                                                  cells[:, step], cells[:, step + 1], tanh_cells[:, step], step_grads,
                                                  cell_clip, grad_bias):  # cannot happen: the buffers are its own
                    raise RuntimeError("the LSTM cell's compiled backward pass refused its forward pass's buffers")
            else:
                products.times(grad_h, projection, out=grad_m)  # grad_h W_proj (D, B, C)
                cell_grad = backward_cell(grad_m, cell_grad, through_tanh[:, step], factors[:, step],
                                          forget_gate[:, step], None if cell_mask is None else cell_mask[:, step],
                                          step_grads)
            recurrent_grad = products.times(step_grads.view(n_dirs, n_rows, 4 * cell_dim),
                                            recurrent_weight).to(dtype)  # (D, B, P): grad_g W_rec
        flat_gates = grad_gates.view(n_dirs, n_steps * n_rows, 4 * cell_dim)  # (D, U*B, 4C)
        flat_grad_hiddens = grad_hiddens.view(n_dirs, n_steps * n_rows, dim)
        flat_outputs = cell_outputs.view(n_dirs, n_steps * n_rows, cell_dim)
        grad_inputs = products.matmul(flat_gates, input_weight).to(dtype).view(n_dirs, n_steps, n_rows, dim)
        grad_input_weight = products.matmul(flat_gates.mT, flat_inputs).to(dtype)  # (D, 4C, P)
        grad_recurrent_weight = products.matmul(  # (D, 4C, P): against h_{t-1}
            flat_gates.mT, hiddens[:, :-1].reshape(n_dirs, n_steps * n_rows, dim)).to(dtype)
        grad_bias = grad_bias.unsqueeze(1) if fused else flat_gates.sum(dim=1, keepdim=True)  # (D, 1, 4C)
        grad_projection = products.matmul(flat_grad_hiddens.mT, flat_outputs).to(dtype)  # (D, P, C)
        return (grad_inputs, recurrent_grad, cell_grad, grad_input_weight,
                grad_recurrent_weight, grad_bias, grad_projection, None, None, None)


class GateTerms(NamedTuple):
    """A step's gate pre-activations (i, f, o, j) as the products give them: `gates` the whole float32
    sum G_t + h_{t-1} W_rec^T ((D, B, 4C), or a list of each direction's (B, 4C)); or, with bfloat16
    products, three terms added in float32 in this order: `bias` (D, 4C) + `gates` (the input
    products X_t W_in^T, bfloat16, (D, B, 4C) or D x (B, 4C)) + `addends` (the recurrent products,
    the same), which the compiled pass adds as it reads them."""

    gates: list[torch.Tensor] | torch.Tensor
    addends: list[torch.Tensor] | torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def summed(self) -> list[torch.Tensor] | torch.Tensor:
        """The float32 pre-activations (new tensors where there are terms)."""
        if self.bias is None:
            return self.gates
        if isinstance(self.gates, torch.Tensor):
            return torch.add(self.bias.unsqueeze(1), self.gates).add_(self.addends)
        return [torch.add(self.bias[d], gate).add_(addend)
                for d, (gate, addend) in enumerate(zip(self.gates, self.addends, strict=True))]


class DirectionProducts:
    """The CPU's float32 products: through `elmokit.kernels` (oneDNN), a direction at a time (torch's
    float32 batched product is MKL's, slower); the forward pass's recurrent weight reordered once a
    pass (`PackedLinear`, G_t added in the same call). Every product in float32, or with `dtype`
    bfloat16 (`RecurrenceOptions(batched=False, lstm_bf16=True)`; `--lstm-bf16` runs `BatchedProducts`
    on the CPU, faster there) every product's operands rounded to bfloat16 (the weights once a pass,
    from their float32 master copy) and run by oneDNN's bfloat16 kernels (AVX512-BF16, AMX), its
    result widened to float32 before anything is added to it: as `BatchedProducts`', the gates, the
    cell and recurrent state and every sum over steps stay float32 (so the bias, G_t and the
    recurrent product are added in float32 by the cell: `GateTerms`). A tensor kept only as a
    product's operand (m_t; with the compiled passes the gates' gradients) is kept in its dtype."""

    def __init__(self, dtype: torch.dtype | None = None):
        self.dtype = dtype  # None: float32, the inputs' own

    def _operand(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.dtype is None else tensor.to(self.dtype)

    def operand_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a tensor used only as the products' operand is kept in, for state in `dtype`."""
        return self.dtype or dtype

    def weights(self, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(map(self._operand, weights))

    def gate_inputs(self, flat_inputs: torch.Tensor, input_weight: torch.Tensor, bias: torch.Tensor,
                    n_steps: int, n_rows: int) -> list[GateTerms]:
        """(D, U*B, P) -> X W_in^T + b, for each of the U steps the `GateTerms` of D (B, 4C) (each
        direction's product stays its own tensor: no copy into one); with `dtype` the products
        without the bias, which the cell adds in float32."""
        low = self._operand(flat_inputs)
        products = [linear(low[d], input_weight[d], None if self.dtype else bias[d, 0]) for d in range(len(low))]
        steps = zip(*(product.view(n_steps, n_rows, product.shape[-1]).unbind(0) for product in products))
        return [GateTerms(list(step), bias=bias[:, 0] if self.dtype else None) for step in steps]

    def recurrent(self, recurrent_weight: torch.Tensor, n_rows: int) -> Callable:
        """(the `GateTerms` of G_t, h_{t-1} (D, B, P)) -> GateTerms of G_t + h_{t-1} W_rec^T: the
        float32 sums, or with `dtype` the products h_{t-1} W_rec^T as its addends."""
        packed = [PackedLinear(recurrent_weight[d], n_rows) for d in range(len(recurrent_weight))]
        if self.dtype is None:
            return lambda terms, hidden: GateTerms([packed[d].add(terms.gates[d], hidden[d])
                                                    for d in range(len(packed))])

        def low(terms: GateTerms, hidden: torch.Tensor) -> GateTerms:
            operand = hidden.to(self.dtype)
            return terms._replace(addends=[packed[d](operand[d]) for d in range(len(packed))])
        return low

    def project(self, cell_output: torch.Tensor, projection: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """m_t (D, B, C) -> m_t W_proj^T into out (D, B, P)."""
        low = self._operand(cell_output)
        return torch.stack([linear(low[d], projection[d]) for d in range(len(projection))], out=out)

    def times_each(self, grad: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor]:
        """grad (D, B, out) x weight (D, out, in) -> each direction's (B, in) in the products' dtype."""
        low = self._operand(grad)
        return [linear(low[d], weight[d].mT) for d in range(len(weight))]

    def times(self, grad: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """grad (D, B, out) x weight (D, out, in) -> (D, B, in): a gradient through a product."""
        products = self.times_each(grad, weight)
        return torch.stack(products, out=out) if out is not None else torch.stack(products).to(grad.dtype)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """(D, m, k) x (D, k, n) -> (D, m, n): the weight gradients, over all steps at once."""
        low_a, low_b = self._operand(a), self._operand(b)
        return _per_direction(len(a), lambda d: matmul(low_a[d], low_b[d])).to(a.dtype)


class BatchedProducts:
    """Both directions in one batched product (`torch.bmm`): what runs off the CPU (cuBLAS on a GPU),
    one kernel a product instead of one a direction, and on the CPU with bfloat16 operands (oneDNN's
    batched bfloat16 product there beats two of its per-direction ones at every product of a
    training step: bench/results/train-lstm-bf16.md). With `dtype` bfloat16 the products' operands
    are rounded to bfloat16 (the weights once a pass) and summed in float32 inside the kernel, their
    results bfloat16: the bias, G_t and the recurrent product are added in float32 by the cell
    (`GateTerms`), and the gates, the cell and recurrent state and every sum over steps stay
    float32 (`elmo train --lstm-bf16`); a tensor kept only as a product's operand (m_t; with the
    compiled passes the gates' gradients) is kept in bfloat16."""

    def __init__(self, dtype: torch.dtype | None = None):
        self.dtype = dtype  # None: the inputs' own

    def operand_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a tensor used only as the products' operand is kept in, for state in `dtype`."""
        return self.dtype or dtype

    def weights(self, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return weights if self.dtype is None else tuple(weight.to(self.dtype) for weight in weights)

    def _bmm(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(D, m, k) x (D, k, n) in the products' dtype: the result in it, or written into `out` (any dtype)."""
        if self.dtype is not None:
            a, b = a.to(self.dtype), b.to(self.dtype)
        if out is None or out.dtype == a.dtype:
            return torch.bmm(a, b, out=out)
        return out.copy_(torch.bmm(a, b))

    def gate_inputs(self, flat_inputs: torch.Tensor, input_weight: torch.Tensor, bias: torch.Tensor,
                    n_steps: int, n_rows: int) -> list[GateTerms]:
        """(D, U*B, P) -> X W_in^T + b, for each of the U steps the `GateTerms` of a (D, B, 4C) view;
        with `dtype` the products without the bias, which the cell adds in float32."""
        if self.dtype is None:
            sums = torch.baddbmm(bias, flat_inputs, input_weight.mT)
        else:
            sums = torch.bmm(flat_inputs.to(self.dtype), input_weight.mT)
        steps = sums.view(len(sums), n_steps, n_rows, sums.shape[-1]).unbind(1)
        return [GateTerms(step, bias=None if self.dtype is None else bias[:, 0]) for step in steps]

    def recurrent(self, recurrent_weight: torch.Tensor, n_rows: int) -> Callable:
        """(the `GateTerms` of G_t, h_{t-1} (D, B, P)) -> those of G_t + h_{t-1} W_rec^T (D, B, 4C):
        the float32 sums, or with `dtype` the products h_{t-1} W_rec^T as their addends."""
        transposed = recurrent_weight.mT  # (D, P, 4C)
        if self.dtype is None:
            return lambda terms, hidden: GateTerms(torch.baddbmm(terms.gates, hidden, transposed))
        return lambda terms, hidden: terms._replace(addends=torch.bmm(hidden.to(self.dtype), transposed))

    def project(self, cell_output: torch.Tensor, projection: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self._bmm(cell_output, projection.mT, out=out)

    def times_each(self, grad: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor]:
        return list(self._bmm(grad, weight).unbind(0))

    def times(self, grad: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._bmm(grad, weight, out=out)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self._bmm(a, b)


def forward_cell(gates: list[torch.Tensor] | torch.Tensor, acts: torch.Tensor, cell_prev: torch.Tensor,
                 cell_next: torch.Tensor, tanh_cell: torch.Tensor, cell_output: torch.Tensor, cell_clip: float,
                 via_sigmoid: bool | None = None) -> None:
    """A step's elementwise work forward, both directions, into the pass's buffers.

    gates: G_t + h_{t-1} W_rec^T, (D, B, 4C) or a list of each direction's (B, 4C), the products'
    fresh results (on the CPU their candidate's slot is doubled in place). Writes acts (D, B, 4C) =
    (σ(i), σ(f), σ(o), tanh(j)), cell_next c_t = clip(f * c_{t-1} + i * j) (D, B, C), tanh_cell
    tanh(c_t) and cell_output m_t = o * tanh(c_t). `via_sigmoid` (None: on the CPU) makes every tanh
    2 σ(2x) - 1 (`tanh_via_sigmoid`, as in inference: torch's sigmoid on the CPU is faster than its
    tanh, so one sigmoid covers the four gates); else torch.tanh (on a GPU both are
    memory-bound: the extra operations would only cost).
    """
    pairs = [(gates, acts)] if isinstance(gates, torch.Tensor) else zip(gates, acts.unbind(0))
    if acts.device.type == "cpu" if via_sigmoid is None else via_sigmoid:
        for pre, out in pairs:
            torch.sigmoid(lstm_cell.double_candidate_(pre), out=out)
        lstm_cell.candidate_from_sigmoid_(acts)  # both directions at once
        tanh = lstm_cell.tanh_via_sigmoid
    else:
        for pre, out in pairs:
            lstm_cell.activate_gates(pre, out=out)
        tanh = torch.tanh
    lstm_cell.cell_step(acts, cell_prev, cell_clip, cell_next=cell_next, tanh_cell=tanh_cell, cell_output=cell_output,
                        tanh=tanh)


def gate_factors(acts: torch.Tensor, cells: torch.Tensor, tanh_cells: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """What multiplies each gate's gradient, times its activation's derivative, all steps at once:
    i <- dc * j, f <- dc * c_{t-1}, o <- dm * tanh(c_t), j <- dc * i; and o * (1 - tanh(c_t)^2), which
    carries dm_t into dc_t.

    acts (D, U, B, 4C), cells c_0 .. c_U (D, U+1, B, C), tanh_cells (D, U, B, C)
    -> factors (D, U, B, 4, C), through_tanh (D, U, B, C)

    Each is written in place into its slot, two operations a factor (σ' = σ - σ², tanh' = 1 - tanh²,
    as `torch.addcmul`s), no temporaries.
    """
    n_dirs, n_steps, n_rows, cell_dim = tanh_cells.shape
    input_gate, forget_gate, output_gate, candidate = lstm_cell.split_gates(acts)
    factors = acts.new_empty(n_dirs, n_steps, n_rows, lstm_cell.N_GATES, cell_dim)
    slots = factors.unbind(3)
    torch.addcmul(input_gate, input_gate, input_gate, value=-1, out=slots[0]).mul_(candidate)
    torch.addcmul(forget_gate, forget_gate, forget_gate, value=-1, out=slots[1]).mul_(cells[:, :-1])
    torch.addcmul(output_gate, output_gate, output_gate, value=-1, out=slots[2]).mul_(tanh_cells)
    torch.mul(candidate, candidate, out=slots[3])
    torch.addcmul(input_gate, input_gate, slots[3], value=-1, out=slots[3])  # i (1 - j²)
    through_tanh = torch.mul(tanh_cells, tanh_cells)
    return factors, torch.addcmul(output_gate, output_gate, through_tanh, value=-1, out=through_tanh)


def backward_cell(grad_m: torch.Tensor, cell_grad: torch.Tensor, through_tanh: torch.Tensor, factors: torch.Tensor,
                  forget_gate: torch.Tensor, cell_mask: torch.Tensor | None, step_grads: torch.Tensor
                  ) -> torch.Tensor:
    """A step's elementwise work backward, both directions: the gate gradients into step_grads
    (D, B, 4, C); returns dL/dc_{t-1} (D, B, C).

    grad_m dL/dm_t and cell_grad the cell gradient carried from step t+1 (D, B, C); through_tanh,
    factors and forget_gate: step t of `gate_factors` and of f; cell_mask: where c_t was not
    clipped (1.0), or None without clipping.
    """
    grad_c = torch.addcmul(cell_grad, grad_m, through_tanh)
    if cell_mask is not None:
        grad_c.mul_(cell_mask)
    torch.mul(factors[:, :, :2], grad_c.unsqueeze(2), out=step_grads[:, :, :2])
    torch.mul(factors[:, :, 2], grad_m, out=step_grads[:, :, 2])
    torch.mul(factors[:, :, 3], grad_c, out=step_grads[:, :, 3])
    return grad_c.mul_(forget_gate)


def _per_direction(n_dirs: int, product: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """torch.stack of product(d) over the directions d: (D, ...)."""
    return torch.stack([product(d) for d in range(n_dirs)])


@dataclass(frozen=True)
class RecurrenceOptions:
    """How training runs the recurrence (`TrainConfig`'s `lstm_bf16` and `cuda_graph`; the
    defaults compute what they always did).

    batched: both directions in one product (`BatchedProducts`); None: off the CPU, and on it for
        bfloat16 products (in float32 oneDNN's per-direction products are the faster ones there,
        in bfloat16 its batched one).
    lstm_bf16: the recurrence's products' operands in bfloat16, its state and sums in float32.
    cuda_graph: on a CUDA GPU, each layer's forward and backward replayed from CUDA graphs
        (`elmokit.training.cuda_graphs`): the same `LstmLayerFunction`, captured once a shape.
    """

    batched: bool | None = None
    lstm_bf16: bool = False
    cuda_graph: bool = False

    def products(self, device: torch.device) -> DirectionProducts | BatchedProducts:
        batched = (device.type != "cpu" or self.lstm_bf16) if self.batched is None else self.batched
        return (BatchedProducts if batched else DirectionProducts)(torch.bfloat16 if self.lstm_bf16 else None)


def lstm_layer(inputs: torch.Tensor, hidden: torch.Tensor, cell: torch.Tensor, input_weight: torch.Tensor,
               recurrent_weight: torch.Tensor, bias: torch.Tensor, projection: torch.Tensor,
               cell_clip: float = 0.0, proj_clip: float = 0.0, products=None):
    """One layer, both directions, time-major: see `LstmLayerFunction` (`products`: the
    `DirectionProducts` of the CPU by default)."""
    kind = inputs.device.type  # float32 state and products under autocast (see train --bf16); meta has none
    with without_autocast(kind):
        return LstmLayerFunction.apply(inputs.contiguous(), hidden, cell, input_weight, recurrent_weight, bias,
                                       projection, float(cell_clip), float(proj_clip), products)


def forward_streams(lstm: BiLstm, inputs: torch.Tensor, state: LstmState | None = None,
                    options: RecurrenceOptions | None = None) -> tuple[list[torch.Tensor], LstmState]:
    """Run `lstm`'s layers, each direction left to right over its own full-length streams.

    Args:
        lstm: the biLM's LSTM stacks (weights, clips, dropout, training mode).
        inputs: (D, B, U, P): direction 0's and direction 1's token representations, each read
            from position 0 to U-1 (the caller lays out the backward stream reversed).
        state: the state carried from the previous window; zeros if None.
        options: how the products run (`RecurrenceOptions`; the default's on the CPU: oneDNN).

    Returns:
        one (D, B, U, P) tensor per layer, and the state after the last position, in the
        weights' dtype (float32 under bf16 autocast).

    Dropout as bilm-tf's `DropoutWrapper(ResidualWrapper(cell))`: on every layer's input, and
    the residual (layer 2 on) adds the dropped input.
    """
    options = options or RecurrenceOptions()
    _, batch_size, _, _ = inputs.shape
    dtype = lstm.layers[0].input_weight.dtype  # float32 under bf16 autocast too
    if state is None:
        state = lstm.zero_state(batch_size, inputs.to(dtype))
    layer_input = inputs.to(dtype).transpose(1, 2)  # (D, U, B, P) time-major
    products = options.products(inputs.device)
    clips = (float(lstm.cell_clip), float(lstm.proj_clip))

    def run_layer(layer, dropped: torch.Tensor, index: int):
        args = (dropped.contiguous(), state.hidden[index].to(dtype), state.cell[index].to(dtype),
                layer.input_weight, layer.recurrent_weight, layer.gate_bias(), layer.projection)
        run = functools.partial(lstm_layer, cell_clip=clips[0], proj_clip=clips[1], products=products)
        if options.cuda_graph and cuda_graphs.should_capture(dropped):
            run = cuda_graphs.graphed(layer, run, args, (clips, type(products).__name__, options.lstm_bf16))
        output, hidden, cell = run(*args)
        return output, (hidden, cell)

    outputs, finals = lstm_cell.run_layers(lstm.layers, layer_input, lstm.dropout, lstm.training, run_layer)
    return ([output.transpose(1, 2) for output in outputs],  # (D, B, U, P)
            LstmState(torch.stack([h for h, _ in finals]), torch.stack([c for _, c in finals])))
