"""Weight files: the original options JSON + HDF5 (spec §2), and the native safetensors format.

    load_original(options_file, weight_file) -> BiLM     save_original(model, options, weights)
    load_pretrained(directory)               -> BiLM     save_pretrained(model, directory)
    load_model(path_or_paths)                -> BiLM     (either format, or the built-in model)

The original layout is TensorFlow's: matrices (in, out), LSTM gates (i, j, f, o), W_0 acting on
[x, h], a 261-row char table (a zero row for "no token" is prepended here). Nothing is unpickled:
HDF5 and safetensors hold plain arrays.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from elmokit.config import ConfigError, ElmoConfig, read_options
from elmokit.io import atomic_path, atomic_write_text
from elmokit.model import BiLM

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class WeightFileError(ValueError):
    """A weight file is missing, unreadable, or does not match its options."""


# ---------------------------------------------------------------------------------------------
# Gate order: TF stores (i, j, f, o); elmokit computes (i, f, o, j).
# ---------------------------------------------------------------------------------------------
_TF_TO_NATIVE = (0, 2, 3, 1)  # native block k comes from TF block _TF_TO_NATIVE[k]
_NATIVE_TO_TF = (0, 3, 1, 2)


def _permute_gates(array: np.ndarray, order: tuple[int, ...]) -> np.ndarray:
    blocks = np.split(array, 4, axis=-1)
    return np.concatenate([blocks[k] for k in order], axis=-1)


def _lstm_prefix(direction: int, layer: int) -> str:
    return f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"


# ---------------------------------------------------------------------------------------------
# Original format: HDF5 datasets <-> native tensors
# ---------------------------------------------------------------------------------------------
def expected_datasets(config: ElmoConfig) -> dict[str, tuple[int, ...]]:
    """Every dataset an original weight file of this shape holds, with its shape."""
    cnn, lstm = config.char_cnn, config.lstm
    n_filters, proj, cell = cnn.n_filters, lstm.projection_dim, lstm.cell_dim
    shapes: dict[str, tuple[int, ...]] = {"char_embed": (261, cnn.embedding_dim)}
    for i, (width, count) in enumerate(cnn.filters):
        shapes[f"CNN/W_cnn_{i}"] = (1, width, cnn.embedding_dim, count)
        shapes[f"CNN/b_cnn_{i}"] = (count,)
    for k in range(cnn.n_highway):
        for part in ("carry", "transform"):
            shapes[f"CNN_high_{k}/W_{part}"] = (n_filters, n_filters)
            shapes[f"CNN_high_{k}/b_{part}"] = (n_filters,)
    shapes["CNN_proj/W_proj"] = (n_filters, proj)
    shapes["CNN_proj/b_proj"] = (proj,)
    for direction in range(2):
        for layer in range(lstm.n_layers):
            prefix = _lstm_prefix(direction, layer)
            shapes[f"{prefix}/W_0"] = (2 * proj, 4 * cell)
            shapes[f"{prefix}/B"] = (4 * cell,)
            shapes[f"{prefix}/W_P_0"] = (cell, proj)
    return shapes


def _read_hdf5(path: Path, config: ElmoConfig, options_name: str) -> dict[str, np.ndarray]:
    if not path.exists():
        raise FileNotFoundError(f"weight file not found: {path}")
    if path.is_dir():
        raise WeightFileError(f"{path}: is a directory, expected an HDF5 weight file")
    expected = expected_datasets(config)
    try:
        with h5py.File(path, "r") as file:
            found: dict[str, tuple[int, ...]] = {}
            file.visititems(lambda name, obj: found.__setitem__(name, obj.shape)
                            if isinstance(obj, h5py.Dataset) else None)
            missing = sorted(set(expected) - set(found))
            extra = sorted(set(found) - set(expected))
            if missing or extra:
                raise WeightFileError(
                    f"{path}: datasets do not match the options in {options_name}: "
                    + (f"missing {missing}" if missing else "")
                    + ("; " if missing and extra else "")
                    + (f"unexpected {extra}" if extra else "")
                )
            for name, shape in expected.items():
                if tuple(found[name]) != shape:
                    raise WeightFileError(
                        f"{path}: dataset {name!r} has shape {tuple(found[name])}, but the options "
                        f"in {options_name} imply {shape}"
                    )
            return {name: np.asarray(file[name][...], dtype=np.float32) for name in expected}
    except OSError as error:
        raise WeightFileError(f"{path}: not a readable HDF5 weight file ({error})") from error


def _native_from_original(arrays: dict[str, np.ndarray], config: ElmoConfig) -> dict[str, torch.Tensor]:
    cnn = config.char_cnn
    state: dict[str, np.ndarray] = {}
    table = arrays["char_embed"]
    state["token_encoder.char_cnn.char_embedding.weight"] = np.concatenate(
        [np.zeros((1, table.shape[1]), np.float32), table])  # shifted ids: row 0 = no token
    for i in range(len(cnn.filters)):
        prefix = f"token_encoder.char_cnn.convolutions.{i}"
        state[f"{prefix}.weight"] = arrays[f"CNN/W_cnn_{i}"][0].transpose(2, 1, 0)  # (n, E, w)
        state[f"{prefix}.bias"] = arrays[f"CNN/b_cnn_{i}"]
    for k in range(cnn.n_highway):
        prefix = f"token_encoder.highway.layers.{k}"
        state[f"{prefix}.weight"] = np.concatenate(
            [arrays[f"CNN_high_{k}/W_transform"].T, arrays[f"CNN_high_{k}/W_carry"].T])
        state[f"{prefix}.bias"] = np.concatenate(
            [arrays[f"CNN_high_{k}/b_transform"], arrays[f"CNN_high_{k}/b_carry"]])
    state["token_encoder.projection.weight"] = arrays["CNN_proj/W_proj"].T
    state["token_encoder.projection.bias"] = arrays["CNN_proj/b_proj"]
    proj = config.lstm.projection_dim
    for layer in range(config.lstm.n_layers):
        per_direction = [
            {key: arrays[f"{_lstm_prefix(d, layer)}/{key}"] for key in ("W_0", "B", "W_P_0")}
            for d in range(2)
        ]
        prefix = f"lstm.layers.{layer}"
        state[f"{prefix}.input_weight"] = np.stack(  # (D, 4C, P): native weights are (out, in)
            [_permute_gates(w["W_0"][:proj], _TF_TO_NATIVE).T for w in per_direction])
        state[f"{prefix}.recurrent_weight"] = np.stack(
            [_permute_gates(w["W_0"][proj:], _TF_TO_NATIVE).T for w in per_direction])
        state[f"{prefix}.bias"] = np.stack(
            [_permute_gates(w["B"], _TF_TO_NATIVE)[None] for w in per_direction])
        state[f"{prefix}.projection"] = np.stack([w["W_P_0"].T for w in per_direction])
    return {name: torch.from_numpy(np.ascontiguousarray(value)) for name, value in state.items()}


def _original_from_native(model: BiLM) -> dict[str, np.ndarray]:
    config = model.config
    state = {name: tensor.detach().cpu().float().numpy() for name, tensor in model.state_dict().items()}
    arrays: dict[str, np.ndarray] = {"char_embed": state["token_encoder.char_cnn.char_embedding.weight"][1:]}
    for i in range(len(config.char_cnn.filters)):
        prefix = f"token_encoder.char_cnn.convolutions.{i}"
        arrays[f"CNN/W_cnn_{i}"] = state[f"{prefix}.weight"].transpose(2, 1, 0)[None]
        arrays[f"CNN/b_cnn_{i}"] = state[f"{prefix}.bias"]
    n_filters = config.char_cnn.n_filters
    for k in range(config.char_cnn.n_highway):
        weight, bias = (state[f"token_encoder.highway.layers.{k}.{p}"] for p in ("weight", "bias"))
        arrays[f"CNN_high_{k}/W_transform"] = weight[:n_filters].T
        arrays[f"CNN_high_{k}/W_carry"] = weight[n_filters:].T
        arrays[f"CNN_high_{k}/b_transform"] = bias[:n_filters]
        arrays[f"CNN_high_{k}/b_carry"] = bias[n_filters:]
    arrays["CNN_proj/W_proj"] = state["token_encoder.projection.weight"].T
    arrays["CNN_proj/b_proj"] = state["token_encoder.projection.bias"]
    for layer in range(config.lstm.n_layers):
        prefix = f"lstm.layers.{layer}"
        for d in range(2):
            original = _lstm_prefix(d, layer)
            arrays[f"{original}/W_0"] = _permute_gates(np.concatenate(
                [state[f"{prefix}.input_weight"][d].T, state[f"{prefix}.recurrent_weight"][d].T]), _NATIVE_TO_TF)
            arrays[f"{original}/B"] = _permute_gates(state[f"{prefix}.bias"][d, 0], _NATIVE_TO_TF)
            arrays[f"{original}/W_P_0"] = state[f"{prefix}.projection"][d].T
    return {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in arrays.items()}


def load_original(options_file: str | Path, weight_file: str | Path) -> BiLM:
    """Build a BiLM from an original options JSON and HDF5 weight file (bilm-tf / AllenNLP)."""
    config = read_options(options_file)
    arrays = _read_hdf5(Path(weight_file), config, str(options_file))
    model = BiLM(config)
    model.load_state_dict(_native_from_original(arrays, config))
    return model.eval()


def save_original(model: BiLM, options_file: str | Path, weight_file: str | Path) -> None:
    """Write the model as an original options JSON + HDF5 file (what bilm-tf and AllenNLP load)."""
    arrays = _original_from_native(model)
    with atomic_path(weight_file) as tmp:
        with h5py.File(tmp, "w") as file:
            for name in sorted(arrays):
                file.create_dataset(name, data=arrays[name])
    atomic_write_text(options_file, json.dumps(model.config.to_options(), indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Native format: config.json + model.safetensors
# ---------------------------------------------------------------------------------------------
def save_pretrained(model: BiLM, directory: str | Path, extra_tensors: dict[str, torch.Tensor] | None = None,
                    dtype: torch.dtype | None = None) -> None:
    """Write `config.json` and `model.safetensors` (the biLM, plus `extra_tensors` if given,
    e.g. the training softmax under `softmax.`). `dtype` (e.g. torch.float16) stores the
    floating-point tensors at that precision; loading always gives float32."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {**model.state_dict(), **(extra_tensors or {})}
    tensors = {name: (t.to(dtype) if dtype is not None and t.is_floating_point() else t).detach().cpu().contiguous()
               for name, t in tensors.items()}
    with atomic_path(directory / WEIGHTS_NAME) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt", "library": "elmokit"})
    model.config.save(directory / CONFIG_NAME)


def read_safetensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file whose names start with `prefix` (prefix removed)."""
    try:
        with safe_open(str(path), framework="pt") as file:
            return {name[len(prefix):]: file.get_tensor(name) for name in file.keys() if name.startswith(prefix)}
    except Exception as error:  # safetensors raises its own error types for corrupt headers
        raise WeightFileError(f"{path}: not a readable safetensors file ({error})") from error


def load_pretrained(directory: str | Path) -> BiLM:
    """Build a BiLM from a native model directory (`config.json` + `model.safetensors`)."""
    directory = Path(directory)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory}: not an elmokit model directory (no {name})")
    config = ElmoConfig.load(directory / CONFIG_NAME)
    model = BiLM(config)
    tensors = {name: t for name, t in read_safetensors(directory / WEIGHTS_NAME).items()
               if not name.startswith("softmax.")}
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise WeightFileError(f"{directory / WEIGHTS_NAME}: tensors do not match {CONFIG_NAME}: "
                              f"missing {missing}, unexpected {extra}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise WeightFileError(f"{directory / WEIGHTS_NAME}: tensor {name!r} has shape "
                                  f"{tuple(tensors[name].shape)}, {CONFIG_NAME} implies {shape}")
    model.load_state_dict({name: t.float() for name, t in tensors.items()})  # fp16 storage -> fp32
    return model.eval()


def load_model(options_or_directory: str | Path | None = None, weight_file: str | Path | None = None) -> BiLM:
    """Load a biLM from whichever form it comes in.

    * `(options_file, weight_file)`: the original JSON + HDF5 pair;
    * `directory`: a native model directory;
    * nothing: the built-in English model shipped with elmokit.
    """
    if options_or_directory is None:
        from elmokit.builtin import builtin_model_dir

        return load_pretrained(builtin_model_dir())
    path = Path(options_or_directory)
    if weight_file is not None:
        return load_original(path, weight_file)
    if path.is_dir():
        return load_pretrained(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path} (give a model directory, or an options "
                                "JSON file and an HDF5 weight file)")
    raise ConfigError(f"{path}: an options file needs its weight file; give both, or a model directory")
