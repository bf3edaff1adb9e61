"""The stateless biLM as one ONNX graph (issue 35), for onnxruntime and any program that runs ONNX.

    char_ids (B, T, W) int64, as `batch_to_ids` returns them (all-zero rows are padding)
      -> <S> ... </S> around each sentence (`add_boundaries`)      (B, S, W), mask (B, S)
      -> the token encoder on the real positions                   (N, P)
      -> `BiLM.contextualize` with the LSTM driver below            L+1 layers (B, S, 2P)
      -> boundaries removed (`token_layers`)                        layers (B, L+1, T, 2P), mask (B, T)
      [-> `ScalarMix` with given parameters                         mixed (B, T, 2P)]

Every piece is elmokit's own code, traced by `torch.onnx.export(dynamo=True)`: the character
scheme and the boundaries (`elmokit.model.chars`), the model's convolution, highway and projection
modules, `BiLM.contextualize` and `token_layers`, and the LSTM cell of `elmokit.model.cell`
(gates, clips, projection) and its stacking (`run_layers`: the residual). What this file adds is
a fourth driver of that cell, one that ONNX can hold: a `scan` over the steps (an ONNX `Scan`
whose body is one step of both directions), for ONNX's own LSTM operator has no projection and
clips the gate inputs, not the cell. Stateless as `ElmoEmbedder`: every row starts from a zero
state, and the backward direction reads each row from its own last position (the row reversed
within its length), so padding never reaches a real position; padded positions give zeros.

Two things differ from `ElmoEmbedder`'s path, neither in the formulas: the char CNN runs as
convolutions (`nn.Conv1d`, bias inside the max; elmokit's inference runs the same convolutions as
products over windows), and every row runs the recurrence for the longest row's steps (elmokit's
stream engine packs rows instead). Both give the same numbers within float32 rounding, and the
export checks that it does: `export_onnx` writes to a temporary name, runs onnx's checker, then
onnxruntime on `CHECK_SENTENCES` against elmokit, and renames the file into place only if every
value is within `TOLERANCE`; a mismatch raises `OnnxMismatchError`.

Needs the `[onnx]` extra (onnx, onnxruntime, and onnxscript for torch's exporter).

Shape notation (as in model/bilm.py): B batch, T tokens, S = T + 2 positions with boundaries,
N real positions, W char ids a token, P projection dim, C cell dim, L layers, D = 2 directions.
"""

from __future__ import annotations

import contextlib
import copy
import math
import json
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from elmokit.extras import EXTRAS, require
from elmokit.inference.elmo import int8_modules, run_bilm, token_layers
from elmokit.model.int8 import unquantize_modules
from elmokit.io import atomic_path, check_replaceable
from elmokit.kernels import KERNELS_VARIABLE, linear
from elmokit.model import cell as lstm_cell
from elmokit.model.bilm import BiLM
from elmokit.model.chars import MAX_CHARS, N_CHAR_IDS, add_boundaries
from elmokit.model.lstm import BiLstmLayer
from elmokit.model.manylangs import ManyLangsBiLM
from elmokit.model.mix import ScalarMix

INPUT_NAME = "char_ids"
OUTPUT_NAMES = ("layers", "mask", "mixed")  # "mixed" only with a scalar mix
TOLERANCE = 1e-5  # max |onnxruntime - elmokit| of any layer value, in the check on writing
CHECK_SENTENCES = (  # the check on writing: mixed lengths, an empty sentence (a row of padding)
    ("The", "old", "sailor", "would", "play", "a", "tune", "on", "his", "flute", "at", "night", "."),
    ("Colorless", "green", "ideas", "sleep", "furiously", "."),
    (),
    ("naïve", "café", "😀", "東京", "Zürich"),
    ("a",),
)
_TRACE_SENTENCES = (("one", "two", "three"), ("four", "five"), ())  # the example input: B and T above 1


ONNX_PACKAGES = EXTRAS["onnx"]  # onnxscript: torch's exporter


class OnnxMismatchError(ValueError):
    """onnxruntime's outputs of an exported graph differ from elmokit's beyond `TOLERANCE`."""


def require_onnx(purpose: str, packages: tuple[str, ...] = ONNX_PACKAGES) -> None:
    """MissingExtraError naming the `[onnx]` extra unless `packages` import (`extras.require`)."""
    require("onnx", purpose, packages)


# ---------------------------------------------------------------------------------------------
# The module torch exports: elmokit's pieces, with an LSTM driver that ONNX can hold
# ---------------------------------------------------------------------------------------------
class ExportableBiLM(nn.Module):
    """A float32 `BiLM` on the CPU as one stateless function of char ids, for `torch.onnx.export`.

    forward(char_ids (B, T, W) int64) -> layers (B, L+1, T, 2P) float32 (zero past each sentence),
    mask (B, T) bool, and with `mix_parameters` mixed (B, T, 2P) = gamma * sum_k softmax(s)_k layer_k.

    Args:
        bilm: the biLM (used as it is: give a float32 copy on the CPU, in eval mode).
        mix_parameters: the L+1 scalar parameters s of a `ScalarMix` (before the softmax, as
            `Elmo(scalar_mix_parameters=...)` takes them), or None for no mixed output.
        mix_gamma: the mix's gamma.
    """

    def __init__(self, bilm: BiLM, mix_parameters: Sequence[float] | None = None, mix_gamma: float = 1.0):
        super().__init__()
        self.bilm = bilm
        self.mix = None
        if mix_parameters is not None:
            self.mix = ScalarMix(bilm.config.n_output_layers, initial_scalar_parameters=list(mix_parameters),
                                 trainable=False)
            self.mix.gamma.fill_(mix_gamma)

    def forward(self, char_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        boundary_ids, mask = add_boundaries(char_ids, *self.bilm.boundary_ids)  # (B, S, W), (B, S)
        real_positions = mask.flatten().nonzero().squeeze(1)  # (N,)
        torch._check(real_positions.shape[0] > 0)  # N >= 2B (the boundaries): lets export decide `numel() > 0`
        token_embeddings = self.encode_tokens(boundary_ids.flatten(0, 1)[real_positions])  # (N, P)
        output = self.bilm.contextualize(token_embeddings, mask, None, self.run_lstm)
        layers = token_layers(output)  # (B, L+1, T, 2P), zero past each sentence
        token_mask = mask[:, 2:]  # (B, T): position t + 1 holds token t, and position t + 2 exists for it
        if self.mix is None:
            return layers, token_mask
        return layers, token_mask, self.mix(list(layers.unbind(1)))  # (B, T, 2P)

    def encode_tokens(self, char_ids: torch.Tensor) -> torch.Tensor:
        """(N, W) -> (N, P): the model's char embedding, its convolutions (`nn.Conv1d`, max over
        positions), activation, highway and projection (`TokenEncoder`'s modules)."""
        encoder = self.bilm.token_encoder
        cnn = encoder.char_cnn
        # ONNX's Gather reads a negative index from the end (-1: the last row); one past the table
        # is an error there (and in torch), so every id outside 0..V-1 is refused, not read
        char_ids = torch.where(char_ids < 0, cnn.char_embedding.num_embeddings, char_ids)  # (N, W)
        chars = cnn.char_embedding(char_ids).transpose(1, 2)  # (N, E, W)
        pooled = torch.cat([conv(chars).amax(dim=-1) for conv in cnn.convolutions], dim=-1)  # (N, F)
        features = encoder.highway(cnn.activation(pooled))  # (N, F)
        return linear(features, encoder.projection.weight, encoder.projection.bias)  # (N, P)

    def run_lstm(self, tokens: torch.Tensor, lengths: torch.Tensor, state: None
                 ) -> tuple[list[torch.Tensor], None]:
        """`BiLM.contextualize`'s driver: tokens (B, S, P) right-padded, lengths (B,) -> L layers
        (B, S, 2P), [forward | backward], zero at padding. Both directions run forward in time
        over (D, B, S, P): the backward one over each row reversed within its length."""
        lstm = self.bilm.lstm
        n_positions = tokens.shape[1]
        steps = torch.arange(n_positions, device=tokens.device)  # (S,)
        last = lengths.unsqueeze(1) - 1  # (B, 1)
        reverse = torch.where(steps <= last, last - steps, steps)  # (B, S): its own inverse
        reverse = reverse.unsqueeze(-1).expand_as(tokens)  # (B, S, P)
        inputs = torch.stack([tokens, tokens.gather(1, reverse)])  # (D, B, S, P)
        outputs, _ = lstm_cell.run_layers(  # the residual from layer 2 on; no dropout (inference)
            lstm.layers, inputs, 0.0, False,
            lambda layer, dropped, _: (scan_layer(layer, dropped, lstm.cell_clip, lstm.proj_clip), None))
        valid = (steps <= last).unsqueeze(-1).to(tokens.dtype)  # (B, S, 1)
        return [torch.cat([output[0], output[1].gather(1, reverse)], dim=-1) * valid  # (B, S, 2P)
                for output in outputs], None


def scan_layer(layer: BiLstmLayer, inputs: torch.Tensor, cell_clip: float, proj_clip: float) -> torch.Tensor:
    """One layer, both directions, every row from a zero state: inputs (D, B, S, P) -> (D, B, S, P).

    The gate inputs of all steps at once, then `scan` over the steps (an ONNX `Scan`), each step
    `elmokit.model.cell`'s: gates, cell with its clip, output, projection with its clip."""
    n_directions, batch_size, n_positions, dim = inputs.shape
    gate_inputs = torch.baddbmm(layer.gate_bias(), inputs.flatten(1, 2), layer.input_weight.mT)  # (D, B*S, 4C)
    gate_inputs = gate_inputs.view(n_directions, batch_size, n_positions, -1).permute(2, 0, 1, 3)  # (S, D, B, 4C)
    recurrent_weight, projection = layer.recurrent_weight.mT, layer.projection.mT  # (D, P, 4C), (D, C, P)

    def step(carry: tuple[torch.Tensor, torch.Tensor], step_inputs: torch.Tensor):
        hidden, cell = carry  # (D, B, P), (D, B, C)
        gates = torch.baddbmm(step_inputs, hidden, recurrent_weight)  # (D, B, 4C)
        cell, cell_output = lstm_cell.cell_step(lstm_cell.activate_gates(gates), cell, cell_clip)  # (D, B, C)
        hidden = lstm_cell.clip_(torch.bmm(cell_output, projection), proj_clip)  # (D, B, P)
        return (hidden, cell), hidden.clone()  # scan wants outputs that alias nothing

    from torch._higher_order_ops.scan import scan  # torch's scan (a prototype API of torch.export)

    initial = (inputs.new_zeros(n_directions, batch_size, dim), inputs.new_zeros(n_directions, batch_size, layer.cell_dim))
    _, outputs = scan(step, initial, gate_inputs)  # (S, D, B, P)
    return outputs.permute(1, 2, 0, 3)  # (D, B, S, P)


# ---------------------------------------------------------------------------------------------
# Writing, checking and running the graph
# ---------------------------------------------------------------------------------------------
def export_onnx(bilm: BiLM, path: str | Path, *, mix_parameters: Sequence[float] | None = None,
                mix_gamma: float = 1.0, tolerance: float = TOLERANCE) -> dict[str, Any]:
    """Write the stateless biLM as one ONNX graph to `path`, checked before it is renamed into place.

    The graph takes `char_ids` int64 (B, T, W), any B and T, as `batch_to_ids` returns them, and
    gives `layers` float32 (B, L+1, T, 2P) and `mask` bool (B, T), as
    `ElmoEmbedder.batch_to_embeddings`; with `mix_parameters` (the L+1 scalar parameters of a
    `ScalarMix`, before the softmax) also `mixed` float32 (B, T, 2P). The file is written under a
    temporary name, checked with `onnx.checker`, then run by onnxruntime on `CHECK_SENTENCES`
    (as one batch, and one at a time) against elmokit: any value further than `tolerance` raises
    `OnnxMismatchError` and leaves `path` untouched.

    Args:
        bilm: the biLM (not changed: a float32 copy on the CPU is exported, also of one placed in
            bfloat16 or marked for int8 products by `dtype=`; its check compares with that copy). ELMoForManyLangs
            models are refused (their character vocabulary is not the byte scheme of `batch_to_ids`).
        path: the .onnx file to write (replaced if it exists).
        mix_parameters, mix_gamma: the optional scalar mix (`ExportableBiLM`).
        tolerance: the largest difference the check accepts.

    Returns:
        what was checked: {"max_abs_diff": the largest difference found, "outputs": output names,
        "bytes": the file's size}.
    """
    require_onnx("the ONNX export")
    if isinstance(bilm, ManyLangsBiLM):
        raise ValueError("an ELMoForManyLangs model cannot be exported to ONNX: its char ids come from its own "
                         "character vocabulary, not from the byte scheme of batch_to_ids that the graph's input is")
    path = Path(path)
    check_replaceable(path)  # before the export, which takes seconds: not a folder, no file above it
    if mix_parameters is not None and len(mix_parameters) != bilm.config.n_output_layers:
        raise ValueError(f"mix_parameters: the model has {bilm.config.n_output_layers} layers (token layer + "
                         f"{bilm.config.lstm.n_layers} LSTM layers), got {len(mix_parameters)} values: {list(mix_parameters)}")
    if mix_parameters is not None and not all(math.isfinite(value) for value in [*mix_parameters, mix_gamma]):
        raise ValueError(f"mix_parameters and mix_gamma must be finite numbers, got {list(mix_parameters)} "
                         f"and {mix_gamma}")
    model = copy.deepcopy(bilm).float().cpu().eval().requires_grad_(False)
    unquantize_modules(int8_modules(model))  # dtype="int8"'s marks: the graph's products are float32's
    module = ExportableBiLM(model, mix_parameters, mix_gamma).eval().requires_grad_(False)
    program = _torch_export(module)
    program.model.metadata_props.update(_metadata(model, mix_parameters, mix_gamma))
    with atomic_path(path) as tmp:
        program.save(tmp)
        import onnx

        onnx.checker.check_model(str(tmp), full_check=True)
        difference = check_onnx(tmp, module, tolerance=tolerance, label=f"{path} (not written)")
        size = tmp.stat().st_size
    return {"max_abs_diff": difference, "outputs": [value.name for value in program.model.graph.outputs],
            "bytes": size}


def _metadata(bilm: BiLM, mix_parameters: Sequence[float] | None, mix_gamma: float) -> dict[str, str]:
    """What the file says about itself (onnx metadata_props): the config, the names, the mix."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        elmokit_version = version("elmokit")
    except PackageNotFoundError:  # a source tree that was not installed
        elmokit_version = "unknown"
    meta = {"producer": f"elmokit {elmokit_version}", "elmokit.config": json.dumps(bilm.config.to_dict()),
            "elmokit.inputs": f"{INPUT_NAME}: int64 (batch >= 1, tokens, {MAX_CHARS}) from elmokit.batch_to_ids, ids "
                              f"in 0..{N_CHAR_IDS - 1} (another is an error), zero rows = padding",
            "elmokit.outputs": "layers: float32 (batch, n_layers, tokens, 2P), zero at padding; mask: bool (batch, tokens)"}
    if mix_parameters is not None:
        meta["elmokit.mix"] = json.dumps({"scalar_parameters": list(map(float, mix_parameters)), "gamma": mix_gamma})
        meta["elmokit.outputs"] += "; mixed: float32 (batch, tokens, 2P) = gamma * sum_k softmax(s)_k layers[:, k]"
    return meta


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """torch.onnx's log lines and warnings (torchvision absent, prototype scan) kept out of the
    user's output, and the plain products (`ELMOKIT_KERNELS=torch`, set in os.environ for the
    export's duration: another thread's products take the plain path meanwhile) traced, not
    oneDNN's private ops, which ONNX has no translation for."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._dynamo", "torch._export")]
    levels = [logger.level for logger in loggers]
    previous = os.environ.get(KERNELS_VARIABLE)
    os.environ[KERNELS_VARIABLE] = "torch"
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if previous is None:
            os.environ.pop(KERNELS_VARIABLE, None)
        else:
            os.environ[KERNELS_VARIABLE] = previous


def _torch_export(module: ExportableBiLM):
    """torch.onnx.export (the torch.export path), batch and tokens dynamic."""
    example = module.bilm.batch_ids([list(sentence) for sentence in _TRACE_SENTENCES])  # (3, 3, W)
    batch, tokens = torch.export.Dim("batch", min=1), torch.export.Dim("tokens", min=1)
    outputs = list(OUTPUT_NAMES if module.mix is not None else OUTPUT_NAMES[:2])
    with _quiet_export(), torch.no_grad():
        return torch.onnx.export(module, (example,), dynamo=True, input_names=[INPUT_NAME], output_names=outputs,
                                 dynamic_shapes={"char_ids": {0: batch, 1: tokens}}, optimize=True, verbose=False)


def onnx_session(path: str | Path, threads: int = 2, spinning: bool = False):
    """An onnxruntime CPU session of an exported file, `threads` threads for each operator.

    `spinning=False` lets onnxruntime's threads sleep between operators instead of busy-waiting
    (its default): on a machine whose cores other work shares, a spinning pool takes a core."""
    require_onnx("running an exported ONNX graph", ("onnxruntime",))
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    options.log_severity_level = 3  # errors only: not its notes on the graph (an initializer it found unused)
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def check_graph_input(char_ids: np.ndarray) -> np.ndarray:
    """The graph's input contract, checked with a message (the graph itself can only fail, in
    onnxruntime's words): int64 (B, T, 50) with B >= 1 (a batch of no sentences has nothing to
    embed: the graph's shapes need a row) and every id in 0..261 (another one, -1 included, is an
    error in the graph too). Returns the array as int64."""
    char_ids = np.asarray(char_ids)
    if char_ids.ndim != 3 or char_ids.shape[2] != MAX_CHARS:
        raise ValueError(f"{INPUT_NAME}: expected shape (batch, tokens, {MAX_CHARS}) as batch_to_ids gives, "
                         f"got {char_ids.shape}")
    if not np.issubdtype(char_ids.dtype, np.integer):
        raise TypeError(f"{INPUT_NAME}: expected integer ids (int64), got {char_ids.dtype}")
    if char_ids.shape[0] == 0:
        raise ValueError(f"{INPUT_NAME}: a batch of 0 sentences; the graph takes 1 or more (there is nothing "
                         "to embed: skip the call)")
    if char_ids.size and not 0 <= char_ids.min() <= char_ids.max() < N_CHAR_IDS:
        bad = char_ids[(char_ids < 0) | (char_ids >= N_CHAR_IDS)]
        raise ValueError(f"{INPUT_NAME}: ids must be in 0..{N_CHAR_IDS - 1} (elmokit.batch_to_ids), got "
                         f"{sorted(set(bad.tolist()))[:5]}")
    return char_ids.astype(np.int64, copy=False)


def run_onnx(session: Any, char_ids: np.ndarray) -> list[np.ndarray]:
    """Run an exported graph (an `onnx_session`) on char ids (B, T, 50), its contract checked
    first (`check_graph_input`): [layers (B, L+1, T, 2P), mask (B, T)(, mixed (B, T, 2P))]."""
    return session.run(None, {INPUT_NAME: check_graph_input(char_ids)})


def check_onnx(path: str | Path, bilm: BiLM | ExportableBiLM, sentences: Sequence[Sequence[str]] = CHECK_SENTENCES,
               tolerance: float = TOLERANCE, session: Any = None, label: str | None = None) -> float:
    """Run the graph in onnxruntime on `sentences` (as one batch, and each alone) and compare with
    elmokit's `ElmoEmbedder` path (`run_bilm`, stateless) on the same model: returns the largest
    difference of any value; raises `OnnxMismatchError` past `tolerance`, or if a mask differs.

    `bilm` is the biLM the file was exported from, or its `ExportableBiLM` (then the mix, if any,
    is checked too). `label` names the file in the errors (default: `path`)."""
    label = label or str(path)
    module = bilm if isinstance(bilm, ExportableBiLM) else ExportableBiLM(bilm)
    session = session or onnx_session(path)
    batches = [[list(s) for s in sentences], *([list(s)] for s in sentences)]
    worst = 0.0
    for batch in batches:
        got = run_onnx(session, module.bilm.batch_ids(batch).numpy())  # its input checked first
        expected = elmokit_outputs(module, batch)
        if len(got) != len(expected):
            raise OnnxMismatchError(f"{label}: the graph has {len(got)} outputs, elmokit's export {len(expected)}")
        for name, want, have in zip(OUTPUT_NAMES, expected, got):
            if want.shape != have.shape:
                raise OnnxMismatchError(f"{label}: output {name!r} of a batch of {len(batch)}: shape {have.shape}, "
                                        f"elmokit's {want.shape}")
            if name == "mask":
                if not np.array_equal(want, have):
                    raise OnnxMismatchError(f"{label}: the mask of a batch of {len(batch)} differs from elmokit's")
                continue
            difference = float(np.abs(want - have).max()) if want.size else 0.0
            if not difference <= tolerance:  # NaN too
                raise OnnxMismatchError(
                    f"{label}: onnxruntime's {name!r} differs from elmokit's by {difference:.3g} (> {tolerance:g}) "
                    f"on a batch of {len(batch)} sentences of {[len(s) for s in batch]} tokens")
            worst = max(worst, difference)
    return worst


@torch.no_grad()
def elmokit_outputs(module: ExportableBiLM, batch: Sequence[Sequence[str]]) -> list[np.ndarray]:
    """What the graph must give for `batch`, computed by elmokit's inference path (the stateless
    engine, `run_bilm` + `token_layers`, as `ElmoEmbedder(cache_tokens=False)`): layers, mask
    [and mixed]."""
    bilm = module.bilm
    layers = token_layers(run_bilm(bilm, bilm.batch_ids(batch), None))  # (B, L+1, T, 2P)
    lengths = torch.tensor([len(sentence) for sentence in batch])
    mask = torch.arange(layers.shape[2]) < lengths.unsqueeze(1)  # (B, T)
    outputs = [layers.numpy(), mask.numpy()]
    if module.mix is not None:
        outputs.append(module.mix(list(layers.unbind(1))).numpy())
    return outputs
