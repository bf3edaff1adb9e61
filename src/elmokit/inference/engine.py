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

Why this file is long: the three ways a block of steps runs its products (a direction at a time
on the CPU, both batched, a CUDA graph) share `run_block` and `StreamState`, and each step's cell
(fused or eager) sits beside the products that feed it; apart, one step would span three files.

Shape notation (as in model/bilm.py): B batch, S positions with boundaries, N real positions,
P projection dim, C cell dim, L layers, D = 2 directions, U steps, R rows of the recurrence.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from elmokit.inference import cuda_graphs
from elmokit.inference.streams import GATE_BUDGET, StreamLayout, stream_layout
from elmokit.model.int8 import Int8Linear, is_int8, stream_linear
from elmokit.kernels import PackedLinear, weights_key
from elmokit.model import cell as lstm_cell
from elmokit.model import fused_cell
from elmokit.model.bilm import BiLM, BiLMOutput
from elmokit.model.lstm import BiLstm, BiLstmLayer, LstmState

GRAPH_GATE_BUDGET = 1 << 28  # the same in a CUDA graph's block (1 GB of float32 a layer's graph)
PACKED_KEY = "_packed_products"  # where a BiLstmLayer keeps its reordered weights (see its __getstate__)


# ---------------------------------------------------------------------------------------------
# One layer over the streams
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def stream_layer(layer: BiLstmLayer, inputs: torch.Tensor, layout: StreamLayout, cell_clip: float,
                 proj_clip: float, batched: bool | None = None) -> torch.Tensor:
    """Inference: inputs (D, U, R, P) laid out by `stream_layout` -> outputs (D, U, R, P),
    every sentence from a zero state. The gate inputs are computed a block of steps at a
    time (bounded memory however long the streams), then the steps of the block (`run_block`);
    the elementwise work is done in place.

    The products: on the CPU each direction's through `elmokit.kernels.PackedLinear` (oneDNN,
    `DirectionStreamProducts`); elsewhere both directions in one batched product
    (`BatchedStreamProducts`, or with `batched=True` on the CPU too), and on a CUDA GPU each block
    of steps replayed from a CUDA graph captured once (`GraphedBlocks`; `ELMOKIT_CUDA_GRAPHS=0`
    turns it off). All three
    run the same `run_block`, so they give the same numbers up to the order of a product's sums.

    Weights in a reduced precision (`BiLM.to(torch.bfloat16)`) with float32 inputs: the
    products run in the weights' dtype, the gate inputs (their bias in them) are held in it, and
    each step's recurrent product and gate inputs are added in the inputs' dtype for the cell
    (`recurrent_gates`): the cell state, the recurrent state and the outputs stay in the inputs'
    dtype."""
    _, n_steps, rows, dim = inputs.shape
    batched = (inputs.device.type != "cpu" if batched is None else batched) and not is_int8(layer)  # int8: the CPU's
    products = layer_products(layer, rows, batched)
    keep = (~layout.starts).to(device=inputs.device, dtype=inputs.dtype).unsqueeze(-1)  # (U, R, 1)
    bias = (layer.gate_bias().to(inputs.dtype) * candidate_doubled(layer).to(inputs.dtype)
            ).to(products.dtype)  # (D, 1, 4C): (i, f, o, 2j)
    clips = (cell_clip, proj_clip)
    if batched and cuda_graphs.wanted(inputs.device):
        graphed = graphed_blocks(products, inputs, bias, clips)
        outputs = inputs.new_empty(n_steps, 2, rows, dim)  # (U, D, R, P): a step's (D, R, P) contiguous
        graphed.run(inputs, keep, outputs)
        return outputs.transpose(0, 1)
    block = max(1, min(n_steps, GATE_BUDGET // (2 * rows * 4 * layer.cell_dim)))  # steps of gate inputs at once
    state = StreamState.zeros(inputs, layer.cell_dim, products.dtype, block * rows if is_int8(layer) else 0,
                              products.projections[0].dtype if not batched else None)
    if batched:
        outputs = inputs.new_empty(n_steps, 2, rows, dim)  # (U, D, R, P)
        step_outputs = outputs.unbind(0)
    else:
        outputs = inputs.new_empty(2, n_steps, rows, dim)  # (D, U, R, P)
        step_outputs = outputs.unbind(1)
    for first in range(0, n_steps, block):
        last = first + block
        run_block(products, bias, inputs[:, first:last], keep[first:last], layout.reset_steps[first:last], state,
                  step_outputs[first:last], clips)
    return outputs.transpose(0, 1) if batched else outputs


class StreamState(NamedTuple):
    """What the streams carry from one block of steps to the next: hidden (D, R, P) and cell
    (D, R, C) in the inputs' dtype, and the scratch of a step: the cell output (D, R, C), and
    with products in a reduced precision the gates widened to the inputs' dtype (D, R, 4C); with
    int8 products, buffers for a block's input products as int32 sums (D, k R, 4C), a step's
    recurrent int32 sums (R, 4C) and its gates (D, R, 4C), kept for every block and step (fresh
    ones cost a page fault every 4 KB); and the cell output in the projection's input dtype
    (D, R, C), which the fused cell writes directly (`cell_output` itself where that is the
    inputs' dtype)."""

    hidden: torch.Tensor
    cell: torch.Tensor
    cell_output: torch.Tensor
    wide_gates: torch.Tensor | None
    gate_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    projection_input: torch.Tensor | None = None

    @staticmethod
    def zeros(inputs: torch.Tensor, cell_dim: int, compute_dtype: torch.dtype, int8_rows: int = 0,
              projection_dtype: torch.dtype | None = None) -> "StreamState":
        _, _, rows, dim = inputs.shape
        mixed = compute_dtype != inputs.dtype
        buffers = None
        if int8_rows:  # made only for int8 products
            buffers = (inputs.new_empty(2, int8_rows, 4 * cell_dim, dtype=torch.int32),
                       inputs.new_empty(rows, 4 * cell_dim, dtype=torch.int32), inputs.new_empty(2, rows, 4 * cell_dim))
        cell_output = inputs.new_zeros(2, rows, cell_dim)
        narrow = projection_dtype not in (None, inputs.dtype)
        return StreamState(inputs.new_zeros(2, rows, dim), inputs.new_zeros(2, rows, cell_dim), cell_output,
                           inputs.new_zeros(2, rows, 4 * cell_dim) if mixed else None, buffers,
                           inputs.new_zeros(2, rows, cell_dim, dtype=projection_dtype) if narrow else cell_output)


def run_block(products, bias: torch.Tensor, block_inputs: torch.Tensor, keep: torch.Tensor, resets: list[bool],
              state: StreamState, step_outputs, clips: tuple[float, float]) -> None:
    """k steps of every stream, what each path runs (and what a CUDA graph captures).

    block_inputs (D, k, R, P) and keep (k, R, 1) (0 where a sentence starts) of the block's steps;
    resets: whether a sentence starts at each step (all True in a graph: the state is multiplied by
    keep at every step, by 1 where nothing starts); state: carried in and out in place;
    step_outputs: k tensors (D, R, P), written.

    The directions are independent: `products.groups` says which step together (both in one
    batched product; on the CPU one direction all the block's steps, then the other, so that a
    direction's recurrent and projection weights stay in the last-level cache from step to step:
    12 MB a direction in int8, 20 MB in bfloat16 at the `original` shape, where both directions'
    pass a 32 MB cache).
    """
    cell_clip, proj_clip = clips
    gate_inputs = products.gate_inputs(block_inputs, bias, state.gate_buffers)  # (D, k, R, 4C), products' dtype
    for group in products.groups:
        hidden, cell = state.hidden[group], state.cell[group]
        for offset, output in enumerate(step_outputs):
            if resets[offset]:  # a new sentence starts in some rows: zero their state
                hidden = hidden * keep[offset]  # not in place: `hidden` is the last step's output
                cell.mul_(keep[offset])
            products.step(gate_inputs, offset, hidden.to(products.dtype), state, output[group], cell_clip, group)
            hidden = lstm_cell.clip_(output[group], proj_clip)
        state.hidden[group].copy_(hidden)


class DirectionStreamProducts(NamedTuple):
    """The CPU's products: each direction's through oneDNN with its weights reordered once
    (`packed_products`)."""

    inputs: list[PackedLinear | Int8Linear]
    recurrent: list[PackedLinear | Int8Linear]
    projections: list[PackedLinear | Int8Linear]
    dtype: torch.dtype  # of the products' inputs (float32 for int8 products, which quantize them)

    def gate_inputs(self, block_inputs: torch.Tensor, bias: torch.Tensor,
                    buffers: tuple[torch.Tensor, ...] | None = None) -> list[torch.Tensor]:
        """(D, k, R, P) -> D x (k, R, 4C): x W_in^T + b, a direction at a time; for int8 products
        (`buffers` given) D x (products (k, R, 4C), row scales (k, R, 1), weight scales or None, b)
        as `Int8Linear.unscaled` gives them (torch._int_mm's int32 sums into `buffers`, or oneDNN's
        float32 products), which `step` scales a step at a time: the block's float32 gate inputs
        are never written, a pass over 16 MB a direction at the `original` shape's block."""
        _, n_steps, rows, dim = block_inputs.shape
        block_inputs = block_inputs.to(self.dtype)  # itself when not mixed
        if buffers is not None:  # int8: the products before their scales, scaled at each step (`step`)
            sums = buffers[0][:, :n_steps * rows].view(2, n_steps, rows, -1)
            unscaled = [self.inputs[d].unscaled(block_inputs[d].reshape(-1, dim), sums[d].flatten(0, 1))
                        for d in range(2)]
            return [(product.view(n_steps, rows, -1), scale.view(n_steps, rows, 1), weight_scale, bias[d, 0])
                    for d, (product, scale, weight_scale) in enumerate(unscaled)]
        return [self.inputs[d](block_inputs[d].reshape(-1, dim), bias[d, 0]).view(-1, rows, bias.shape[-1])
                for d in range(2)]

    groups = (slice(0, 1), slice(1, 2))  # one direction at a time (`run_block`)

    def step(self, gate_inputs: list[torch.Tensor], offset: int, hidden: torch.Tensor, state: StreamState,
             output: torch.Tensor, cell_clip: float, group: slice) -> None:
        """Step `offset` of the block for the directions of `group`: gate_inputs D x (k, R, 4C),
        hidden (G, R, P) -> output (G, R, P), G the group's directions; the cell state updated in
        place. The cell's elementwise work is one compiled pass (`fused_cell`) that writes the
        projection's input in its dtype, where it runs here; else the eager cell."""
        buffers = state.gate_buffers  # int8's: the gates and their int32 sums into kept buffers
        fused = state.cell.device.type == "cpu" and fused_cell.available()  # no build on a GPU's path
        for index, d in enumerate(range(group.start, group.stop)):
            projection_input = state.projection_input[d]
            if buffers is None:  # the recurrent product alone, the gate inputs added as the cell reads them
                product = self.recurrent[d](hidden[index])  # (R, 4C)
                fused = fused and fused_cell.cell_(product, state.cell[d], projection_input, cell_clip,
                                                   addend=gate_inputs[d][offset])
                if not fused:
                    gates = recurrent_gates(product, gate_inputs[d][offset],
                                            None if state.wide_gates is None else state.wide_gates[d])
            else:
                products, scale, weight_scale, bias = gate_inputs[d]
                if fused:  # the products scaled as the cell reads them: no float32 gates written
                    fused = fused_cell.cell_int8_((products[offset], scale[offset], weight_scale),
                                                  self.recurrent[d].unscaled(hidden[index], sums=buffers[1]), bias,
                                                  state.cell[d], projection_input, cell_clip)
                if not fused:  # the block's products scaled, then the recurrent product added, in the kept buffers
                    gates = Int8Linear.finish(products[offset], scale[offset], weight_scale, bias, out=buffers[2][d])
                    gates = self.recurrent[d].add(gates, hidden[index], out=gates, sums=buffers[1])
            if not fused:
                lstm_cell.cell_step(lstm_cell.activate_doubled_gates_(gates), state.cell[d], cell_clip,
                                    cell_next=state.cell[d], cell_output=state.cell_output[d],
                                    tanh=lstm_cell.tanh_via_sigmoid)
                projection_input = state.cell_output[d].to(self.projections[d].dtype)
            output[index] = self.projections[d](projection_input)  # (R, P)


class BatchedStreamProducts(NamedTuple):
    """Both directions in one batched product (`torch.baddbmm` / `torch.bmm`; cuBLAS on a GPU),
    the weights transposed once, the candidate's rows doubled (`activate_doubled_gates_`)."""

    input_weight: torch.Tensor  # (D, P, 4C)
    recurrent_weight: torch.Tensor  # (D, P, 4C)
    projection: torch.Tensor  # (D, C, P)
    dtype: torch.dtype
    graphs: dict  # GraphedBlocks by (rows, steps, dtype, clips), made on first use on a CUDA GPU

    def gate_inputs(self, block_inputs: torch.Tensor, bias: torch.Tensor, buffers: None = None) -> torch.Tensor:
        """(D, k, R, P) -> (D, k, R, 4C), both directions in one product (`buffers`: int8's only)."""
        n_dirs, n_steps, rows, dim = block_inputs.shape
        flat = block_inputs.to(self.dtype).reshape(n_dirs, n_steps * rows, dim)  # (D, k*R, P)
        return torch.baddbmm(bias, flat, self.input_weight).view(n_dirs, n_steps, rows, -1)

    groups = (slice(0, 2),)  # both directions in each product (`run_block`)

    def step(self, gate_inputs: torch.Tensor, offset: int, hidden: torch.Tensor, state: StreamState,
             output: torch.Tensor, cell_clip: float, group: slice) -> None:
        if state.wide_gates is None:  # the same float32 sum, in the product (one kernel on a GPU)
            gates = torch.baddbmm(gate_inputs[:, offset], hidden, self.recurrent_weight)  # (D, R, 4C)
        else:
            gates = recurrent_gates(torch.bmm(hidden, self.recurrent_weight), gate_inputs[:, offset],
                                    state.wide_gates)
        lstm_cell.cell_step(lstm_cell.activate_doubled_gates_(gates), state.cell, cell_clip, cell_next=state.cell,
                            cell_output=state.cell_output, tanh=lstm_cell.tanh_via_sigmoid)
        if output.dtype == self.dtype:
            torch.bmm(state.cell_output, self.projection, out=output)  # (D, R, P)
        else:
            output.copy_(torch.bmm(state.cell_output.to(self.dtype), self.projection))


def recurrent_gates(product: torch.Tensor, gate_inputs: torch.Tensor, wide: torch.Tensor | None) -> torch.Tensor:
    """A step's pre-activations (..., R, 4C) from its two terms in the products' dtype: the
    recurrent product h_{t-1} W_rec^T and the gate inputs x_t W_in^T + b computed for its block.
    Their sum in the inputs' dtype, not rounded after where that is float32 (the embedder's): into
    `wide`, the float32 buffer, where the products are narrower (bfloat16: each term a product
    rounded once), else in place in `product` (inputs in bfloat16 too: the sum rounded once more).
    The compiled cell adds the same two terms the same way as it reads them (`fused_cell.cell_`'s
    addend): the recurrent product runs without an addend, which oneDNN's
    product summed into its output markedly slower (bench/results/embed-fused-cell.md)."""
    if wide is None:
        return product.add_(gate_inputs)
    return wide.copy_(product).add_(gate_inputs)


def layer_products(layer: BiLstmLayer, rows: int, batched: bool
                   ) -> DirectionStreamProducts | BatchedStreamProducts:
    """The layer's products for `rows` rows, made once and kept with the layer until a weight
    changes (`kernels.weights_key`; the reordered or transposed copies do not follow the weights;
    the batched ones, with their CUDA graphs, serve every row count). oneDNN's are reordered for
    about `rows` rows and kept for any call of as many rows or fewer (tuned for more rows, a product
    of fewer runs about as fast, where one reordered for fewer rows than it gets can run at half
    speed), so that calls of few and of many sentences in turn do not reorder the weights each call."""
    weights = (layer.input_weight, layer.recurrent_weight, layer.projection, layer.bias)  # a graph reads the bias
    key = (batched, is_int8(layer), weights_key(weights))
    cache = layer.__dict__.get(PACKED_KEY)
    if cache is None or cache[0] != key or (not batched and cache[2] < rows):
        doubled = candidate_doubled(layer)[:, None]  # (4C, 1)
        dtype = layer.input_weight.dtype
        if batched:
            products = BatchedStreamProducts((layer.input_weight * doubled).mT.contiguous(),
                                             (layer.recurrent_weight * doubled).mT.contiguous(),
                                             layer.projection.mT.contiguous(), dtype, {})
        else:
            products = DirectionStreamProducts(*packed_products(layer, rows), dtype)
        layer.__dict__[PACKED_KEY] = cache = (key, products, rows)
    return cache[1]


def graphed_blocks(products: BatchedStreamProducts, inputs: torch.Tensor, bias: torch.Tensor,
                   clips: tuple[float, float]) -> "cuda_graphs.GraphedBlocks":
    """The layer's `run_block` captured for these rows (kept with its products): blocks of up to
    GRAPH_STEPS steps, fewer where a block's gate inputs would pass GRAPH_GATE_BUDGET."""
    _, n_steps, rows, dim = inputs.shape
    gate_width = bias.shape[-1]
    steps = max(1, min(cuda_graphs.GRAPH_STEPS, GRAPH_GATE_BUDGET // (2 * rows * gate_width)))
    steps = min(steps, 1 << max(0, n_steps - 1).bit_length())  # short streams: a power of two, few graphs
    key = (rows, steps, inputs.dtype, clips)
    if key not in products.graphs:
        while len(products.graphs) >= cuda_graphs.GRAPHS_KEPT:  # the oldest row count goes first
            products.graphs.pop(next(iter(products.graphs)))
        state = StreamState.zeros(inputs, gate_width // 4, products.dtype)
        products.graphs[key] = cuda_graphs.GraphedBlocks(
            lambda block_inputs, keep, outputs: run_block(products, bias, block_inputs, keep, [True] * steps, state,
                                                          outputs.unbind(0), clips),
            state, steps, inputs, bias)
    return products.graphs[key]


def candidate_doubled(layer: BiLstmLayer) -> torch.Tensor:
    """(4C,): 1 for the gates i, f, o, 2 for the candidate j."""
    scale = layer.forget_offset.new_ones(4 * layer.cell_dim)
    scale[3 * layer.cell_dim:] = 2.0
    return scale


def packed_products(layer: BiLstmLayer, rows: int) -> tuple[list[PackedLinear], ...]:
    """The input, recurrent and projection products of each direction, their weights
    reordered for oneDNN (the candidate's rows doubled, see `activate_doubled_gates_`), for about
    `rows` rows, or quantized to int8 for a layer that `elmokit.model.int8.quantize_modules` marked
    (`layer_products` keeps them until a weight changes or a call wants more rows)."""
    weights = (layer.input_weight, layer.recurrent_weight, layer.projection)
    block_rows = max(rows, GATE_BUDGET // (2 * 4 * layer.cell_dim))  # input products: a block of steps
    doubled = candidate_doubled(layer)[:, None]  # (4C, 1)
    return tuple([stream_linear(weight[d], hint, scale, is_int8(layer), weight is layer.projection,
                                scaled_later=weight is layer.input_weight) for d in range(2)]
                 for weight, scale, hint in zip(weights, (doubled, doubled, None), (block_rows, rows, rows)))


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
    dtype = "int8 products" if is_int8(lstm.layers[0]) else f"{lstm.layers[0].input_weight.dtype} weights"
    if state is not None:
        raise ValueError(f"an LSTM with {dtype} runs from a zero state only (no carried state); "
                         "use float32 weights for stateful runs")
    if torch.is_grad_enabled() and (inputs.requires_grad or any(p.requires_grad for p in lstm.parameters())):
        raise ValueError(f"an LSTM with {dtype} is for inference only; fine-tune in float32")
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
    return bilm.lstm.layers[0].input_weight.dtype == torch.float32 and not is_int8(bilm.lstm.layers[0])  # else forward_reduced says why not


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
