"""Weight files: the original options JSON + HDF5 (bilm-tf's), and the native safetensors format.

    load_original(options_file, weight_file) -> BiLM     save_original(model, options, weights)
    load_pretrained(directory)               -> BiLM     save_pretrained(model, directory)
    load_model(path_or_paths)                -> BiLM     (either format, or the built-in model)

The original layout is TensorFlow's: matrices (in, out), LSTM gates (i, j, f, o), W_0 acting on
[x, h], a 261-row char table (a zero row for "no token" is prepended here). Nothing is unpickled:
HDF5 and safetensors hold plain arrays.

Why this file is long: each format's reader sits beside the checks that make an untrusted file
safe to read (links, storage, sizes before allocating); split, a reader would hold two files to
see what a hostile weight file can make the reader do.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import h5py
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from elmokit.model.config import ConfigError, ElmoConfig, ManyLangsConfig, read_options
from elmokit.model.errors import WeightFileError, check_finite
from elmokit.io import atomic_path, atomic_write_text
from elmokit.jsonfiles import JSONFileError, read_json
from elmokit.model.bilm import BiLM

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
PROVENANCE_NAME = "provenance.json"  # where the weights came from (`read_provenance`); optional


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


MAX_DEFLATE_RATIO = 1032  # the most a deflate (gzip) stream can expand: bounds a compressed dataset
# Real float weights compress little (float32 ~1.1x, float64 holding float32 values ~3x): a file whose
# datasets declare more than this many times its size, beyond a small allowance, is refused before
# any value is read (gzip chunks of zeros would otherwise expand 1000x in memory).
MAX_WEIGHTS_EXPANSION = 16
WEIGHTS_EXPANSION_ALLOWANCE = 16 * 2**20  # bytes: small models with zero biases stay well inside it


def _read_hdf5(path: Path, config: ElmoConfig, options_name: str) -> dict[str, np.ndarray]:
    """The float32 arrays of an original weight file, after checking, before any data is read,
    that every dataset is a plain float array stored in this file (no links, external storage
    or virtual datasets that would read other files) of the shape the options imply."""
    if not path.exists():
        raise FileNotFoundError(f"weight file not found: {path}")
    if path.is_dir():
        raise WeightFileError(f"{path}: is a directory, expected an HDF5 weight file")
    try:
        with h5py.File(path, "r") as file:
            datasets = _checked_datasets(path, file, config, options_name)
            with np.errstate(over="ignore"):  # a float64 beyond float32's range: inf, refused below
                arrays = {name: np.asarray(dataset[...], dtype=np.float32) for name, dataset in datasets.items()}
    except OSError as error:
        raise WeightFileError(f"{path}: not a readable HDF5 weight file ({error})") from error
    for name, array in arrays.items():
        check_finite(path, f"dataset {name!r}", array)
    return arrays


def check_weight_file(path: str | Path, config: ElmoConfig, options_name: str = "the options") -> None:
    """Raise WeightFileError unless `path` is an HDF5 file holding exactly the datasets (names,
    shapes, storage) that `config` implies; no value is read (a downloaded file's check)."""
    path = Path(path)
    try:
        with h5py.File(path, "r") as file:
            _checked_datasets(path, file, config, options_name)
    except OSError as error:
        raise WeightFileError(f"{path}: not a readable HDF5 weight file ({error})") from error


def _checked_datasets(path: Path, file: h5py.File, config: ElmoConfig, options_name: str
                      ) -> dict[str, h5py.Dataset]:
    """The datasets of an open weight file, in `expected_datasets` order, after checking names,
    shapes and storage against the options."""
    datasets = _hdf5_datasets(path, file)
    _check_layer_counts(config, len(datasets), f"the options in {options_name}", path)
    expected = expected_datasets(config)
    missing = sorted(set(expected) - set(datasets))
    extra = sorted(set(datasets) - set(expected))
    if missing or extra:
        raise WeightFileError(
            f"{path}: datasets do not match the options in {options_name}: "
            + (f"missing {missing}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"unexpected {extra}" if extra else "")
        )
    for name, shape in expected.items():
        if tuple(datasets[name].shape) != shape:
            raise WeightFileError(
                f"{path}: dataset {name!r} has shape {tuple(datasets[name].shape)}, but the options "
                f"in {options_name} imply {shape}"
            )
        _check_hdf5_storage(path, name, datasets[name])
    _check_expansion(path, sum(dataset.size * dataset.dtype.itemsize for dataset in datasets.values()))
    return {name: datasets[name] for name in expected}


def _check_expansion(path: Path, declared: int) -> None:
    """Refuse a file whose datasets declare far more bytes than compressed float weights can."""
    size = path.stat().st_size
    if declared > MAX_WEIGHTS_EXPANSION * size + WEIGHTS_EXPANSION_ALLOWANCE:
        raise WeightFileError(f"{path}: its datasets declare {declared:,} bytes in a file of {size:,}, more "
                              f"than {MAX_WEIGHTS_EXPANSION}x its size (+{WEIGHTS_EXPANSION_ALLOWANCE:,}) that "
                              "compressed float weights can hold: refused before reading (a decompression bomb)")


def _hdf5_datasets(path: Path, file: h5py.File) -> dict[str, h5py.Dataset]:
    """Every dataset reachable by hard links; a soft or external link (which could point into
    another file) is refused, not followed."""
    datasets: dict[str, h5py.Dataset] = {}
    groups: list[tuple[str, h5py.Group]] = [("", file)]

    def visit(name: str, obj) -> None:
        if isinstance(obj, h5py.Dataset):
            datasets[name] = obj
        elif isinstance(obj, h5py.Group):
            groups.append((name + "/", obj))

    file.visititems(visit)
    for prefix, group in groups:
        for name in group:
            link = group.get(name, getlink=True)
            if isinstance(link, (h5py.SoftLink, h5py.ExternalLink)):
                kind = "an external link" if isinstance(link, h5py.ExternalLink) else "a soft link"
                raise WeightFileError(f"{path}: {prefix + name!r} is {kind}; a weight file must hold its datasets itself")
    return datasets


def _check_hdf5_storage(path: Path, name: str, dataset: h5py.Dataset) -> None:
    """A float dataset whose data is in this file, and all of it: checked on the dataset's
    creation properties, without reading a value."""
    plist = dataset.id.get_create_plist()
    if dataset.is_virtual or plist.get_layout() == h5py.h5d.VIRTUAL:
        raise WeightFileError(f"{path}: dataset {name!r} is a virtual dataset (it maps other files); "
                              "a weight file must store its data itself")
    if plist.get_external_count() > 0:
        raise WeightFileError(f"{path}: dataset {name!r} uses external storage (its data is in another "
                              "file); a weight file must store its data itself")
    if dataset.dtype.kind != "f":
        raise WeightFileError(f"{path}: dataset {name!r} has dtype {dataset.dtype}, expected floating point")
    declared, stored = dataset.size * dataset.dtype.itemsize, dataset.id.get_storage_size()
    if stored == 0 or declared > MAX_DEFLATE_RATIO * stored:
        raise WeightFileError(f"{path}: dataset {name!r} declares {declared:,} bytes but stores only "
                              f"{stored:,}: its values are not in the file")


def _check_layer_counts(config: ElmoConfig, n_arrays: int, source: str, weight_file: Path) -> None:
    """Every filter bank, highway layer and LSTM layer has arrays of its own: a config asking for
    more of them than the weight file holds arrays is refused before anything is built from it."""
    cnn, lstm = config.char_cnn, config.lstm
    for what, count in (("char_cnn.filters", len(cnn.filters)), ("char_cnn.n_highway", cnn.n_highway),
                        ("lstm.n_layers", lstm.n_layers)):
        if count > n_arrays:
            raise WeightFileError(f"{source}: {what} asks for {count:,}, but {weight_file} holds only "
                                  f"{n_arrays} arrays")


def native_from_original(arrays: dict[str, np.ndarray], config: ElmoConfig) -> dict[str, torch.Tensor]:
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
    model.load_state_dict(native_from_original(arrays, config))
    return model.eval()


def refuse_same_file(paths: list[str | Path]) -> None:
    """ValueError naming the two paths if any two of `paths` name one file (the same path, a
    symlink to it, a hard link): writing one output would replace the other, silently."""
    seen: dict[object, Path] = {}
    for path in map(Path, paths):
        keys = [path.resolve()]
        if path.exists():
            status = path.stat()
            keys.append((status.st_dev, status.st_ino))
        for key in keys:
            if key in seen:
                raise ValueError(f"{seen[key]} and {path} are the same file: each output needs a path of "
                                 "its own (writing one would replace the other)")
        seen.update(dict.fromkeys(keys, path))


def save_original(model: BiLM, options_file: str | Path, weight_file: str | Path,
                  provenance: dict | None = None) -> None:
    """Write the model as an original options JSON + HDF5 file (what bilm-tf and AllenNLP load);
    `provenance`, where the weights came from, goes under the options' `elmokit_provenance` key
    (bilm-tf and AllenNLP ignore keys they do not use).

    Raises ConfigError, before writing anything, for a shape the original format cannot hold
    with one meaning (`ElmoConfig.check_original_format`), and ValueError if the two paths name
    one file (`refuse_same_file`)."""
    refuse_same_file([options_file, weight_file])
    options = model.config.to_options()
    if provenance is not None:
        options["elmokit_provenance"] = provenance
    arrays = _original_from_native(model)
    with atomic_path(weight_file) as tmp:
        # through a Python file object: a full disk is then an OSError, where HDF5's own driver
        # takes the process down (as elmokit.inference.segments writes its files)
        with open(tmp, "w+b") as handle, h5py.File(handle, "w") as file:
            for name in sorted(arrays):
                file.create_dataset(name, data=arrays[name])
    atomic_write_text(options_file, json.dumps(options, indent=2) + "\n")


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
        # One metadata key: safetensors writes the metadata from a hash map, so two keys come out in
        # either order and the same model would give files that differ byte for byte.
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    if hasattr(model, "save_vocabulary"):  # a model with a vocabulary of its own (ELMoForManyLangs)
        model.save_vocabulary(directory)
    model.config.save(directory / CONFIG_NAME)


FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # safetensors' names of the dtypes a weight may have


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor of a safetensors file, from its header alone
    (safetensors checks that the header's offsets tile the file, so these sizes are bounded by
    the file's own size). A tensor that is not floating point (int, bool) is refused."""
    try:
        with safe_open(str(path), framework="pt") as file:
            header = {name: (file.get_slice(name).get_dtype(), tuple(file.get_slice(name).get_shape()))
                      for name in file.keys()}
    except Exception as error:  # safetensors raises its own error types for corrupt headers
        raise WeightFileError(f"{path}: not a readable safetensors file ({error})") from error
    for name, (dtype, _) in header.items():
        if dtype not in FLOAT_DTYPES:
            raise WeightFileError(f"{path}: tensor {name!r} has dtype {dtype}, expected floating point "
                                  f"({', '.join(FLOAT_DTYPES)})")
    return header


def read_safetensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file whose names start with `prefix` (prefix removed);
    floating point and finite, or a WeightFileError naming the tensor."""
    tensors = _read_tensors(path, [name for name in safetensors_header(path) if name.startswith(prefix)])
    return {name[len(prefix):]: tensor for name, tensor in tensors.items()}


def _read_tensors(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt") as file:
            tensors = {name: file.get_tensor(name) for name in names}
    except Exception as error:
        raise WeightFileError(f"{path}: not a readable safetensors file ({error})") from error
    for name, tensor in tensors.items():
        check_finite(path, f"tensor {name!r}", tensor)
    return tensors


def read_provenance(directory: str | Path) -> dict:
    """The record of where a native folder's weights came from (its provenance.json: what trained
    or converted them, the software, the fingerprint), {} when the folder has none; a
    WeightFileError naming the file when it is not one JSON object."""
    path = Path(directory) / PROVENANCE_NAME
    if not path.is_file():
        return {}
    try:
        record = read_json(path)
    except (JSONFileError, OSError) as error:
        raise WeightFileError(f"{path}: not a readable provenance record ({error})") from None
    if not isinstance(record, dict):
        raise WeightFileError(f"{path}: not a provenance record (expected a JSON object, got {json.dumps(record)[:80]})")
    return record


def load_pretrained(directory: str | Path) -> BiLM:
    """Build a BiLM from a native model directory (`config.json` + `model.safetensors`).

    The config is checked against the safetensors header (names, shapes, dtypes) before anything
    is allocated, so its sizes are bounded by the file's own: a config that asks for more than the
    file holds is refused, never allocated."""
    directory = Path(directory)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory}: not an elmokit model directory (no {name}); elmokit.load_model "
                                    f"reads the other forms, a TF-Hub module folder, an ELMoForManyLangs folder, "
                                    f"a published name (docs/loading.md)")
    config = ElmoConfig.load(directory / CONFIG_NAME)
    build = _model_builder(config, directory)
    path = directory / WEIGHTS_NAME
    shapes = {name: shape for name, (_, shape) in safetensors_header(path).items() if not name.startswith("softmax.")}
    expected = _expected_tensors(config, len(shapes), directory / CONFIG_NAME, build)
    missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or extra:
        raise WeightFileError(f"{path}: tensors do not match {CONFIG_NAME}: missing {missing}, unexpected {extra}")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise WeightFileError(f"{path}: tensor {name!r} has shape {shapes[name]}, {CONFIG_NAME} implies {shape}")
    tensors = _read_tensors(path, list(expected))
    model = build(config)  # its sizes are now those of the file's tensors
    model.load_state_dict({name: t.float() for name, t in tensors.items()})  # fp16 storage -> fp32
    return model.eval()


def _model_builder(config: ElmoConfig, directory: Path) -> Callable[[ElmoConfig], BiLM]:
    """What builds the model of a native directory: `BiLM`, or for an ELMoForManyLangs model
    (a `ManyLangsConfig`) its class with the vocabulary saved beside the config."""
    if isinstance(config, ManyLangsConfig):
        from elmokit.model.manylangs import build_native

        return build_native(config, directory)
    return BiLM


def _expected_tensors(config: ElmoConfig, n_tensors: int, config_path: Path,
                      build: Callable[[ElmoConfig], BiLM] = BiLM) -> dict[str, tuple[int, ...]]:
    """name -> shape of a BiLM's state dict, from a skeleton on the meta device: nothing is
    allocated, and no more modules are built than the file has tensors."""
    _check_layer_counts(config, n_tensors, str(config_path), config_path.parent / WEIGHTS_NAME)
    try:
        with torch.device("meta"):
            return {name: tuple(t.shape) for name, t in build(config).state_dict().items()}
    except RuntimeError as error:  # sizes whose product overflows
        raise WeightFileError(f"{config_path}: sizes too large for any model ({error})") from None


def model_fingerprint(bilm) -> str:
    """A hash of a biLM's configuration and every weight (sha256, hex): what a task run and a
    partial embedding record to know later whether the model at a path is still the same one."""
    digest = hashlib.sha256(json.dumps(bilm.config.to_dict(), sort_keys=True).encode())
    for name, tensor in sorted(bilm.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()
