"""The one definition of what a caller gets from a sentence's layers: the layer selection
(`all`, `top`, `average`) and the sentence vector.

Shape notation: L+1 output layers (the token layer, then one per LSTM layer), T tokens (no <S>
or </S>), D = 2P features (forward | backward), and any leading dimensions (a batch B).

    select_layers    (..., L+1, T, D) -> itself ("all"), the top layer (..., T, D) ("top"),
                     or the equal-weight layer average (..., T, D) ("average")
    token_mean       (..., T, D) -> (..., D): the mean over the real tokens; zeros for none
    sentence_vector  (..., L+1, T, D) -> (..., D): the mean over the tokens of the equal-weight
                     layer average (TF-Hub's `default` before training; `elmo embed
                     --sentence-vectors --output-format average`; `elmo serve`'s vectors)
    shape_output     what `elmo embed` stores for one sentence: `select_layers`, then with
                     `sentence_vectors` `token_mean`

Every function takes a numpy array or a torch tensor (on any device) and returns the same kind
with the input's dtype; nothing is copied to the host. `elmo embed` (inference/files.py), the
embedder (`ElmoEmbedder.sentence_vectors`), `HubElmo`'s `default` (and so `hub.Module`) call
them; the server's recurrence (serve/recurrence.py) sums its rings directly and is tested
against `sentence_vector`.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

Array = TypeVar("Array", np.ndarray, torch.Tensor)

OUTPUT_FORMATS = ("all", "top", "average")
LAYER_AXIS, TOKEN_AXIS = -3, -2  # of (..., L+1, T, D); a selected output (..., T, D) keeps TOKEN_AXIS


def check_output_format(output_format: str) -> None:
    """ValueError naming the choices unless `output_format` is one of `OUTPUT_FORMATS`."""
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"output format must be one of {', '.join(OUTPUT_FORMATS)}, got {output_format!r}")


def select_layers(layers: Array, output_format: str) -> Array:
    """(..., L+1, T, D) -> itself ("all"), the top layer (..., T, D) ("top"), or the equal-weight
    average of the L+1 layers (..., T, D) ("average")."""
    check_output_format(output_format)
    if output_format == "all":
        return layers
    if output_format == "top":
        return layers[..., -1, :, :]
    return layers.mean(LAYER_AXIS)


def token_mean(values: Array, lengths: Array | None = None) -> Array:
    """(..., T, D) -> (..., D): the mean over the tokens; zeros where there is no token.

    Without `lengths` every one of the T positions is a token. With `lengths` (...,) integers
    (a batch's sequence lengths), the mean over the first `lengths` positions of each row, whose
    positions past its length must be zero (as every padded output of elmokit is)."""
    summed = values.sum(TOKEN_AXIS)  # (..., D)
    if lengths is None:
        return summed / max(values.shape[TOKEN_AXIS], 1)
    counts = lengths.clip(min=1)[..., None]  # (..., 1)
    if isinstance(summed, torch.Tensor):
        return summed / counts.to(device=summed.device, dtype=summed.dtype)
    return summed / np.asarray(counts).astype(summed.dtype)


def sentence_vector(layers: Array, lengths: Array | None = None) -> Array:
    """(..., L+1, T, D) -> (..., D): the mean over the tokens of the equal-weight average of the
    layers; zeros for a sentence without tokens. `lengths` as for `token_mean`."""
    return token_mean(select_layers(layers, "average"), lengths)


def shape_output(layers: Array, output_format: str, sentence_vectors: bool) -> Array:
    """One sentence's layers (L+1, n, D) -> what `elmo embed` stores: (L+1, n, D) for "all",
    (n, D) for "top" and "average"; with `sentence_vectors` the token mean of that, (L+1, D) or
    (D,) (zeros for an empty sentence)."""
    selected = select_layers(layers, output_format)  # (L+1, n, D) or (n, D)
    return token_mean(selected) if sentence_vectors else selected
