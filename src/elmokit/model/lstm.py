"""The forward and backward LSTM stacks of the biLM (bilm-tf's), both directions at once.

    token representations (D, ..., P) -> BiLstmLayer x L (cell and projection clipping,
    residual from layer 2 on) -> one (.., 2P) output per layer, [forward | backward]

The weights live here and the cell math in `elmokit.model.cell`; three drivers run them:
    BiLstm.forward                      right-padded sentences, packed so rows that have ended
                                        drop out; a carried state (AllenNLP's stateful mode);
                                        differentiable (autograd over the step loop)
    elmokit.inference.engine            inference: many sentences streamed through R rows, each
                                        from a zero state; oneDNN products on the CPU
    elmokit.training.recurrence         LM training: a hand-written forward/backward through time

Shape notation (as in model.py): B batch, S positions with boundaries, N real positions,
P projection dim, C cell dim, L layers, D = 2 directions, U steps, R rows of the recurrence.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from elmokit.model import cell as lstm_cell
from elmokit.model.config import ElmoConfig


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


class BiLstmLayer(nn.Module):
    """One LSTM layer with projection for both directions, weights stacked on a leading D axis.

    Gates are kept in the order (i, f, o, j): the three sigmoid gates, then the candidate j.
    As in the original, the stored bias excludes the forget-gate offset: +1 is added to the forget
    gate at run time (`FORGET_BIAS`, `gate_bias`), so the original files round-trip bit for bit.
    """

    FORGET_BIAS = lstm_cell.FORGET_BIAS

    def __init__(self, input_dim: int, cell_dim: int, projection_dim: int):
        super().__init__()
        self.cell_dim = cell_dim
        # Weights are (D, out, in), as in nn.Linear.
        self.input_weight = nn.Parameter(torch.empty(2, 4 * cell_dim, input_dim))  # (D, 4C, P)
        self.recurrent_weight = nn.Parameter(torch.empty(2, 4 * cell_dim, projection_dim))  # (D, 4C, P)
        self.bias = nn.Parameter(torch.empty(2, 1, 4 * cell_dim))  # (D, 1, 4C)
        self.projection = nn.Parameter(torch.empty(2, projection_dim, cell_dim))  # (D, P, C)
        offset = lstm_cell.forget_offset(cell_dim, self.bias.device)  # (4C,)
        self.register_buffer("forget_offset", offset, persistent=False)

    def gate_bias(self) -> torch.Tensor:
        """(D, 1, 4C): the stored bias plus the forget-gate offset, what every driver adds to the gates."""
        return self.bias + self.forget_offset

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
        gate_inputs = torch.baddbmm(self.gate_bias(), inputs, self.input_weight.mT)  # (D, N, 4C)
        recurrent_weight, projection = self.recurrent_weight.mT, self.projection.mT
        outputs, finished = [], []
        # split (not slicing per step): its backward does not zero a full-size gradient per step
        for step_inputs in gate_inputs.split(batch_sizes, dim=1):
            batch_size = step_inputs.shape[1]
            if batch_size < hidden.shape[1]:  # the shortest rows have ended: keep their state
                finished.append((hidden[:, batch_size:], cell[:, batch_size:]))
                hidden, cell = hidden[:, :batch_size], cell[:, :batch_size]
            gates = torch.baddbmm(step_inputs, hidden, recurrent_weight)  # (D, b, 4C)
            cell, cell_output = lstm_cell.cell_step(lstm_cell.activate_gates(gates), cell, cell_clip)  # (D, b, C)
            hidden = lstm_cell.clip_(torch.bmm(cell_output, projection), proj_clip)  # (D, b, P)
            outputs.append(hidden)
        finished.append((hidden, cell))
        final_hidden = torch.cat([h for h, _ in reversed(finished)], dim=1)  # (D, B, P)
        final_cell = torch.cat([c for _, c in reversed(finished)], dim=1)  # (D, B, C)
        return torch.cat(outputs, dim=1), final_hidden, final_cell

    def __getstate__(self) -> dict:
        """copy.deepcopy and pickle leave out the reordered weights (oneDNN's opaque tensors cannot
        be copied): a copy remakes them on first use."""
        state = super().__getstate__()
        state.pop("_packed_products", None)
        return state

class BiLstm(nn.Module):
    """The forward and the backward LSTM stacks, run together but never mixing (as in bilm-tf).

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
    ) -> tuple[list[torch.Tensor], LstmState]:
        """Run both directions over right-padded sequences.

        Args:
            inputs: (B, S, P) token representations; positions >= lengths are ignored.
            lengths: (B,) number of real positions of each row (>= 1).
            state: initial state (hidden (L, D, B, P), cell (L, D, B, C)); zeros if None.

        Returns:
            one (B, S, 2P) tensor per layer, [forward | backward], zero at padding; and the final
            state: forward after each row's last position, backward after its first.
        """
        if self.layers[0].input_weight.dtype != inputs.dtype:
            raise ValueError(f"LSTM weights in {self.layers[0].input_weight.dtype} with {inputs.dtype} inputs: "
                             "reduced-precision weights run in elmokit.inference.engine (bilm_forward)")
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

    def _run_layers(self, layer_input: torch.Tensor, batch_sizes: list[int], state: LstmState
                    ) -> tuple[list[torch.Tensor], LstmState]:
        """All layers over packed time-major inputs (D, N, P); state rows in packed order."""
        def run_layer(layer: BiLstmLayer, dropped: torch.Tensor, index: int):
            output, hidden, cell = layer(dropped, batch_sizes, state.hidden[index], state.cell[index],
                                         self.cell_clip, self.proj_clip)
            return output, (hidden, cell)

        outputs, finals = lstm_cell.run_layers(self.layers, layer_input, self.dropout, self.training, run_layer)
        return outputs, LstmState(torch.stack([h for h, _ in finals]), torch.stack([c for _, c in finals]))

    @staticmethod
    def _unpack(packed: torch.Tensor, forward_index: torch.Tensor, backward_index: torch.Tensor,
                shape: torch.Size) -> torch.Tensor:
        batch_size, n_positions, dim = shape
        blank = packed.new_zeros(batch_size * n_positions, dim)
        forward = blank.index_copy(0, forward_index, packed[0])  # (B*S, P)
        backward = blank.index_copy(0, backward_index, packed[1])
        return torch.cat([forward, backward], dim=-1).view(batch_size, n_positions, 2 * dim)


