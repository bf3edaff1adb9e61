"""TF-Hub's ELMo module, called the way TF-Hub's users call it, in PyTorch.

    from elmokit import hub                                   # was: import tensorflow_hub as hub
    elmo = hub.Module("https://tfhub.dev/google/elmo/3", trainable=True)
    elmo(["the cat is on the mat", "dogs are in the fog"], signature="default", as_dict=True)["elmo"]
    elmo(inputs={"tokens": tokens, "sequence_len": lengths}, signature="tokens", as_dict=True)["elmo"]
    hub.load("https://tfhub.dev/google/elmo/3").signatures["default"](strings)["elmo"]   # TF2's way

A handle is a TF-Hub ELMo URL (google/elmo/1, 2 and 3 are the published `original` biLM:
`elmokit.sources.published`; a module TF-Hub already cached for it in $TFHUB_CACHE_DIR is used
first), a TF-Hub module folder or its `.tar.gz` (`elmokit.sources.tfhub`), a published name,
a URL pair (options, weights), a local model folder, or None for the built-in model. Outputs, as
TF-Hub's, with padding zero:

    word_emb (B, T, P)   lstm_outputs1, lstm_outputs2 (B, T, 2P)   elmo (B, T, 2P): the trainable
    mix, scaling * sum_j softmax(weights)_j h_j (a module's own `aggregation/weights` and
    `scaling` when loaded from its folder; else equal weights and 1)   default (B, 2P): the mean
    of `elmo` over the real tokens   sequence_len (B,)

`trainable=True` trains the 4 scalars of the mix (3 layer weights and gamma), as google/elmo/2
and 3 do; google/elmo/1 also trains the LSTM cells. Tensors are torch tensors.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from elmokit.devices import resolve_device
from elmokit.inference.elmo import check_char_ids, module_device, place_bilm, remove_boundaries
from elmokit.inference.engine import bilm_forward
from elmokit.inference.layers import token_mean
from elmokit.model.bilm import BiLM
from elmokit.model.chars import token_mask
from elmokit.model.mix import ScalarMix, scalar_mix
from elmokit.sources.loading import load_model, load_with_mix

SIGNATURES = ("default", "tokens")
OUTPUTS = ("word_emb", "lstm_outputs1", "lstm_outputs2", "elmo", "default", "sequence_len")


def load_handle(handle: str | tuple[str, str] | None) -> tuple[BiLM, tuple[list[float], float] | None]:
    """The biLM a handle names (see the module docstring), and a TF-Hub module's own `elmo` mix
    (None for any other handle)."""
    if isinstance(handle, (tuple, list)):
        if len(handle) != 2:
            raise ValueError(f"a handle pair is (options, weights), got {len(handle)} items")
        return load_model(*handle), None
    return load_with_mix(handle)


class HubElmo(nn.Module):
    """TF-Hub ELMo's outputs in one call: `word_emb` (B, T, P) token layer, `lstm_outputs1` and
    `lstm_outputs2` (B, T, 2P), `elmo` (B, T, 2P) a trainable mix of the three layers, `default`
    (B, 2P) the mean of `elmo` over real tokens (`layers.token_mean`; before training, when the
    mix is the equal-weight average, `layers.sentence_vector`), and `sequence_len` (B,). Padding is zero.

    Call with a list of token lists or with char ids (B, T, 50) (moved to the module's device).
    `device`, `dtype` and `threads` as for `Elmo`; `mix` the `elmo` output's starting (weights, scaling)
    (`elmokit.sources.tfhub.module_mix`; default equal weights and 1).
    """

    def __init__(self, options_file: str | Path | None = None, weight_file: str | Path | None = None,
                 module: BiLM | None = None, trainable: bool = False, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, mix: tuple[list[float], float] | None = None,
                 threads: int | None = None):
        super().__init__()
        self.bilm = module if module is not None else load_model(options_file, weight_file)
        self.bilm = place_bilm(self.bilm, resolve_device(device), dtype, trainable, False, "HubElmo", threads)
        self.bilm.requires_grad_(trainable)
        weights, scaling = mix if mix is not None else (None, 1.0)
        self.mix = ScalarMix(self.bilm.config.n_output_layers, initial_scalar_parameters=weights,
                             initial_gamma=scaling).to(module_device(self.bilm))

    def forward(self, sentences: Sequence[Sequence[str]] | torch.Tensor,
                mix: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The outputs; `mix` (scalar parameters (L+1,), gamma ()) in place of the module's own
        (`elmokit.integrations.keras` keeps them as Keras variables)."""
        char_ids = sentences if isinstance(sentences, torch.Tensor) else self.bilm.batch_ids(sentences)
        check_char_ids(self.bilm, char_ids, "HubElmo")
        char_ids = char_ids.to(module_device(self.bilm))
        if char_ids.shape[0] == 0:  # no sentence: nothing to run (as Elmo)
            return self._empty_output(char_ids.shape[1], char_ids.device)
        output = bilm_forward(self.bilm, char_ids)
        layers = [remove_boundaries(layer, output.mask)[0] for layer in output.layers]
        mask = token_mask(char_ids)  # (B, T)
        mixed = self.mix(output.layers, output.mask) if mix is None else scalar_mix(output.layers, *mix)
        elmo = remove_boundaries(mixed, output.mask)[0]
        lengths = mask.sum(dim=1)
        outputs = {"word_emb": layers[0][..., :self.bilm.config.lstm.projection_dim]}
        outputs.update({f"lstm_outputs{k}": layer for k, layer in enumerate(layers[1:], start=1)})
        outputs["elmo"] = elmo
        outputs["default"] = token_mean(elmo, lengths)  # (B, 2P)
        outputs["sequence_len"] = lengths
        return outputs

    def _empty_output(self, n_tokens: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Every output of a batch without sentences: (0, T, ...) tensors, `sequence_len` (0,)."""
        dims = {"word_emb": self.bilm.config.lstm.projection_dim,
                **{f"lstm_outputs{k}": self.bilm.output_dim for k in range(1, self.bilm.config.n_output_layers)},
                "elmo": self.bilm.output_dim}
        outputs = {name: torch.zeros(0, n_tokens, dim, device=device) for name, dim in dims.items()}
        outputs["default"] = torch.zeros(0, self.bilm.output_dim, device=device)
        outputs["sequence_len"] = torch.zeros(0, dtype=torch.long, device=device)
        return outputs


class Module(nn.Module):
    """`hub.Module(handle, trainable=False)`: call it with `signature="default"` (untokenized
    strings, split on spaces) or `signature="tokens"` (`inputs={"tokens": (B, T) strings with ""
    padding, "sequence_len": (B,)}`); `as_dict=True` gives every output, else `default`.
    `device`, `dtype` and `threads` as for `Elmo`."""

    def __init__(self, handle: str | tuple[str, str] | None = None, trainable: bool = False, *,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 threads: int | None = None):
        super().__init__()
        self.handle = handle
        train_lstm = trainable and isinstance(handle, str) and handle.rstrip("/").endswith("google/elmo/1")
        bilm, mix = load_handle(handle)
        self.elmo = HubElmo(module=bilm, trainable=train_lstm, device=device, dtype=dtype, mix=mix, threads=threads)
        self.elmo.mix.requires_grad_(trainable)
        if train_lstm:  # google/elmo/1 trains "all variables of the LSTM cells", not the char CNN
            self.elmo.bilm.token_encoder.requires_grad_(False)

    def forward(self, inputs=None, signature: str = "default", as_dict: bool = False,
                **kwargs) -> torch.Tensor | dict[str, torch.Tensor]:
        if inputs is None and kwargs:  # TF2's keyword form: tokens=..., sequence_len=...
            inputs = kwargs
        sentences, width = _sentences(inputs, signature)
        outputs = self.elmo(sentences)
        if width is not None:
            outputs = _pad_to(outputs, width)
        return dict(outputs) if as_dict else outputs["default"]

    @property
    def signatures(self) -> dict:
        """TF2's `signatures`: "default" (strings) and "tokens" (tokens=..., sequence_len=...), each
        returning the dict of outputs; methods of this module, so that a copy's (`copy.deepcopy`,
        `torch.save`) run the copy."""
        return {"default": self._default_signature, "tokens": self._tokens_signature}

    def _default_signature(self, strings) -> dict[str, torch.Tensor]:
        return self(strings, signature="default", as_dict=True)

    def _tokens_signature(self, tokens, sequence_len) -> dict[str, torch.Tensor]:
        return self({"tokens": tokens, "sequence_len": sequence_len}, signature="tokens", as_dict=True)

    def get_signature_names(self) -> list[str]:
        return list(SIGNATURES)

    def get_output_info_dict(self, signature: str = "default") -> dict[str, tuple[int | None, ...]]:
        """Each output's shape, None for the batch and token dimensions (TF-Hub's method)."""
        _check_signature(signature)
        projection, output_dim = self.elmo.bilm.config.lstm.projection_dim, self.elmo.bilm.output_dim
        return {"word_emb": (None, None, projection), "lstm_outputs1": (None, None, output_dim),
                "lstm_outputs2": (None, None, output_dim), "elmo": (None, None, output_dim),
                "default": (None, output_dim), "sequence_len": (None,)}

    def __repr__(self) -> str:
        config = self.elmo.bilm.config
        return (f"hub.Module({self.handle!r}, {config.lstm.n_layers} x {config.lstm.cell_dim} cells -> "
                f"{config.lstm.projection_dim}, outputs {self.elmo.bilm.output_dim}-dim)")


def load(handle: str | tuple[str, str] | None = None, trainable: bool = False, **kwargs) -> Module:
    """TF2's `hub.load(handle)`: the module, whose `signatures["default"](strings)` and
    `signatures["tokens"](tokens=..., sequence_len=...)` return the dict of outputs."""
    return Module(handle, trainable, **kwargs)


# ---------------------------------------------------------------------------------------------
# Inputs as TF-Hub takes them
# ---------------------------------------------------------------------------------------------
def _check_signature(signature: str) -> None:
    if signature not in SIGNATURES:
        raise ValueError(f"signature must be one of {', '.join(SIGNATURES)}, got {signature!r}")


def _text(value) -> str:
    """A token or sentence as TF-Hub's string tensors hold it: str, or UTF-8 bytes."""
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _check_strings(values, name: str) -> None:
    """TypeError naming the first entry of `values` that is not a str or bytes (np.str_ and
    np.bytes_ are): None, a number or a list would otherwise be read as its repr."""
    if not all(map(isinstance, values, itertools.repeat((str, bytes)))):
        index, bad = next((i, v) for i, v in enumerate(values) if not isinstance(v, (str, bytes)))
        raise TypeError(f"{name}[{index}] is {bad!r} ({type(bad).__name__}): expected a string")


def _sentences(inputs, signature: str) -> tuple[list[list[str]], int | None]:
    """Token lists from a signature's inputs, and the width the outputs keep (the `tokens` input's
    T, else None: the longest sentence)."""
    _check_signature(signature)
    if signature == "default":
        if isinstance(inputs, (str, bytes)) or not isinstance(inputs, (Sequence, np.ndarray)):
            raise TypeError(f"signature 'default' takes a list of strings (B,), got {type(inputs).__name__}")
        _check_strings(inputs, "inputs")
        return [[token for token in _text(text).split(" ") if token] for text in inputs], None
    if not isinstance(inputs, Mapping) or set(inputs) != {"tokens", "sequence_len"}:
        raise TypeError("signature 'tokens' takes inputs={'tokens': (B, T) strings, 'sequence_len': (B,) ints}, "
                        f"got {type(inputs).__name__}" + (f" with keys {sorted(inputs)}" if isinstance(inputs, Mapping) else ""))
    tokens, lengths = inputs["tokens"], np.asarray(inputs["sequence_len"]).reshape(-1)
    if len(tokens) != len(lengths):
        raise ValueError(f"tokens has {len(tokens)} rows but sequence_len {len(lengths)}")
    if len(lengths) and not np.issubdtype(lengths.dtype, np.integer):  # 2.0 or True is not a count
        raise TypeError(f"sequence_len must hold integers (token counts), got {lengths.dtype} values "
                        f"{lengths.tolist()[:5]}")
    width = max((len(row) for row in tokens), default=0)
    for index, (row, length) in enumerate(zip(tokens, lengths.tolist())):
        if not 0 <= length <= len(row):
            raise ValueError(f"sequence_len[{index}] = {length}, but tokens[{index}] has {len(row)} entries")
        _check_strings(row[:length], f"tokens[{index}]")
    return [[_text(token) for token in row[:length]] for row, length in zip(tokens, lengths.tolist())], width


def _pad_to(outputs: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """Token outputs (B, T', D) zero-padded to the `tokens` input's width T >= T'."""
    padded = {}
    for name, value in outputs.items():
        if value.dim() == 3 and value.shape[1] < width:
            value = torch.cat([value, value.new_zeros(value.shape[0], width - value.shape[1], value.shape[2])], 1)
        padded[name] = value
    return padded

