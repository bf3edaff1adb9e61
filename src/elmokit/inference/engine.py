"""How inference runs the biLM's recurrence: many sentences streamed through R rows of the
recurrence at once, each from a zero state, with oneDNN products on the CPU.

    sentences (N positions end to end) -> `stream_layout`: R streams, the longest sentences first,
        each in the stream that is shortest so far -> per layer `stream_layer`: the gate inputs a
        block of steps at a time, then one step of every stream at a time, the state zeroed where
        a sentence starts -> residual from layer 2 on -> back in input order (`forward_sentences`)

All R rows stay busy until the end instead of idling while the longest sentence of a padded batch
finishes, and each sentence's vectors are those of the sentence alone (stateless). The products go
through `elmokit.kernels.PackedLinear` (oneDNN with the weights reordered once, `packed_products`);
the cell (`elmokit.model.cell`) runs in place, one sigmoid for its four gates
(`activate_doubled_gates_`) and tanh as `tanh_via_sigmoid`. `bilm_forward` is `BiLM.forward` for weights in
a reduced precision (bfloat16: products in bfloat16, state and outputs in float32).

The weights are in `elmokit.model.lstm`, the cell and the stacking of layers (dropout,
residual) in `elmokit.model.cell`; training's driver is `elmokit.training.recurrence`.

Shape notation (as in model/bilm.py): B batch, S positions with boundaries, N real positions,
P projection dim, C cell dim, L layers, D = 2 directions, U steps, R rows of the recurrence.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np
import torch

from elmokit.kernels import PackedLinear
from elmokit.model import cell as lstm_cell
from elmokit.model.bilm import BiLM, BiLMOutput
from elmokit.model.lstm import BiLstm, BiLstmLayer, LstmState

GATE_BUDGET = 1 << 23  # floats of precomputed gate inputs held at once by `stream_layer` (32 MB)
PACKED_KEY = "_packed_products"  # where a BiLstmLayer keeps its reordered weights (see its __getstate__)


# ---------------------------------------------------------------------------------------------
# Laying sentences out in streams
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# One layer over the streams
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def stream_layer(layer: BiLstmLayer, inputs: torch.Tensor, layout: StreamLayout, cell_clip: float,
                 proj_clip: float) -> torch.Tensor:
    """Inference: inputs (D, U, R, P) laid out by `stream_layout` -> outputs (D, U, R, P),
    every sentence from a zero state. The gate inputs are computed a block of steps at a
    time (bounded memory however long the streams); the products go through
    `elmokit.kernels.PackedLinear` (oneDNN on the CPU); the elementwise work is done in place.

    Weights in a reduced precision (`BiLM.to(torch.bfloat16)`) with float32 inputs: the
    products run in the weights' dtype, the gate inputs and the bias are held in it (the sum of
    the recurrent product and the gate inputs is one fused product, as in float32), and the gates
    are widened to the inputs' dtype for the cell: the cell state, the recurrent state and the
    outputs stay in the inputs' dtype."""
    _, n_steps, rows, dim = inputs.shape
    cell_dim = layer.cell_dim
    compute_dtype = layer.input_weight.dtype  # of the products
    mixed = compute_dtype != inputs.dtype
    block = max(1, min(n_steps, GATE_BUDGET // (2 * rows * 4 * cell_dim)))  # steps of gate inputs at once
    input_products, recurrent_products, projections = packed_products(layer, rows)
    keep = (~layout.starts).to(device=inputs.device, dtype=inputs.dtype).unsqueeze(-1)  # (U, R, 1)
    bias = (layer.gate_bias().to(inputs.dtype) * candidate_doubled(layer).to(inputs.dtype)
            ).squeeze(1).to(compute_dtype)  # (D, 4C): (i, f, o, 2j)
    outputs = inputs.new_empty(2, n_steps, rows, dim)
    hidden = inputs.new_zeros(2, rows, dim)
    cell = inputs.new_zeros(2, rows, cell_dim)
    cell_output = inputs.new_empty(2, rows, cell_dim)
    wide_gates = inputs.new_empty(rows, 4 * cell_dim) if mixed else None  # the gates in the inputs' dtype
    for first in range(0, n_steps, block):
        block_inputs = inputs[:, first:first + block].to(compute_dtype)  # (D, k, R, P); itself when not mixed
        gate_inputs = [input_products[d](block_inputs[d].reshape(-1, dim), bias[d]).view(-1, rows, 4 * cell_dim)
                       for d in range(2)]  # D x (k, R, 4C)
        for offset in range(len(gate_inputs[0])):
            step = first + offset
            if layout.reset_steps[step]:  # a new sentence starts in some rows: zero their state
                hidden = hidden * keep[step]  # not in place: `hidden` is the last step's output
                cell.mul_(keep[step])
            product_hidden = hidden.to(compute_dtype)  # (D, R, P); `hidden` itself when not mixed
            for d in range(2):
                gates = recurrent_products[d].add(gate_inputs[d][offset], product_hidden[d])  # (R, 4C)
                if mixed:
                    gates = wide_gates.copy_(gates)
                lstm_cell.cell_step(lstm_cell.activate_doubled_gates_(gates), cell[d], cell_clip, cell_next=cell[d],
                                    cell_output=cell_output[d], tanh=lstm_cell.tanh_via_sigmoid)
                outputs[d, step] = projections[d](cell_output[d].to(compute_dtype))  # (R, P)
            hidden = lstm_cell.clip_(outputs[:, step], proj_clip)
    return outputs


def candidate_doubled(layer: BiLstmLayer) -> torch.Tensor:
    """(4C,): 1 for the gates i, f, o, 2 for the candidate j."""
    scale = layer.forget_offset.new_ones(4 * layer.cell_dim)
    scale[3 * layer.cell_dim:] = 2.0
    return scale


def packed_products(layer: BiLstmLayer, rows: int) -> tuple[list[PackedLinear], ...]:
    """The input, recurrent and projection products of each direction, their weights
    reordered for oneDNN (the candidate's rows doubled, see `activate_doubled_gates_`): made once per
    row count, kept until a weight changes."""
    weights = (layer.input_weight, layer.recurrent_weight, layer.projection)
    key = (rows, *((weight.data_ptr(), weight._version, weight.dtype) for weight in weights))
    cache = layer.__dict__.get(PACKED_KEY)
    if cache is None or cache[0] != key:
        block_rows = max(rows, GATE_BUDGET // (2 * 4 * layer.cell_dim))  # input products: a block of steps
        doubled = candidate_doubled(layer)[:, None]  # (4C, 1)
        products = tuple([PackedLinear(weight[d], hint, row_scale=scale) for d in range(2)]
                         for weight, scale, hint in zip(weights, (doubled, doubled, None), (block_rows, rows, rows)))
        layer.__dict__[PACKED_KEY] = cache = (key, products)
    return cache[1]


# ---------------------------------------------------------------------------------------------
# All layers, and the biLM
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def forward_sentences(lstm: BiLstm, tokens: torch.Tensor, sizes: np.ndarray, rows: int) -> list[torch.Tensor]:
    """Inference (no gradients): many sentences, each from a zero state, `rows` at a time.

    Args:
        tokens: (N, P) token representations of all sentences end to end, boundaries included.
        sizes: (n,) positions of each sentence (its tokens + 2).
        rows: rows of the recurrence; each sentence starts in the row the last one freed.

    Returns:
        one (N, 2P) tensor per layer, [forward | backward], in the order of `tokens`.
    """
    n_positions, dim = tokens.shape
    layout = stream_layout(np.asarray(sizes, np.int64), rows)
    indices = [index.to(tokens.device) for index in (layout.forward_index, layout.backward_index)]
    padded = torch.cat([tokens, tokens.new_zeros(1, dim)])  # position N: the idle tail of a stream
    layer_input = torch.stack([padded[index] for index in indices])  # (D, U, R, P)
    stacked, _ = lstm_cell.run_layers(  # dropout and residual as every driver (stateless: no final state)
        lstm.layers, layer_input, lstm.dropout, lstm.training,
        lambda layer, dropped, _: (stream_layer(layer, dropped, layout, lstm.cell_clip, lstm.proj_clip), None))
    outputs = []
    for number, output in enumerate(stacked):  # (D, U, R, P) -> (N, 2P) in input order
        stacked[number] = None  # each layer's streams freed once unpacked (memory as one layer at a time)
        unpacked = tokens.new_empty(n_positions + 1, 2 * dim)
        for direction, index in enumerate(indices):
            unpacked[:, direction * dim:(direction + 1) * dim][index.flatten()] = output[direction].flatten(0, 1)
        outputs.append(unpacked[:n_positions])
    return outputs


def forward_reduced(lstm: BiLstm, inputs: torch.Tensor, lengths: torch.Tensor, state: LstmState | None
                    ) -> list[torch.Tensor]:
    """`BiLstm.forward` for inference, on right-padded inputs (B, S, P) with `lengths` (B,): the
    stream path (`forward_sentences`), one row per sentence, weights of any precision. No
    gradient and no carried state (an error names what to do instead)."""
    dtype = lstm.layers[0].input_weight.dtype
    if state is not None:
        raise ValueError(f"an LSTM with {dtype} weights runs from a zero state only (no carried state); "
                         "use float32 weights for stateful runs")
    if torch.is_grad_enabled() and (inputs.requires_grad or any(p.requires_grad for p in lstm.parameters())):
        raise ValueError(f"an LSTM with {dtype} weights is for inference only; fine-tune in float32")
    batch_size, n_positions, dim = inputs.shape
    mask = torch.arange(n_positions, device=inputs.device) < lengths.to(inputs.device).unsqueeze(1)  # (B, S)
    layers = forward_sentences(lstm, inputs[mask], lengths.cpu().numpy(), batch_size)  # L x (N, 2P)
    outputs = []
    for layer in layers:
        padded = inputs.new_zeros(batch_size, n_positions, 2 * dim)  # (B, S, 2P)
        padded[mask] = layer
        outputs.append(padded)
    return outputs


def contextualize_sentences(bilm: BiLM, token_embeddings: torch.Tensor, sizes: np.ndarray, rows: int
                            ) -> list[torch.Tensor]:
    """The L+1 layers (N, 2P) of many sentences laid end to end, each from a zero state.

    Args:
        bilm: the biLM.
        token_embeddings: (N, P) of every position, boundaries included, sentence after sentence.
        sizes: (n,) positions of each sentence (tokens + 2).
        rows: sentences in the recurrence at once (see `forward_sentences`).
    """
    if len(token_embeddings) == 0:
        return [token_embeddings.new_zeros(0, bilm.output_dim)] * bilm.config.n_output_layers
    lstm_layers = forward_sentences(bilm.lstm, token_embeddings, sizes, rows)
    return [torch.cat([token_embeddings, token_embeddings], dim=-1), *lstm_layers]


def _needs_step_loop(bilm: BiLM, state: LstmState | None, carry: bool, inputs: torch.Tensor | None = None
                     ) -> bool:
    """A carried state (given, or wanted back) or gradients need `BiLM.forward`'s step loop
    (float32 weights only); every other call, stateless inference of any precision, runs here."""
    if state is None and not carry and not (torch.is_grad_enabled() and (any(p.requires_grad for p in bilm.parameters())
                                                            or (inputs is not None and inputs.requires_grad))):
        return False
    return bilm.lstm.layers[0].input_weight.dtype == torch.float32  # else forward_reduced says why not


def bilm_forward(bilm: BiLM, char_ids: torch.Tensor, state: LstmState | None = None, carry: bool = False
                 ) -> BiLMOutput:
    """`bilm(char_ids, state)` for inference: stateless calls without gradients (float32 or
    bfloat16 weights) run the streaming engine, one row a sentence (`forward_reduced`; the returned
    state is None); a carried state (`state`, or `carry` to get the final one back) or gradients
    run `BiLM.forward`'s step loop (float32 weights only). The same `BiLM.forward` either way, only
    the LSTM's driver differs, so `ElmoEmbedder.embed_batch`, `embed_sentences` and `Elmo` share it."""
    return bilm(char_ids, state, _lstm_driver(bilm, state, carry))


def bilm_contextualize(bilm: BiLM, token_embeddings: torch.Tensor, mask: torch.Tensor,
                       state: LstmState | None = None, carry: bool = False) -> BiLMOutput:
    """`bilm.contextualize(token_embeddings, mask, state)`, whatever the precision of its LSTM
    weights (see `bilm_forward`): token_embeddings (N, P) of the true entries of mask (B, S)."""
    return bilm.contextualize(token_embeddings, mask, state, _lstm_driver(bilm, state, carry, token_embeddings))


def _lstm_driver(bilm: BiLM, state: LstmState | None, carry: bool, inputs: torch.Tensor | None = None):
    """None (`bilm.lstm`'s step loop) where `_needs_step_loop`, else the stateless stream engine."""
    if _needs_step_loop(bilm, state, carry, inputs):
        return None
    return lambda tokens, lengths, state: (forward_reduced(bilm.lstm, tokens, lengths, state), None)
