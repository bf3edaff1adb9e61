"""The biLM as torch modules: `Elmo` (scalar mixes for a task, AllenNLP's class) and `HubElmo`
(the TF-Hub output names), with what they share with `ElmoEmbedder` (inference/embedder.py):
moving a biLM to its device and precision, and the carried state.

Stateless by default: the same sentence gives the same vectors whatever else is in the batch and
whatever came before. `stateful=True` reproduces the original carried LSTM state (as AllenNLP's
biLM, each row of a call starts from that row's final state of the call before).

Devices and precision: every class takes `device=` ("cpu", "cuda", "cuda:N", "auto"; AllenNLP's
`cuda_device` is kept as an alias where AllenNLP has it) and `dtype=` (float32; bfloat16 for
faster inference: the weights and their products in bfloat16; or int8, on a CPU with VNNI or
AMX-INT8: float32 weights, the LSTM's input and recurrent products in int8 and the rest of the
products in bfloat16, `elmokit.model.int8`; in both the activations, the LSTM state and the outputs in
float32, stateless, no gradients). See `elmokit.devices` and `place_bilm`.

Threads: one `ElmoEmbedder`, or one `Elmo` in eval mode, may be called from many threads at once
and gives each call what a call alone would give. What they share that changes (the token cache,
the carried state) is behind a lock; the biLM's forward pass changes nothing shared.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from elmokit.model.chars import BOS_TOKEN, EOS_TOKEN, MAX_CHARS
from elmokit.devices import dtype_name, resolve_device, resolve_dtype, use_threads
from elmokit.model.int8 import is_int8, quantize_modules, unquantize_modules
from elmokit.kernels import warn_if_bfloat16_is_emulated, weights_key
from elmokit.model.bilm import BiLM, BiLMOutput, LstmState
from elmokit.model.mix import ScalarMix
from elmokit.inference.engine import bilm_contextualize, bilm_forward
from elmokit.sources.loading import load_model

# ---------------------------------------------------------------------------------------------
# Carried state (AllenNLP's stateful biLM), only when asked for
# ---------------------------------------------------------------------------------------------
class CarriedState:
    """The original stateful behaviour: row b of a call starts from the final state of row b of
    the previous calls. Rows beyond the current batch keep their values for a later, larger batch.

    Calls from several threads take turns: `lock` is held from `take` to `store` (`run_carried`).
    """

    def __init__(self) -> None:
        self.state: LstmState | None = None  # hidden (L, D, S, P), cell (L, D, S, C)
        self.lock = threading.Lock()

    def __getstate__(self) -> dict:  # copy.deepcopy of a module holding it
        return {"state": self.state}

    def __setstate__(self, record: dict) -> None:
        self.__init__()
        self.state = record["state"]

    def reset(self) -> None:
        self.state = None

    def take(self, batch_size: int) -> LstmState | None:
        if self.state is None:
            return None
        stored = self.state.hidden.shape[2]
        if stored < batch_size:  # extend permanently with zero rows
            self.state = LstmState(*(torch.cat([t, t.new_zeros(*t.shape[:2], batch_size - stored, t.shape[3])], 2)
                                     for t in self.state))
        return LstmState(*(t[:, :, :batch_size] for t in self.state))

    def store(self, final: LstmState) -> None:
        final = LstmState(*(t.detach() for t in final))
        batch_size = final.hidden.shape[2]
        if self.state is None or self.state.hidden.shape[2] <= batch_size:
            self.state = final
        else:
            self.state = LstmState(*(torch.cat([new, old[:, :, batch_size:]], 2)
                                     for new, old in zip(final, self.state)))


def run_carried(carried: CarriedState | None, batch_size: int,
                run: Callable[[LstmState | None], BiLMOutput]) -> BiLMOutput:
    """`run(state)` for a batch of `batch_size` rows: from the carried state (which is then updated
    with the final one) under its lock, or from a zero state (None) when stateless."""
    if carried is None:
        return run(None)
    with carried.lock:
        output = run(carried.take(batch_size))
        carried.store(output.state)
    return output


def run_bilm(bilm: BiLM, char_ids: torch.Tensor, carried: CarriedState | None) -> BiLMOutput:
    """The biLM on char ids (B, T, W), carrying the state if `carried` is given."""
    return run_carried(carried, char_ids.shape[0], lambda state: bilm_forward(bilm, char_ids, state, carried is not None))


def place_bilm(bilm: BiLM, device: torch.device, dtype: str | torch.dtype | None, trainable: bool,
               stateful: bool, who: str, threads: int | None = None) -> BiLM:
    """Set the torch threads it runs on (`elmokit.devices.use_threads`: `threads`, or on the CPU
    the default for what this process may use now), move `bilm` (in place, as `nn.Module.to`) to
    `device` and, unless `dtype` is None, its
    weights to `dtype`; "int8" marks the LSTM for int8 products and the token encoder for bfloat16
    ones (`int8_modules`, `elmokit.model.int8.quantize_modules`, the CPU only) on float32 weights: a biLM
    in another dtype is refused (its weights already rounded; load it in float32). "float32" or
    "bfloat16" removes the marks. None keeps the biLM's own precision (`bilm_precision`): its
    weights' dtype, or int8 where an earlier `dtype="int8"` marked it, as every holder of a shared
    module runs it. bfloat16 and int8 are for stateless inference: an error otherwise."""
    use_threads(threads, device)
    resolved = None if dtype is None else resolve_dtype(dtype)
    before = bilm_precision(bilm)
    if resolved == torch.bfloat16 and device.type == "cpu":
        warn_if_bfloat16_is_emulated()
    if resolved is not None and resolved != torch.int8:
        bilm.to(dtype=resolved)
        unquantize_modules(int8_modules(bilm))
    weights_dtype = bilm.lstm.layers[0].input_weight.dtype
    if resolved == torch.int8 and weights_dtype != torch.float32:
        raise ValueError(f"{who}: dtype int8 quantizes float32 weights, and this biLM's are in "
                         f"{dtype_name(weights_dtype)} (already rounded): load it in float32 for int8, "
                         f"or pass dtype={dtype_name(weights_dtype)!r}")
    precision = "int8" if resolved == torch.int8 else bilm_precision(bilm)
    if precision != "float32" and (trainable or stateful):
        raise ValueError(f"{who} with a biLM in {precision} is for stateless inference: "
                         f"use float32 to fine-tune the biLM or to carry its state"
                         + (" (dtype='float32' removes the int8 marks an earlier dtype='int8' left on "
                            "this module)" if resolved is None and precision == "int8" else ""))
    bilm = bilm.to(device)
    if precision == "int8":  # marks it (again: checks the device of a module marked earlier)
        quantize_modules(int8_modules(bilm), device)
    say_a_shared_precision_changed(bilm, before, precision, who)
    return bilm


_PLACED: "weakref.WeakKeyDictionary[BiLM, str]" = weakref.WeakKeyDictionary()  # the precision a placement left


def say_a_shared_precision_changed(bilm: BiLM, before: str, after: str, who: str) -> None:
    """A warning where a placement changes the precision an earlier one left on this module: the
    precision is the module's own (as `nn.Module.to`), so every holder runs in the new one."""
    earlier, _PLACED[bilm] = _PLACED.get(bilm), after
    if earlier == before != after:
        logging.getLogger(__name__).warning(f"{who}: this biLM module was placed in {before} before and now runs in "
                                            f"{after}, for every embedder holding it; pass module=copy.deepcopy("
                                            "module) to keep both")


def bilm_precision(bilm: BiLM) -> str:
    """What a biLM's products run in: "int8" where `dtype="int8"` marked it (`place_bilm`), else
    its weights' dtype ("float32", "bfloat16"). A module has one precision for every holder."""
    layer = bilm.lstm.layers[0]
    return "int8" if is_int8(layer) else dtype_name(layer.input_weight.dtype)


def int8_modules(bilm: BiLM) -> list[nn.Module]:
    """What `dtype="int8"` marks: the LSTM's layers (their input and recurrent products in int8)
    and the token encoder's char CNN, highway and projection (in bfloat16, `TokenEncoder.narrowed`;
    a ManyLangs encoder's stay float32)."""
    narrowed = getattr(bilm.token_encoder, "narrowed", None)
    return [*bilm.lstm.layers, *(narrowed() if narrowed is not None else [])]


def module_device(module: nn.Module) -> torch.device:
    """The device of a module's (first) parameter."""
    return next(module.parameters()).device


def remove_boundaries(layer: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop <S> and </S>: (B, S, D) with mask (B, S) -> (B, T, D) with mask (B, T); positions past
    each sentence are zero."""
    lengths = mask.sum(dim=1) - 2  # (B,)
    token_mask_ = torch.arange(mask.shape[1] - 2, device=mask.device) < lengths.unsqueeze(1)  # (B, T)
    return layer[:, 1:-1] * token_mask_.unsqueeze(-1).to(layer.dtype), token_mask_


def check_char_ids(bilm: BiLM, char_ids: object, who: str) -> None:
    """TypeError unless `char_ids` is an integer tensor (..., T, W); ValueError naming the range
    unless every id is a row of the model's character table (and word table, where it has one)."""
    if not isinstance(char_ids, torch.Tensor):
        raise TypeError(f"{who}: expected a tensor of char ids (B, T, W), e.g. batch_to_ids(sentences), "
                        f"got {type(char_ids).__name__}")
    if char_ids.is_floating_point() or char_ids.is_complex() or char_ids.dtype == torch.bool or char_ids.dim() < 2:
        raise TypeError(f"{who}: expected integer char ids (B, T, W), got {char_ids.dtype} of shape "
                        f"{tuple(char_ids.shape)}")
    encoder = bilm.token_encoder
    words = getattr(encoder, "word_embedding", None)  # ELMoForManyLangs: a word id after the chars
    width = getattr(encoder, "max_chars", MAX_CHARS) + (words is not None)  # W
    if char_ids.shape[-1] != width:
        maker = "batch_to_ids(sentences)" if not hasattr(encoder, "max_chars") else \
            "the model's own bilm.batch_ids(sentences) (ELMoForManyLangs: not ELMo's batch_to_ids)"
        raise ValueError(f"{who}: expected char ids (B, T, {width}), {width} ids a token as {maker} makes them, got "
                         f"shape {tuple(char_ids.shape)}")
    n_chars = encoder.char_cnn.char_embedding.num_embeddings
    tables = [(char_ids, n_chars, "char")] if words is None else [
        (char_ids[..., :encoder.max_chars], n_chars, "char"),
        (char_ids[..., encoder.max_chars:], words.num_embeddings, "word")]
    for ids, n_rows, what in tables:
        if ids.numel() and bool(((ids < 0) | (ids >= n_rows)).any()):
            raise ValueError(f"{who}: {what} ids must lie in [0, {n_rows}) (the rows of the model's {what} "
                             f"table), got ids from {int(ids.min())} to {int(ids.max())}")


def token_layers(output: BiLMOutput) -> torch.Tensor:
    """Every layer of a biLM output without <S> and </S>, stacked: (B, L+1, T, 2P), zero past
    each sentence (what `ElmoEmbedder` returns and what a fine-tuned task mixes)."""
    return torch.stack([remove_boundaries(layer, output.mask)[0] for layer in output.layers], dim=1)


# ---------------------------------------------------------------------------------------------
# Elmo: the module a task model holds
# ---------------------------------------------------------------------------------------------
class Elmo(nn.Module):
    """The biLM plus `num_output_representations` scalar mixes (AllenNLP's `Elmo`).

    Args:
        options_file: original options JSON (a path or an http(s) URL, downloaded into the cache),
            or a model directory (native or ELMoForManyLangs), a published name ("original", ...)
            or TF-Hub handle (then `weight_file` is None), or None for the built-in English model.
        weight_file: original HDF5 weights (a path or URL).
        num_output_representations: how many independent mixes (e.g. one for the input and one
            for the output of a task's RNN).
        requires_grad: fine-tune the biLM.
        do_layer_norm: normalise each layer before mixing (one mean/variance per batch).
        dropout: applied to each representation (AllenNLP's default 0.5).
        vocab_to_cache: precompute the token layer for these words; then call with `word_inputs`.
            The table follows the token encoder: computed again after its weights change (an
            optimizer's step, `load_state_dict`, `.to()`), and with gradients on (fine-tuning with
            `requires_grad`) the batch's words go through the encoder, so that it learns from
            `word_inputs` as from char ids.
        keep_sentence_boundaries: keep `<S>` and `</S>` in the outputs.
        scalar_mix_parameters: fixed raw (pre-softmax) layer weights; frozen, gamma = 1.
        stateful: carry the LSTM state from call to call as AllenNLP's biLM did.
        module: an already loaded `BiLM` to use instead of loading one (moved and converted in place).
        device: where to run ("cpu", "cuda", "cuda:N", "auto"; default: the CPU).
        dtype: torch.bfloat16 (or "bfloat16") for a frozen, stateless biLM in bfloat16; "int8"
            (the CPU, one with VNNI or AMX-INT8; frozen and stateless too) for the LSTM's input and
            recurrent products in int8 and the rest in bfloat16 on float32 weights
            (`elmokit.model.int8`); "float32" (exact). Default: the biLM's own precision
            (`bilm_precision`: float32 for a model loaded here; for `module`, its weights' dtype,
            or int8 if an earlier `dtype="int8"` marked it).
        threads: torch's CPU threads (for the whole process, as `torch.set_num_threads`). Default:
            the CPUs this process may use that other work leaves free (`elmokit.devices.use_threads`).

    Forward: `inputs` (B, T, 50) char ids (any leading dims), or `word_inputs` (B, T) ids into
    `vocab_to_cache` (0 = padding), moved to the module's device. Returns
    {"elmo_representations": [(B, T, 2P)] * n, "mask": (B, T) bool}, float32, on that device.
    """

    def __init__(self, options_file: str | Path | None = None, weight_file: str | Path | None = None,
                 num_output_representations: int = 1, requires_grad: bool = False,
                 do_layer_norm: bool = False, dropout: float = 0.5,
                 vocab_to_cache: list[str] | None = None, keep_sentence_boundaries: bool = False,
                 scalar_mix_parameters: list[float] | None = None, module: BiLM | None = None, *,
                 stateful: bool = False, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, threads: int | None = None):
        super().__init__()
        if isinstance(num_output_representations, bool) or not isinstance(num_output_representations, int) \
                or num_output_representations < 1:
            raise ValueError(f"Elmo: num_output_representations must be an integer >= 1, got "
                             f"{num_output_representations!r}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout <= 1:
            raise ValueError(f"Elmo: dropout must be a probability in [0, 1], got {dropout!r}")
        self.bilm = module if module is not None else load_model(options_file, weight_file)
        self.bilm = place_bilm(self.bilm, resolve_device(device), dtype, requires_grad, stateful, "Elmo",
                               threads)
        self.bilm.requires_grad_(requires_grad)
        self.keep_sentence_boundaries = keep_sentence_boundaries
        self.dropout = nn.Dropout(dropout)
        n_layers = self.bilm.config.n_output_layers
        self.scalar_mixes = nn.ModuleList(
            ScalarMix(n_layers, do_layer_norm, scalar_mix_parameters, trainable=scalar_mix_parameters is None)
            for _ in range(num_output_representations)
        ).to(module_device(self.bilm))
        self.carried = CarriedState() if stateful else None
        self._vocabulary = None if vocab_to_cache is None else [BOS_TOKEN, EOS_TOKEN, *vocab_to_cache]
        self.register_buffer("word_embedding", None, persistent=False)  # their token layer (2 + V, P)
        self._vocabulary_key = None  # the precision and encoder weights `word_embedding` was computed from
        self._token_table()

    def _token_table(self) -> torch.Tensor | None:
        """`word_embedding`, computed again whenever the token encoder's weights or the biLM's
        precision changed since (`kernels.weights_key`): a fine-tuned, reloaded or moved encoder's
        words, never a stale table, and never mixed precisions."""
        if self._vocabulary is None:
            return None
        key = (bilm_precision(self.bilm), weights_key(self.bilm.token_encoder.parameters()))
        if key != self._vocabulary_key:
            with torch.no_grad():
                self.word_embedding = self.bilm.encode_words(self._vocabulary)
            self._vocabulary_key = key
        return self.word_embedding

    @classmethod
    def from_params(cls, params: Mapping) -> "Elmo":
        """AllenNLP's `Elmo.from_params`: the constructor's arguments from a mapping (an AllenNLP
        `Params`, a dict from a JSON config); unknown keys are an error naming them."""
        params = dict(params.as_dict() if hasattr(params, "as_dict") else params)
        known = set(inspect.signature(cls.__init__).parameters) - {"self"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"Elmo.from_params: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**params)

    def get_output_dim(self) -> int:
        return self.bilm.output_dim

    def __repr__(self) -> str:
        config = self.bilm.config.lstm
        return (f"Elmo({config.n_layers} x {config.cell_dim} cells -> {config.projection_dim}, "
                f"{len(self.scalar_mixes)} mix(es) of {self.bilm.config.n_output_layers} layers -> "
                f"{self.get_output_dim()}, dropout={self.dropout.p}, "
                f"{'stateful' if self.carried is not None else 'stateless'}, device={module_device(self.bilm)})")

    def reset_states(self) -> None:
        """Forget the carried state (stateful mode)."""
        if self.carried is not None:
            self.carried.reset()

    def forward(self, inputs: torch.Tensor | None = None, word_inputs: torch.Tensor | None = None
                ) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        device = module_device(self.bilm)
        if word_inputs is not None and self.word_embedding is not None:
            leading = word_inputs.shape[:-1]
            word_ids = word_inputs.reshape(math.prod(leading), word_inputs.shape[-1])  # (B, T)
            if len(word_ids) == 0:  # no sentence: nothing to run
                return self._empty_output(leading, word_ids.shape[1], device)
            output = self._run_cached(word_ids.to(device))
        else:
            if inputs is None:
                raise ValueError("Elmo needs `inputs` (char ids), or `word_inputs` with vocab_to_cache")
            check_char_ids(self.bilm, inputs, "Elmo.forward: inputs")
            leading = inputs.shape[:-2]
            char_ids = inputs.reshape(math.prod(leading), *inputs.shape[-2:])  # (B, T, W)
            if len(char_ids) == 0:  # batch_to_ids([]): nothing to run
                return self._empty_output(leading, char_ids.shape[1], device)
            output = run_bilm(self.bilm, char_ids.to(device), self.carried)

        representations = []
        for mix in self.scalar_mixes:
            mixed = mix(output.layers, output.mask)  # (B, S, 2P)
            mask = output.mask
            if not self.keep_sentence_boundaries:
                mixed, mask = remove_boundaries(mixed, output.mask)
            representations.append(self.dropout(mixed).view(*leading, *mixed.shape[1:]))
        return {"elmo_representations": representations, "mask": mask.view(*leading, mask.shape[-1])}

    def _empty_output(self, leading: torch.Size, n_tokens: int, device: torch.device
                      ) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """What a batch without sentences gives: (*leading, T, 2P) representations and a (*leading, T)
        mask with no element (T + 2 positions with the boundaries kept)."""
        n_positions = n_tokens + 2 if self.keep_sentence_boundaries else n_tokens
        representations = [torch.zeros(*leading, n_positions, self.get_output_dim(), device=device)
                           for _ in self.scalar_mixes]
        return {"elmo_representations": representations,
                "mask": torch.zeros(*leading, n_positions, dtype=torch.bool, device=device)}

    def _run_cached(self, word_ids: torch.Tensor) -> BiLMOutput:
        """word_ids (B, T): indices into vocab_to_cache, whose entry 0 is padding (as in AllenNLP)."""
        n_words = len(self._vocabulary) - 2
        if word_ids.numel() and bool(((word_ids < 0) | (word_ids >= n_words)).any()):
            raise ValueError(f"Elmo.forward: word_inputs must be ids into vocab_to_cache, 0 (padding) to "
                             f"{n_words - 1}, got ids from {int(word_ids.min())} to {int(word_ids.max())}")
        lengths = (word_ids > 0).sum(dim=1)
        # table rows: 0 = <S>, 1 = </S>, 2 + i = vocab_to_cache[i]
        rows = boundary_rows(lengths.cpu().numpy(), word_ids[word_ids > 0].cpu().numpy() + 2)
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.bilm.token_encoder.parameters()):
            needed, inverse = np.unique(rows, return_inverse=True)  # fine-tuning: the batch's words, with gradients
            token_embeddings = self.bilm.encode_words([self._vocabulary[row] for row in needed])[
                torch.from_numpy(inverse).to(device=module_device(self.bilm))]
        else:
            table = self._token_table()
            token_embeddings = table[torch.from_numpy(rows).to(table.device)]
        return run_carried(self.carried, len(lengths), lambda state: bilm_contextualize(
            self.bilm, token_embeddings, boundary_mask(lengths), state, self.carried is not None))


def boundary_rows(lengths: np.ndarray, token_rows: np.ndarray, bos_row: int = 0, eos_row: int = 1) -> np.ndarray:
    """Rows of an embedding table for every real position with boundaries, row-major:
    [bos, tokens of sentence 0, eos, bos, tokens of sentence 1, eos, ...]. (N,) int64."""
    sizes = lengths + 2
    rows = np.full(int(sizes.sum()), eos_row, dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    rows[starts] = bos_row
    inner = np.ones(rows.size, dtype=bool)
    inner[starts] = False
    inner[starts + sizes - 1] = False
    rows[inner] = token_rows
    return rows


def boundary_mask(lengths: torch.Tensor) -> torch.Tensor:
    n_positions = int(lengths.max()) + 2 if len(lengths) else 2
    return torch.arange(n_positions, device=lengths.device) < (lengths + 2).unsqueeze(1)  # (B, S)
