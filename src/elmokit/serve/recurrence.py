"""The server's driver of the LSTM cell: R rows of the recurrence, each running one sentence
through every layer and both directions a step at a time, where a sentence joins a free row at
any step (continuous batching).

The inference engine (`elmokit.inference.engine`) lays a fixed set of sentences out in rows and
runs one layer over all its steps before the next: the fastest way through sentences known in
advance, but a batch must finish before new sentences start. A server's sentences arrive while
the model runs; here each step runs every layer, so a sentence that arrives joins the next step
in whichever row the last finished sentence freed, and leaves (its answer sent) at its last
step. The rows stay as full as the requests in flight allow, which a closed loop of clients
(each waiting for its answer before sending again) needs: with batches, each client's next
sentence waits for the whole batch.

Each sentence starts from a zero state, so its vectors are those it gets alone (stateless):
`ElmoEmbedder.embed_many`'s numbers to float32 rounding (the input and recurrent products are one
product here, two in the engine; in int8 two here too, giving the engine's int8 numbers exactly;
in bfloat16 the one product rounds elsewhere than the engine's two: within the budget of float32
that docs/serve.md states, not the engine's bfloat16 numbers).
The formulas are `elmokit.model.cell`'s (the cell, the residual from layer 2 on); the products
are oneDNN's with the weights reordered once (`elmokit.kernels.PackedLinear`, as the engine's; the
candidate's rows doubled, `candidate_doubled`, so that one sigmoid covers the four gates). Weights
in bfloat16 run their products in bfloat16, the state and outputs in float32, as in the engine.

A sentence of S positions (its tokens and the two boundaries) admitted at step t runs steps
t .. t+S-2: its forward stream reads positions 0..S-2, its backward stream S-1..1, and the
outputs of every step are kept in a ring of H >= S steps, read back when it leaves. Steps t+1 ..
t+S-2 give its n = S-2 tokens; step t (`<S>` forward, `</S>` backward) gives only the state they
start from. A step t+S-1 would read `</S>` forward and `<S>` backward, whose outputs no route
returns, so none is run: a sentence leaves after the last step that is read.

Shape notation: R rows, H steps in the rings, S positions of a sentence (n tokens + 2),
P projection dim, C cell dim, L LSTM layers, D = 2 directions.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from elmokit.devices import memory_bytes
from elmokit.inference.elmo import boundary_rows
from elmokit.inference.embedder import ElmoEmbedder
from elmokit.inference.engine import candidate_doubled
from elmokit.model.int8 import Int8Linear, is_int8, stream_linear
from elmokit.kernels import PackedLinear
from elmokit.model import cell as lstm_cell
from elmokit.model import fused_cell
from elmokit.model.bilm import BiLM
from elmokit.model.chars import BOS_TOKEN, EOS_TOKEN
from elmokit.model.lstm import BiLstmLayer


def token_layer(embedder: ElmoEmbedder, sentences: Sequence[Sequence[str]]) -> torch.Tensor:
    """The token layer of every position of `sentences`, boundaries included, sentence after
    sentence: (N, P), through the embedder's token cache when it has one (as `embed_many`)."""
    if embedder.cache is not None:
        return embedder.cache.embeddings(sentences)
    lengths = np.fromiter(map(len, sentences), np.int64, len(sentences))
    tokens = [BOS_TOKEN, EOS_TOKEN, *itertools.chain.from_iterable(sentences)]
    table = embedder.bilm.encode_words(tokens)
    rows = boundary_rows(lengths, np.arange(2, len(tokens)))
    return table[torch.from_numpy(rows).to(table.device)]


def gate_products(layer: BiLstmLayer, rows: int) -> list[PackedLinear | "SplitGateProduct"]:
    """Each direction's input and recurrent products as one: [x | h] (R, 2P) times the two
    weights side by side (4C, 2P), the candidate's rows doubled as the engine's
    (`activate_doubled_gates_`). One oneDNN product a step instead of two: 5-8% less time a step
    with 16 to 64 rows (the engine adds the recurrent product to gate inputs it computed for a
    block of steps at once, which a step that takes new sentences cannot do). In int8, two
    products (`SplitGateProduct`), as the engine's: one scale for a row of [x | h] would quantize
    the smaller of the two as coarsely as the larger."""
    doubled = candidate_doubled(layer)[:, None]  # (4C, 1)
    if is_int8(layer):
        return [SplitGateProduct(*(stream_linear(weight[d].detach(), rows, row_scale=doubled, int8=True)
                                   for weight in (layer.input_weight, layer.recurrent_weight)))
                for d in range(2)]
    return [stream_linear(torch.cat([layer.input_weight[d], layer.recurrent_weight[d]], dim=1).detach(), rows,
                          row_scale=doubled) for d in range(2)]


class SplitGateProduct(NamedTuple):
    """[x | h] (R, 2P) -> x W_in^T + b + h W_rec^T (R, 4C), two int8 products, each input
    quantized per row on its own (the engine's: `Int8Linear`)."""

    input: Int8Linear
    recurrent: Int8Linear

    def __call__(self, state: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        dim = state.shape[-1] // 2
        gates = self.input(state[:, :dim], bias)  # (R, 4C)
        return self.recurrent.add(gates, state[:, dim:], out=gates)


def ring_bytes(bilm: BiLM, rows: int, max_positions: int) -> int:
    """Bytes of `Recurrence`'s rings: its inputs and each layer's outputs, float32,
    (L+1) x H x 2 directions x R x P x 4 (docs/serve.md: H = --max-input-tokens + 2)."""
    return bilm.config.n_output_layers * max_positions * 2 * rows * bilm.config.lstm.projection_dim * 4


def check_rings_fit(bilm: BiLM, device: torch.device, rows: int, max_input_tokens: int) -> None:
    """ValueError, before the server's model process starts, where the rings alone would take more
    than the device's whole memory (`devices.memory_bytes`): such a server could never start."""
    needed, memory = ring_bytes(bilm, rows, max_input_tokens + 2), memory_bytes(device)
    if memory is not None and needed > memory:
        where = f"{device}'s memory" if device.type == "cuda" else "this machine's memory"
        raise ValueError(f"--max-input-tokens {max_input_tokens} with --rows {rows}: the recurrence's rings would "
                         f"take {needed / 2**30:.1f} GiB ((L+1) x (max-input-tokens + 2) x 2 x rows x P float32, "
                         f"docs/serve.md), more than the {memory / 2**30:.1f} GiB of {where}: lower "
                         f"--max-input-tokens or --rows")


class _SpanViews(NamedTuple):
    """One layer's views of `Recurrence`'s state for a step of rows 0 .. span-1 (R' rows)."""

    dim: int  # P
    layer_input: torch.Tensor  # (D, R', [P | P]): the layer's input and its last clipped projection
    directions: tuple[torch.Tensor, ...]  # D x (R', 2P): the same, a direction each
    cell: torch.Tensor  # (D, R', C)
    cell_output: torch.Tensor  # (D, R', C)
    gates: torch.Tensor  # (D, R', 4C), contiguous: a buffer for the step's gates
    projected: tuple[torch.Tensor, ...]  # D x (R', P): where each direction's projection goes
    hidden: torch.Tensor  # (D, R', P): the projections, both directions
    residual: torch.Tensor  # (D, R', P): the layer's input
    next_input: torch.Tensor | None  # (D, R', P): the next layer's input (None for the last layer)


class Recurrence:
    """R rows of the biLM's recurrence, stepped together; `admit` puts a sentence in a free
    row, `step` runs one step of every busy row and returns the rows whose sentence ended, and
    `take` reads a finished sentence's layers. Not thread-safe: one thread drives it."""

    @torch.no_grad()
    def __init__(self, bilm: BiLM, rows: int, max_positions: int):
        lstm = bilm.lstm
        self.layers, self.cell_clip, self.proj_clip = list(lstm.layers), lstm.cell_clip, lstm.proj_clip
        self.rows, self.horizon = rows, max_positions  # R, H
        weight = self.layers[0].input_weight
        self.compute_dtype = weight.dtype  # of the products
        dtype = torch.promote_types(weight.dtype, torch.float32)  # of the state and the outputs
        device, dim, cell_dim, n_layers = weight.device, bilm.config.lstm.projection_dim, \
            bilm.config.lstm.cell_dim, len(self.layers)
        self.gate_products = [gate_products(layer, rows) for layer in self.layers]  # L x D
        self.projections = [[stream_linear(layer.projection[d].detach(), rows, int8=is_int8(layer), projection=True)
                             for d in range(2)]
                            for layer in self.layers]  # L x D
        self.bias = [(layer.gate_bias().to(dtype) * candidate_doubled(layer).to(dtype)).squeeze(1)
                     .to(self.compute_dtype) for layer in self.layers]  # L x (D, 4C): (i, f, o, 2j)
        self.inputs = torch.zeros(self.horizon, 2, rows, dim, device=device, dtype=dtype)  # (H, D, R, P)
        self.outputs = torch.zeros(n_layers, self.horizon, 2, rows, dim, device=device, dtype=dtype)  # (L, H, D, R, P)
        # each layer's input and its last clipped projection side by side, as the gate product reads them
        self.layer_state = torch.zeros(n_layers, 2, rows, 2 * dim, device=device, dtype=dtype)  # (L, D, R, [P | P])
        self.cell = torch.zeros(n_layers, 2, rows, cell_dim, device=device, dtype=dtype)  # (L, D, R, C)
        self.cell_output = torch.zeros(2, rows, cell_dim, device=device, dtype=dtype)  # (D, R, C)
        self._gates = torch.empty(2, rows, 4 * cell_dim, device=device, dtype=dtype)  # (D, R, 4C): a step's gates
        # the cell's elementwise work as one compiled pass on the CPU (`fused_cell`), writing the projections' input
        self.fused = device.type == "cpu" and fused_cell.available()
        self._projection_input = torch.empty(2, rows, cell_dim, device=device, dtype=self.projections[0][0].dtype)
        self._span_views: dict[int, list[_SpanViews]] = {}  # span -> each layer's views (`_views`)
        # numpy views of the rings on the CPU: `admit` and `take` touch a few rows, where numpy's slices cost
        # a microsecond and torch's several
        self._host_inputs = self.inputs.numpy() if device.type == "cpu" else None
        self._host_outputs = self.outputs.numpy() if device.type == "cpu" else None
        self.step_number = 0
        self.free = list(range(rows))  # a heap: the lowest free row first, so the busy rows stay few
        self.busy: dict[int, tuple[int, np.ndarray]] = {}  # row -> (first step, token layer (S, P))
        self.ends: dict[int, list[int]] = {}  # step -> rows whose sentence ends there
        self.span = 0  # rows 0 .. span-1 hold every busy row: the rows a step computes
        self.computed_row_steps = 0  # the spans summed over the steps run (rows computed, busy or not)

    @torch.no_grad()
    def admit(self, token_embeddings: torch.Tensor, sizes: Sequence[int]) -> list[int]:
        """Start sentences at the next step, each in the lowest free row (there must be enough):
        `token_embeddings` (N, P) their token layers end to end with boundaries, `sizes` their
        positions (tokens + 2, each <= H). Returns their rows."""
        if len(sizes) > len(self.free):
            raise ValueError(f"{len(sizes)} sentences to start, {len(self.free)} free rows")
        if any(not 2 <= size <= self.horizon for size in sizes):
            raise ValueError(f"a sentence of {max(sizes)} positions does not fit the recurrence's {self.horizon}")
        rows = [heapq.heappop(self.free) for _ in sizes]
        first, device = self.step_number, self.inputs.device
        # S-1 steps a sentence: forward positions 0..S-2 (no `</S>`), backward S-1..1 (no `<S>`)
        embeddings = token_embeddings.to(self.inputs.dtype)  # (N, P)
        host_tokens = embeddings.cpu().numpy()  # what `take` reads back (layer 0)
        inputs = self._host_inputs if self._host_inputs is not None else self.inputs  # numpy on the CPU: cheaper
        source = host_tokens if self._host_inputs is not None else embeddings
        start = 0
        for row, size in zip(rows, sizes):  # a slice or two of the ring each
            done = 0
            for slot, length in self._ring(first, size - 1):
                forward = source[start + done:start + done + length]  # the forward stream reads positions in order,
                backward = source[start + size - done - length:start + size - done]  # the backward from the end
                inputs[slot:slot + length, 0, row] = forward
                inputs[slot:slot + length, 1, row] = backward[::-1] if source is host_tokens else backward.flip(0)
                done += length
            self.busy[row] = (first, host_tokens[start:start + size])
            self.ends.setdefault(first + size - 2, []).append(row)  # its last token's step
            start += size
        started = torch.tensor(rows, device=device)
        self.layer_state[:, :, started, self.layer_state.shape[-1] // 2:] = 0  # a zero state: each as if alone
        self.cell[:, :, started] = 0
        self.span = max(self.span, max(rows, default=-1) + 1)
        return rows

    @torch.no_grad()
    def step(self) -> list[int]:
        """One step of rows 0 .. span-1 through every layer, both directions; the rows whose
        sentence took its last step (read them with `take`, which frees them)."""
        slot, span, compute = self.step_number % self.horizon, self.span, self.compute_dtype
        self.computed_row_steps += span
        mixed = compute != self.layer_state.dtype
        views = self._views(span)
        views[0].layer_input[:, :, :views[0].dim] = self.inputs[slot, :, :span]
        for index, (gate_products, projections, bias, view) in enumerate(zip(self.gate_products, self.projections,
                                                                              self.bias, views)):
            product_state = view.layer_input.to(compute).unbind() if mixed else view.directions  # D x (R', 2P)
            if self.fused:
                for d in range(2):  # the product, then the cell in one pass, a direction at a time
                    projection_input = self._projection_input[d, :span]
                    self._fused_cell(gate_products[d], product_state[d], bias[d], view.cell[d], projection_input)
                    view.projected[d].copy_(projections[d](projection_input))  # (R', P)
            else:
                gates = [gate_products[d](product_state[d], bias[d]) for d in range(2)]  # D x (R', 4C):
                if mixed:  # [x | h] (W_in | W_rec)^T + b, then the cell for both directions at once
                    gates = torch.stack(gates).to(view.cell.dtype)
                else:
                    gates = torch.stack(gates, out=view.gates)
                lstm_cell.cell_step(lstm_cell.activate_doubled_gates_(gates), view.cell, self.cell_clip,
                                    cell_next=view.cell, cell_output=view.cell_output, tanh=lstm_cell.tanh_via_sigmoid)
                product_output = view.cell_output.to(compute) if mixed else view.cell_output
                for d in range(2):
                    view.projected[d].copy_(projections[d](product_output[d]))  # (R', P)
            hidden = lstm_cell.clip_(view.hidden, self.proj_clip)  # (D, R', P)
            output = self.outputs[index, slot, :, :span]  # (D, R', P)
            if index > 0:  # the residual from layer 2 on, as `lstm_cell.run_layers` adds it
                torch.add(hidden, view.residual, out=output)
            else:
                output.copy_(hidden)
            if view.next_input is not None:
                view.next_input.copy_(output)
        ended = self.ends.pop(self.step_number, [])
        self.step_number += 1
        return ended

    def _fused_cell(self, products: "PackedLinear | SplitGateProduct", state: torch.Tensor, bias: torch.Tensor,
                    cell: torch.Tensor, projection_input: torch.Tensor) -> None:
        """One direction's gates from [x | h] (R', 2P) and the cell on them (`fused_cell`): c_t into
        `cell`, m_t into `projection_input`; int8 products' sums scaled as the cell reads them."""
        if isinstance(products, SplitGateProduct):
            dim = state.shape[-1] // 2
            done = fused_cell.cell_int8_(products.input.unscaled(state[:, :dim]),
                                         products.recurrent.unscaled(state[:, dim:]), bias, cell, projection_input,
                                         self.cell_clip)
        else:
            done = fused_cell.cell_(products(state, bias), cell, projection_input, self.cell_clip)
        if not done:
            raise RuntimeError("the fused cell refused the served recurrence's tensors")  # a bug: they are its kinds

    def _views(self, span: int) -> list[_SpanViews]:
        """Each layer's views of the state for a step of rows 0 .. span-1, made once per span (a
        step would otherwise spend more time slicing than computing at a few busy rows)."""
        views = self._span_views.get(span)
        if views is None:
            dim, n_layers = self.outputs.shape[-1], len(self.layers)
            state = self.layer_state[:, :, :span]  # (L, D, R', [P | P])
            width = self._gates.shape[-1]  # 4C
            gates = self._gates.view(-1)[:2 * span * width].view(2, span, width)  # (D, R', 4C), contiguous
            views = [_SpanViews(dim, state[index], state[index].unbind(), self.cell[index, :, :span],
                                self.cell_output[:, :span], gates, state[index, :, :, dim:].unbind(),
                                state[index, :, :, dim:], state[index, :, :, :dim],
                                state[index + 1, :, :, :dim] if index + 1 < n_layers else None)
                     for index in range(n_layers)]
            self._span_views[span] = views
        return views

    @torch.no_grad()
    def take(self, rows: Sequence[int], sentence_vectors: bool = False) -> list[np.ndarray]:
        """What the sentences that ended in `rows` gave (the rows are freed): each one's layers
        (L+1, n, 2P) float32, boundaries dropped (as `ElmoEmbedder.embed_many` gives them), or with
        `sentence_vectors` its vector (2P,): the mean over its tokens of the equal-weight average of
        the layers (TF-Hub's `default`; zeros for no token): `elmokit.inference.layers.sentence_vector`,
        summed here from the rings without building the layers (tests/test_serve_trust.py checks the two
        agree). Read in numpy (a view of the CPU's rings, a copy of a GPU's pieces): a few
        microseconds a sentence instead of a few torch calls."""
        results = []
        n_layers, dim = len(self.layers), self.outputs.shape[-1]
        for row in rows:
            first, tokens = self.busy.pop(row)  # tokens (S, P) float32 numpy, boundaries included
            heapq.heappush(self.free, row)
            tokens = tokens[1:-1]  # (n, P)
            n_tokens = len(tokens)
            # step first+i read forward position i and backward position S-1-i, so the tokens
            # (positions 1 .. n) are steps first+1 .. first+n in both directions, backward reversed
            pieces = [self._read(slot, length, row) for slot, length in self._ring(first + 1, n_tokens)]  # (L, k, D, P)
            if sentence_vectors:
                summed = sum(piece.sum(axis=(0, 1)) for piece in pieces) + tokens.sum(axis=0)  # (D, P): layers, tokens
                results.append((summed.reshape(-1) / max(1, n_tokens * (n_layers + 1))).astype(np.float32))  # (2P,)
                continue
            steps = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=1)  # (L, n, D, P)
            layers = np.empty((n_layers + 1, n_tokens, 2 * dim), np.float32)  # (L+1, n, 2P): [forward | backward]
            layers[0, :, :dim] = tokens
            layers[0, :, dim:] = tokens
            layers[1:, :, :dim] = steps[:, :, 0]
            layers[1:, :, dim:] = steps[:, ::-1, 1]
            results.append(layers)
        self.span = max(self.busy, default=-1) + 1
        return results

    def drop(self, rows: Sequence[int]) -> None:
        """Free `rows` at once, their sentences unfinished and unread (their requests' clients
        have gone): the next step no longer computes them."""
        for row in rows:
            first, tokens = self.busy.pop(row)  # tokens (S, P)
            end = first + len(tokens) - 2
            self.ends[end].remove(row)
            if not self.ends[end]:
                del self.ends[end]
            heapq.heappush(self.free, row)
        self.span = max(self.busy, default=-1) + 1

    @torch.no_grad()
    def compact(self) -> dict[int, int]:
        """Move the sentences of the highest busy rows into the free rows below them, so that rows
        0 .. busy-1 hold every busy one and a step computes no idle row (it computes rows 0 ..
        span-1: an idle row among them costs as much as a busy one). Call it after `admit`, which
        fills the lowest free rows first, so that only the holes no new sentence filled cost a move.
        Returns {old row: new row} for every sentence moved (a move copies its state and its steps
        in the rings: a few slices)."""
        moves = {}
        while self.free and self.busy and self.free[0] < self.span - 1:
            old = self.span - 1  # the highest busy row (span is the highest busy row + 1)
            new = heapq.heapreplace(self.free, old)
            self._move(old, new)
            moves[old] = new
            self.span = max(self.busy) + 1
        return moves

    def _move(self, old: int, new: int) -> None:
        """The sentence in row `old` to the free row `new`: its state, and its steps in the rings."""
        first, tokens = self.busy.pop(old)
        self.busy[new] = (first, tokens)
        ending = self.ends[first + len(tokens) - 2]
        ending[ending.index(old)] = new
        inputs = self._host_inputs if self._host_inputs is not None else self.inputs
        outputs = self._host_outputs if self._host_outputs is not None else self.outputs
        for slot, length in self._ring(first, len(tokens) - 1):  # the sentence's S-1 steps
            inputs[slot:slot + length, :, new] = inputs[slot:slot + length, :, old]
            outputs[:, slot:slot + length, :, new] = outputs[:, slot:slot + length, :, old]
        self.layer_state[:, :, new] = self.layer_state[:, :, old]
        self.cell[:, :, new] = self.cell[:, :, old]

    def _read(self, slot: int, length: int, row: int) -> np.ndarray:
        """The outputs of `row` at ring slots slot .. slot+length-1: (L, k, D, P) in numpy."""
        if self._host_outputs is not None:
            return self._host_outputs[:, slot:slot + length, :, row]
        return self.outputs[:, slot:slot + length, :, row].cpu().numpy()

    def _ring(self, first: int, count: int) -> list[tuple[int, int]]:
        """The ring slots of steps first .. first+count-1: one run, or two where it wraps."""
        slot = first % self.horizon
        if slot + count <= self.horizon:
            return [(slot, count)]
        return [(slot, self.horizon - slot), (0, count - (self.horizon - slot))]

    def clear(self) -> list[int]:
        """Drop every sentence (after a failed step); the rows that were busy."""
        rows = list(self.busy)
        self.busy.clear()
        self.ends.clear()
        self.free = list(range(self.rows))
        self.span = 0
        return rows
