"""The forward and backward LSTM stacks of the biLM (spec §6-§7), both directions at once.

    token representations (D, ..., P) -> BiLstmLayer x L (cell and projection clipping,
    residual from layer 2 on) -> one (.., 2P) output per layer, [forward | backward]

Three ways to run the same weights:
    BiLstm.forward            right-padded sentences, packed so rows that have ended drop out;
                              an optional carried state (spec §9); differentiable
    (LM training runs the same weights through `elmokit.training.recurrence`)
    BiLstm.forward_sentences  inference: many sentences streamed through R rows, each from a
                              zero state; oneDNN products on the CPU (`elmokit.inference.kernels`)

Shape notation (as in model.py): B batch, S positions with boundaries, N real positions,
P projection dim, C cell dim, L layers, D = 2 directions, U steps, R rows of the recurrence.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from elmokit.model.config import ElmoConfig
from elmokit.inference.kernels import PackedLinear

# ---------------------------------------------------------------------------------------------
# Forward and backward LSTM stacks with projection, clipping and residuals
# ---------------------------------------------------------------------------------------------
class LstmState(NamedTuple):
    """Recurrent state of every layer and direction: hidden (L, D, B, P), cell (L, D, B, C)."""

    hidden: torch.Tensor
    cell: torch.Tensor


class _PackedOrder(NamedTuple):
    """Where each step's rows live in the flattened (B*S) positions, for both directions.

    Rows are sorted by length (longest first) so that the rows still running at step t are a
    prefix; the backward direction reads each row from its last real position to its first.
    """

    order: torch.Tensor  # (B,) sorted row -> original row
    forward_index: torch.Tensor  # (N,) packed position -> flat position, forward direction
    backward_index: torch.Tensor  # (N,) likewise, backward direction
    batch_sizes: list[int]  # rows still running at each step


def _packed_order(lengths: torch.Tensor, n_positions: int) -> _PackedOrder:
    lengths, order = torch.sort(lengths, descending=True, stable=True)
    steps = torch.arange(n_positions, device=lengths.device)
    running = steps < lengths.unsqueeze(1)  # (B, S) in sorted order
    step, row = running.t().nonzero(as_tuple=True)  # time-major: step 0's rows, then step 1's …
    base = order[row] * n_positions
    return _PackedOrder(
        order=order,
        forward_index=base + step,
        backward_index=base + lengths[row] - 1 - step,
        batch_sizes=running.sum(dim=0).tolist(),
    )


class _StreamLayout(NamedTuple):
    """Sentences laid end to end in R streams, read one step of every stream at a time.

    Each sentence still starts from a zero state (`starts` marks where the state is reset), so
    the results are those of one sentence at a time, but all R rows of the recurrence stay busy
    until the end instead of idling while the longest sentence of a batch finishes.
    """

    forward_index: torch.Tensor  # (U, R) flat position read at each step of each stream; N = none
    backward_index: torch.Tensor  # (U, R) the same, every sentence read from its end
    starts: torch.Tensor  # (U, R) bool: a sentence starts here
    reset_steps: list[bool]  # (U,) any start at this step


def _stream_layout(sizes: np.ndarray, rows: int) -> _StreamLayout:
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
    return _StreamLayout(torch.from_numpy(forward), torch.from_numpy(backward),
                         torch.from_numpy(starts), starts.any(axis=1).tolist())


def _lstm_cell(gates: torch.Tensor, cell: torch.Tensor, cell_dim: int, cell_clip: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gates (D, b, 4C) in the order (i, f, o, j) and the previous cell -> (new cell, o * tanh(cell))."""
    input_gate, forget_gate, output_gate = torch.sigmoid(gates[..., :3 * cell_dim]).chunk(3, -1)
    cell = torch.addcmul(forget_gate * cell, input_gate, torch.tanh(gates[..., 3 * cell_dim:]))
    if cell_clip:
        cell = cell.clamp(-cell_clip, cell_clip)
    return cell, output_gate * torch.tanh(cell)


def _lstm_cell_(gates: torch.Tensor, cell: torch.Tensor, cell_output: torch.Tensor, cell_dim: int,
                cell_clip: float) -> None:
    """`_lstm_cell` in place, for inference, with every tanh as tanh(x) = 2 sigmoid(2x) - 1
    (torch's sigmoid is ~4x faster than its tanh on the CPU): gates (R, 4C) hold (i, f, o, 2j),
    the candidate pre-doubled by the weights (exact in binary floating point), and are
    overwritten; cell (R, C) is updated; cell_output (R, C) is set to o * tanh(cell)."""
    input_gate, forget_gate, output_gate, candidate = gates.sigmoid_().chunk(4, dim=-1)
    candidate.mul_(2).sub_(1)  # tanh(j)
    cell.mul_(forget_gate).addcmul_(input_gate, candidate)
    if cell_clip:
        cell.clamp_(-cell_clip, cell_clip)
    torch.mul(cell, 2, out=cell_output).sigmoid_().mul_(2).sub_(1).mul_(output_gate)  # o * tanh(cell)


class BiLstmLayer(nn.Module):
    """One LSTM layer with projection for both directions, weights stacked on a leading D axis.

    Gates are kept in the order (i, f, o, j): the three sigmoid gates, then the candidate j.
    As in the original, the stored bias excludes the forget-gate offset: +1 is added to the forget
    gate at run time (`FORGET_BIAS`), so the original files round-trip bit for bit.
    """

    FORGET_BIAS = 1.0

    def __init__(self, input_dim: int, cell_dim: int, projection_dim: int):
        super().__init__()
        self.cell_dim = cell_dim
        # Weights are (D, out, in), as in nn.Linear.
        self.input_weight = nn.Parameter(torch.empty(2, 4 * cell_dim, input_dim))  # (D, 4C, P)
        self.recurrent_weight = nn.Parameter(torch.empty(2, 4 * cell_dim, projection_dim))  # (D, 4C, P)
        self.bias = nn.Parameter(torch.empty(2, 1, 4 * cell_dim))  # (D, 1, 4C)
        self.projection = nn.Parameter(torch.empty(2, projection_dim, cell_dim))  # (D, P, C)
        offset = torch.zeros(4 * cell_dim)
        offset[cell_dim:2 * cell_dim] = self.FORGET_BIAS
        self.register_buffer("forget_offset", offset, persistent=False)  # (4C,)

    def forward(
        self,
        inputs: torch.Tensor,  # (D, N, P) packed
        batch_sizes: list[int],
        hidden: torch.Tensor,  # (D, B, P) initial, sorted rows
        cell: torch.Tensor,  # (D, B, C)
        cell_clip: float,
        proj_clip: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns the packed outputs (D, N, P) and the final hidden (D, B, P) and cell (D, B, C)."""
        gate_inputs = torch.baddbmm(self.bias + self.forget_offset, inputs, self.input_weight.mT)  # (D, N, 4C)
        recurrent_weight, projection = self.recurrent_weight.mT, self.projection.mT
        outputs, finished = [], []
        # split (not slicing per step): its backward does not zero a full-size gradient per step
        for step_inputs in gate_inputs.split(batch_sizes, dim=1):
            batch_size = step_inputs.shape[1]
            if batch_size < hidden.shape[1]:  # the shortest rows have ended: keep their state
                finished.append((hidden[:, batch_size:], cell[:, batch_size:]))
                hidden, cell = hidden[:, :batch_size], cell[:, :batch_size]
            gates = torch.baddbmm(step_inputs, hidden, recurrent_weight)  # (D, b, 4C)
            cell, cell_output = _lstm_cell(gates, cell, self.cell_dim, cell_clip)  # (D, b, C)
            hidden = torch.bmm(cell_output, projection)  # (D, b, P)
            if proj_clip:
                hidden = hidden.clamp(-proj_clip, proj_clip)
            outputs.append(hidden)
        finished.append((hidden, cell))
        final_hidden = torch.cat([h for h, _ in reversed(finished)], dim=1)  # (D, B, P)
        final_cell = torch.cat([c for _, c in reversed(finished)], dim=1)  # (D, B, C)
        return torch.cat(outputs, dim=1), final_hidden, final_cell

    GATE_BUDGET = 1 << 23  # floats of precomputed gate inputs held at once by `stream` (32 MB)

    @torch.no_grad()
    def stream(self, inputs: torch.Tensor, layout: _StreamLayout, cell_clip: float, proj_clip: float
               ) -> torch.Tensor:
        """Inference: inputs (D, U, R, P) laid out by `_stream_layout` -> outputs (D, U, R, P),
        every sentence from a zero state. The gate inputs are computed a block of steps at a
        time (bounded memory however long the streams); the products go through
        `elmokit.inference.kernels.PackedLinear` (oneDNN on the CPU); the elementwise work is done in place.

        Weights in a reduced precision (`BiLM.to(torch.bfloat16)`) with float32 inputs: each
        product runs in the weights' dtype, while the bias, the gates, the cell state, the
        recurrent state and the outputs stay in the inputs' dtype."""
        _, n_steps, rows, dim = inputs.shape
        cell_dim = self.cell_dim
        compute_dtype = self.input_weight.dtype  # of the products
        mixed = compute_dtype != inputs.dtype
        block = max(1, min(n_steps, self.GATE_BUDGET // (2 * rows * 4 * cell_dim)))  # steps of gate inputs at once
        input_products, recurrent_products, projections = self._packed(rows)
        keep = (~layout.starts).to(device=inputs.device, dtype=inputs.dtype).unsqueeze(-1)  # (U, R, 1)
        bias = ((self.bias.to(inputs.dtype) + self.forget_offset.to(inputs.dtype))
                * self._candidate_doubled().to(inputs.dtype)).squeeze(1)  # (D, 4C): (i, f, o, 2j)
        outputs = inputs.new_empty(2, n_steps, rows, dim)
        hidden = inputs.new_zeros(2, rows, dim)
        cell = inputs.new_zeros(2, rows, cell_dim)
        cell_output = inputs.new_empty(2, rows, cell_dim)
        for first in range(0, n_steps, block):
            block_inputs = inputs[:, first:first + block]  # (D, k, R, P)
            if mixed:  # the product in compute_dtype, the bias added in the inputs' dtype
                gate_inputs = [torch.add(bias[d], input_products[d](block_inputs[d].reshape(-1, dim).to(compute_dtype)))
                               .view(-1, rows, 4 * cell_dim) for d in range(2)]  # D x (k, R, 4C)
            else:
                gate_inputs = [input_products[d](block_inputs[d].reshape(-1, dim), bias[d]).view(-1, rows, 4 * cell_dim)
                               for d in range(2)]  # D x (k, R, 4C)
            for offset in range(len(gate_inputs[0])):
                step = first + offset
                if layout.reset_steps[step]:  # a new sentence starts in some rows: zero their state
                    hidden = hidden * keep[step]  # not in place: `hidden` is the last step's output
                    cell.mul_(keep[step])
                product_hidden = hidden.to(compute_dtype)  # (D, R, P); `hidden` itself when not mixed
                for d in range(2):
                    if mixed:
                        gates = torch.add(gate_inputs[d][offset], recurrent_products[d](product_hidden[d]))  # (R, 4C)
                    else:
                        gates = recurrent_products[d].add(gate_inputs[d][offset], hidden[d])  # (R, 4C)
                    _lstm_cell_(gates, cell[d], cell_output[d], cell_dim, cell_clip)
                    outputs[d, step] = projections[d](cell_output[d].to(compute_dtype))  # (R, P)
                hidden = outputs[:, step]
                if proj_clip:
                    hidden.clamp_(-proj_clip, proj_clip)
        return outputs

    def _candidate_doubled(self) -> torch.Tensor:
        """(4C,): 1 for the gates i, f, o, 2 for the candidate j."""
        scale = self.forget_offset.new_ones(4 * self.cell_dim)
        scale[3 * self.cell_dim:] = 2.0
        return scale

    def __getstate__(self) -> dict:
        """copy.deepcopy and pickle leave out the reordered weights (oneDNN's opaque tensors cannot
        be copied): a copy remakes them on first use."""
        state = super().__getstate__()
        state.pop("_packed_products", None)
        return state

    def _packed(self, rows: int) -> tuple[list[PackedLinear], ...]:
        """The input, recurrent and projection products of each direction, their weights
        reordered for oneDNN (the candidate's rows doubled, see `_lstm_cell_`): made once per
        row count, kept until a weight changes."""
        weights = (self.input_weight, self.recurrent_weight, self.projection)
        key = (rows, *((weight.data_ptr(), weight._version, weight.dtype) for weight in weights))
        cache = self.__dict__.get("_packed_products")
        if cache is None or cache[0] != key:
            block_rows = max(rows, self.GATE_BUDGET // (2 * 4 * self.cell_dim))  # input products: a block of steps
            doubled = self._candidate_doubled()[:, None]  # (4C, 1)
            products = tuple([PackedLinear(weight[d], hint, row_scale=scale) for d in range(2)]
                             for weight, scale, hint in zip(weights, (doubled, doubled, None), (block_rows, rows, rows)))
            self.__dict__["_packed_products"] = cache = (key, products)
        return cache[1]


class BiLstm(nn.Module):
    """The forward and the backward LSTM stacks, run together but never mixing (spec §6).

    Layer l >= 1 adds its input to its output (residual); the recurrent state is the clipped
    projection before the residual. `dropout` is applied to every layer's input in training.
    """

    def __init__(self, config: ElmoConfig, dropout: float = 0.0):
        super().__init__()
        lstm = config.lstm
        self.cell_dim, self.projection_dim = lstm.cell_dim, lstm.projection_dim
        self.cell_clip, self.proj_clip = lstm.cell_clip, lstm.proj_clip
        self.dropout = dropout
        self.layers = nn.ModuleList(
            BiLstmLayer(lstm.projection_dim, lstm.cell_dim, lstm.projection_dim)
            for _ in range(lstm.n_layers)
        )

    def zero_state(self, batch_size: int, reference: torch.Tensor) -> LstmState:
        shape = (len(self.layers), 2, batch_size)
        return LstmState(reference.new_zeros(*shape, self.projection_dim),
                         reference.new_zeros(*shape, self.cell_dim))

    def forward(
        self, inputs: torch.Tensor, lengths: torch.Tensor, state: LstmState | None = None
    ) -> tuple[list[torch.Tensor], LstmState | None]:
        """Run both directions over right-padded sequences.

        Args:
            inputs: (B, S, P) token representations; positions >= lengths are ignored.
            lengths: (B,) number of real positions of each row (>= 1).
            state: initial state (hidden (L, D, B, P), cell (L, D, B, C)); zeros if None.

        Returns:
            one (B, S, 2P) tensor per layer, [forward | backward], zero at padding; and the final
            state: forward after each row's last position, backward after its first. With
            weights in a reduced precision (inference only, zero initial state) the final state
            is None.
        """
        if self.layers[0].input_weight.dtype != inputs.dtype:
            return self._forward_reduced(inputs, lengths, state), None
        batch_size, n_positions, _ = inputs.shape
        packing = _packed_order(lengths.cpu(), n_positions)
        forward_index = packing.forward_index.to(inputs.device)
        backward_index = packing.backward_index.to(inputs.device)
        order = packing.order.to(inputs.device)
        if state is None:
            state = self.zero_state(batch_size, inputs)

        flat = inputs.reshape(batch_size * n_positions, -1)  # (B*S, P)
        packed = torch.stack([flat[forward_index], flat[backward_index]])  # (D, N, P)
        sorted_state = LstmState(state.hidden[:, :, order], state.cell[:, :, order])
        packed_outputs, final = self._run_layers(packed, packing.batch_sizes, sorted_state)
        layer_outputs = [self._unpack(output, forward_index, backward_index, inputs.shape)
                         for output in packed_outputs]
        unsort = torch.empty_like(order)
        unsort[order] = torch.arange(batch_size, device=order.device)
        return layer_outputs, LstmState(final.hidden[:, :, unsort], final.cell[:, :, unsort])

    def _forward_reduced(self, inputs: torch.Tensor, lengths: torch.Tensor, state: LstmState | None
                         ) -> list[torch.Tensor]:
        """`forward` with bfloat16 weights and float32 inputs: the stream path (`forward_sentences`),
        one row per sentence. For inference: no gradient, no carried state."""
        dtype = self.layers[0].input_weight.dtype
        if state is not None:
            raise ValueError(f"an LSTM with {dtype} weights runs from a zero state only (no carried state); "
                             "use float32 weights for stateful runs")
        if torch.is_grad_enabled() and (inputs.requires_grad or any(p.requires_grad for p in self.parameters())):
            raise ValueError(f"an LSTM with {dtype} weights is for inference only; fine-tune in float32")
        batch_size, n_positions, dim = inputs.shape
        mask = torch.arange(n_positions, device=inputs.device) < lengths.to(inputs.device).unsqueeze(1)  # (B, S)
        layers = self.forward_sentences(inputs[mask], lengths.cpu().numpy(), batch_size)  # L x (N, 2P)
        outputs = []
        for layer in layers:
            padded = inputs.new_zeros(batch_size, n_positions, 2 * dim)  # (B, S, 2P)
            padded[mask] = layer
            outputs.append(padded)
        return outputs

    @torch.no_grad()
    def forward_sentences(self, tokens: torch.Tensor, sizes: np.ndarray, rows: int) -> list[torch.Tensor]:
        """Inference (no gradients): many sentences, each from a zero state, `rows` at a time.

        Args:
            tokens: (N, P) token representations of all sentences end to end, boundaries included.
            sizes: (n,) positions of each sentence (its tokens + 2).
            rows: rows of the recurrence; each sentence starts in the row the last one freed.

        Returns:
            one (N, 2P) tensor per layer, [forward | backward], in the order of `tokens`.
        """
        n_positions, dim = tokens.shape
        layout = _stream_layout(np.asarray(sizes, np.int64), rows)
        indices = [index.to(tokens.device) for index in (layout.forward_index, layout.backward_index)]
        padded = torch.cat([tokens, tokens.new_zeros(1, dim)])  # position N: the idle tail of a stream
        layer_input = torch.stack([padded[index] for index in indices])  # (D, U, R, P)
        outputs = []
        for number, layer in enumerate(self.layers):
            output = layer.stream(layer_input, layout, self.cell_clip, self.proj_clip)
            if number > 0:
                output = output + layer_input  # residual from layer 2 on
            unpacked = tokens.new_empty(n_positions + 1, 2 * dim)
            for direction, index in enumerate(indices):
                unpacked[:, direction * dim:(direction + 1) * dim][index.flatten()] = output[direction].flatten(0, 1)
            outputs.append(unpacked[:n_positions])
            layer_input = output
        return outputs

    def _run_layers(self, layer_input: torch.Tensor, batch_sizes: list[int], state: LstmState
                    ) -> tuple[list[torch.Tensor], LstmState]:
        """All layers over packed time-major inputs (D, N, P); state rows in packed order."""
        outputs, final_hidden, final_cell = [], [], []
        for index, layer in enumerate(self.layers):
            dropped = F.dropout(layer_input, self.dropout, self.training) if self.dropout else layer_input
            output, hidden, cell = layer(dropped, batch_sizes, state.hidden[index], state.cell[index],
                                         self.cell_clip, self.proj_clip)
            if index > 0:
                output = output + dropped  # residual from layer 2 on, of the dropped input (bilm-tf)
            outputs.append(output)
            final_hidden.append(hidden)
            final_cell.append(cell)
            layer_input = output
        return outputs, LstmState(torch.stack(final_hidden), torch.stack(final_cell))

    @staticmethod
    def _unpack(packed: torch.Tensor, forward_index: torch.Tensor, backward_index: torch.Tensor,
                shape: torch.Size) -> torch.Tensor:
        batch_size, n_positions, dim = shape
        blank = packed.new_zeros(batch_size * n_positions, dim)
        forward = blank.index_copy(0, forward_index, packed[0])  # (B*S, P)
        backward = blank.index_copy(0, backward_index, packed[1])
        return torch.cat([forward, backward], dim=-1).view(batch_size, n_positions, 2 * dim)


