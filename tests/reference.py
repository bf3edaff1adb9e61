"""The biLM of spec §5-§7 in float64 numpy, one position at a time, from the TF-layout arrays of an
original weight file: the independent expectation every driver of the LSTM cell is checked against."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

from elmokit.model.chars import tokens_to_char_ids


def read_weights(path: Path) -> dict[str, np.ndarray]:
    """Every dataset of an original (bilm-tf) HDF5 weight file, by its path, in float64."""
    weights = {}
    with h5py.File(path) as file:
        file.visititems(lambda n, o: weights.__setitem__(n, o[...].astype(np.float64))
                        if isinstance(o, h5py.Dataset) else None)
    return weights


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def token_layer(weights: dict[str, np.ndarray], config, tokens: list[str]) -> np.ndarray:
    """(n+2, P): char CNN (relu), highway, projection of `<S>` tokens `</S>`."""
    ids = tokens_to_char_ids(["<S>", *tokens, "</S>"])
    table = np.concatenate([np.zeros((1, weights["char_embed"].shape[1])), weights["char_embed"]])
    reps = []
    for word in ids:
        chars = table[word]  # (50, E)
        pooled = []
        for i, (width, _) in enumerate(config.char_cnn.filters):
            kernel, bias = weights[f"CNN/W_cnn_{i}"][0], weights[f"CNN/b_cnn_{i}"]  # (w, E, n)
            conv = np.stack([np.einsum("we,wen->n", chars[t:t + width], kernel) for t in range(51 - width)])
            pooled.append(np.maximum((conv + bias).max(0), 0))
        x = np.concatenate(pooled)
        for k in range(config.char_cnn.n_highway):
            carry = sigmoid(x @ weights[f"CNN_high_{k}/W_carry"] + weights[f"CNN_high_{k}/b_carry"])
            transform = np.maximum(x @ weights[f"CNN_high_{k}/W_transform"] + weights[f"CNN_high_{k}/b_transform"], 0)
            x = carry * transform + (1 - carry) * x
        reps.append(x @ weights["CNN_proj/W_proj"] + weights["CNN_proj/b_proj"])
    return np.stack(reps)


def reference_bilm(weights: dict[str, np.ndarray], config, tokens: list[str], cell_clip: float, proj_clip: float,
                   drop: Callable[[np.ndarray], np.ndarray] | None = None, clipped: dict | None = None
                   ) -> list[np.ndarray]:
    """The L+1 layers (n+2, 2P) of one sentence from a zero state.

    TF's LSTMCell: z = [x, h] W + B split (i, j, f, o); c = clip(σ(f + 1) c + σ(i) tanh(j));
    h = clip((σ(o) tanh(c)) W_P) with proj_clip; a layer's input passes `drop` first (bilm-tf's
    DropoutWrapper, in training) and from layer 2 on the output adds that dropped input
    (ResidualWrapper). `clipped`, when given, counts the values each clip changed."""
    reps = token_layer(weights, config, tokens)
    layers = [np.concatenate([reps, reps], -1)]
    inputs = {0: reps, 1: reps[::-1]}
    size = config.lstm.cell_dim
    counts = {"cell": [0, 0], "projection": [0, 0]}  # [clipped, all]
    for layer in range(config.lstm.n_layers):
        outs = {}
        for d in (0, 1):
            prefix = f"RNN_{d}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"
            h, c, out = np.zeros(config.lstm.projection_dim), np.zeros(size), []
            for x in (drop(inputs[d]) if drop else inputs[d]):
                z = np.concatenate([x, h]) @ weights[f"{prefix}/W_0"] + weights[f"{prefix}/B"]
                i, j, f, o = z[:size], z[size:2 * size], z[2 * size:3 * size], z[3 * size:]
                c_raw = sigmoid(f + 1.0) * c + sigmoid(i) * np.tanh(j)
                c = np.clip(c_raw, -cell_clip, cell_clip) if cell_clip else c_raw
                h_raw = (sigmoid(o) * np.tanh(c)) @ weights[f"{prefix}/W_P_0"]
                h = np.clip(h_raw, -proj_clip, proj_clip) if proj_clip else h_raw
                counts["cell"][0] += int((c != c_raw).sum())
                counts["cell"][1] += c.size
                counts["projection"][0] += int((h != h_raw).sum())
                counts["projection"][1] += h.size
                out.append(h + x if layer > 0 else h)
            outs[d] = np.stack(out)
        layers.append(np.concatenate([outs[0], outs[1][::-1]], -1))
        inputs = outs
    if clipped is not None:
        for key, (hit, total) in counts.items():
            clipped.setdefault(key, [0, 0])
            clipped[key][0] += hit
            clipped[key][1] += total
    return layers
