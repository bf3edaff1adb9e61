"""The files of an ELMoForManyLangs model folder, read safely (`elmokit.model.manylangs` builds
the model from them): their `config.json` and model config, `char.dic` / `word.dic`, and the two
`torch.save` pickles, `token_embedder.pkl` and `encoder.pkl`, of which only tensors are unpickled
(`torch.load(..., weights_only=True)`). `native_state` maps their state dicts to elmokit's names
and conventions (the highway gate negated, the LSTM gates reordered, the forget bias moved to run
time; `elmokit.model.manylangs` says why each).
"""

from __future__ import annotations

import itertools
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from elmokit.model.config import MAX_MANYLANGS_CHARACTERS, CharCNNConfig, ConfigError, LSTMConfig, ManyLangsConfig
from elmokit.model.config import _read_json as read_json_object
from elmokit.model.errors import WeightFileError, check_finite
from elmokit.model.lstm import BiLstmLayer

PICKLES = ("token_embedder.pkl", "encoder.pkl")

# The model configs their package ships (elmoformanylangs/configs/, both files the same): a
# published model's config.json names one of them, often by a path that is not in its folder.
_PUBLISHED_CONFIG = {
    "encoder": {"name": "elmo", "projection_dim": 512, "cell_clip": 3, "proj_clip": 3, "dim": 4096, "n_layers": 2},
    "token_embedder": {"name": "cnn", "activation": "relu", "filters": [[1, 32], [2, 32], [3, 64], [4, 128],
                                                                        [5, 256], [6, 512], [7, 1024]],
                       "n_highway": 2, "word_dim": 100, "char_dim": 50, "max_characters_per_token": 50},
}
KNOWN_CONFIGS = {"cnn_50_100_512_4096_sample.json": _PUBLISHED_CONFIG, "cnn_0_100_512_4096_sample.json": _PUBLISHED_CONFIG}


def read_dictionary(path: Path) -> dict[str, int]:
    """Their char.dic / word.dic reading: each line stripped of surrounding whitespace and split on
    tabs; a line left with one field is the id of the entry "\\u3000" (a whitespace character that
    the strip removed). Lines break where Python's str.splitlines breaks them, as their codecs reader
    does. A later line for the same entry wins."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (an ELMoForManyLangs model folder holds it)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 ({error})") from None
    table: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.strip().split("\t")
        if len(fields) == 1:
            fields.insert(0, "\u3000")
        try:
            entry, index = fields[0], int(fields[-1])  # int() as theirs: " 5" and "٥" are ids too
        except ValueError:
            index = -1
        if len(fields) != 2 or index < 0:
            raise ConfigError(f"{path}:{number}: expected 'entry<TAB>id' with an id >= 0, got {line!r:.80}")
        table[entry] = index
    return table


def read_model_config(directory: Path) -> dict[str, Any]:
    """Their model config, found as their Embedder finds it: `config_path` of config.json relative
    to the folder, else its file name in the folder, else one of the configs their package ships."""
    options = read_json_object(directory / "config.json")
    name = options.get("config_path")
    if not isinstance(name, str):
        raise ConfigError(f"{directory / 'config.json'}: no \"config_path\" naming the model config")
    for candidate in (directory / name, directory / Path(name).name):
        if candidate.is_file():
            config, source = read_json_object(candidate), candidate
            break
    else:
        if Path(name).name not in KNOWN_CONFIGS:
            raise FileNotFoundError(f"{directory / 'config.json'}: config_path {name!r} is neither in the folder nor "
                                    f"one of ELMoForManyLangs' own configs ({', '.join(KNOWN_CONFIGS)})")
        config, source = KNOWN_CONFIGS[Path(name).name], Path(name).name
    _check_model_config(config, source)
    return config


def _check_model_config(config: dict[str, Any], source: Path | str) -> None:
    sections = {key: config.get(key) for key in ("encoder", "token_embedder")}
    for key, section in sections.items():
        if not isinstance(section, dict):
            raise ConfigError(f"{source}: missing section {key!r}")
    encoder, tokens = sections["encoder"], sections["token_embedder"]
    if str(encoder.get("name", "")).lower() != "elmo" or str(tokens.get("name", "")).lower() != "cnn":
        raise ConfigError(f"{source}: encoder {encoder.get('name')!r} with token_embedder {tokens.get('name')!r}: "
                          "elmokit reads their ELMo models (encoder \"elmo\", token_embedder \"cnn\", as every "
                          "published one), not their plain-LSTM variants")
    for key in ("projection_dim", "dim", "n_layers"):
        _require_int(encoder, key, source, "encoder", 1)
    for key, least in (("char_dim", 1), ("word_dim", 0), ("n_highway", 0)):
        _require_int(tokens, key, source, "token_embedder", least)
    # the one size no weight's shape bounds (ManyLangsConfig bounds it likewise in a native folder)
    _require_int(tokens, "max_characters_per_token", source, "token_embedder", 3, MAX_MANYLANGS_CHARACTERS)


def _require_int(section: dict, key: str, source, where: str, least: int, most: int | None = None) -> None:
    value = section.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < least or (most is not None and value > most):
        expected = f"an int >= {least}" if most is None else f"an int in {least}..{most}"
        raise ConfigError(f"{source}: {where}.{key} must be {expected}, got {value!r}")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A `torch.save`d state dict, unpickling nothing but tensors (`weights_only=True`): a pickle
    holding any other object is refused before that object is built."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (an ELMoForManyLangs model folder holds it)")
    try:
        with warnings.catch_warnings():  # torch's warnings (a pickle protocol it did not write) are not ours
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise WeightFileError(f"{path}: refused: it holds something other than tensors{_refused_detail(error)}, "
                              "and elmokit unpickles nothing else") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as error:
        reason = " ".join(_ANSI.sub("", str(error)).split())  # the legacy loader on text raises KeyError '101'
        raise WeightFileError(f"{path}: not a readable torch state dict ({type(error).__name__}"
                              f"{': ' if reason else ''}{reason:.200})") from None
    if not isinstance(state, dict) or not all(isinstance(key, str) and isinstance(value, torch.Tensor)
                                              for key, value in state.items()):
        raise WeightFileError(f"{path}: expected a state dict (names -> tensors), got {type(state).__name__}")
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            raise WeightFileError(f"{path}: tensor {name!r} has dtype {tensor.dtype}, expected floating point")
        check_finite(path, f"tensor {name!r}", tensor)
    return {name: tensor.float() for name, tensor in state.items()}


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _refused_detail(error: pickle.UnpicklingError) -> str:
    """What torch's safe unpickler stopped at (\" (it names posix.system)\"), on one line, without
    its advice to load the file unsafely (`weights_only=False`) or its terminal colour codes."""
    text = _ANSI.sub("", str(error))
    named = re.search(r"GLOBAL ([\w.]+)", text)
    if named:
        return f" (it names {named.group(1)})"
    opcode = re.search(r"Unsupported operand (\d+)", text)
    return f" (pickle opcode {opcode.group(1)}, which torch's tensor-only unpickler does not take)" if opcode else ""


def config_from(model_config: dict, token_state: dict[str, torch.Tensor], directory: Path) -> ManyLangsConfig:
    """Their model config as a `ManyLangsConfig`; the table sizes come from the weights."""
    encoder, tokens = model_config["encoder"], model_config["token_embedder"]
    sizes = {"char": token_state.get("char_emb_layer.embedding.weight"),
             "word": token_state.get("word_emb_layer.embedding.weight")}
    if sizes["char"] is None or sizes["char"].dim() != 2:
        raise WeightFileError(f"{directory / PICKLES[0]}: no 2-d char_emb_layer.embedding.weight")
    if tokens["word_dim"] > 0 and (sizes["word"] is None or sizes["word"].dim() != 2):
        raise WeightFileError(f"{directory / PICKLES[0]}: word_dim is {tokens['word_dim']} but there is no 2-d "
                              "word_emb_layer.embedding.weight")
    try:
        return ManyLangsConfig(
            char_cnn=CharCNNConfig(embedding_dim=tokens["char_dim"], filters=tokens.get("filters"),
                                   n_highway=tokens["n_highway"], activation=tokens.get("activation", "relu")),
            lstm=LSTMConfig(cell_dim=encoder["dim"], projection_dim=encoder["projection_dim"],
                            n_layers=encoder["n_layers"], cell_clip=encoder.get("cell_clip") or 0.0,
                            proj_clip=encoder.get("proj_clip") or 0.0),
            n_char_ids=len(sizes["char"]), max_characters_per_token=tokens["max_characters_per_token"],
            word_dim=tokens["word_dim"], n_word_ids=len(sizes["word"]) if tokens["word_dim"] > 0 else 0)
    except ConfigError as error:
        raise ConfigError(f"{directory}: {error}") from None


def native_state(config: ManyLangsConfig, token_state: dict[str, torch.Tensor],
                  encoder_state: dict[str, torch.Tensor], directory: Path) -> dict[str, torch.Tensor]:
    """Their two state dicts as `ManyLangsBiLM`'s, after checking every count, name and shape."""
    _check_counts(config, token_state, encoder_state, directory)
    cnn, n_filters = config.char_cnn, config.char_cnn.n_filters
    proj, cell = config.lstm.projection_dim, config.lstm.cell_dim
    expected_tokens = {"char_emb_layer.embedding.weight": (config.n_char_ids, cnn.embedding_dim),
                       "projection.weight": (proj, config.word_dim + n_filters), "projection.bias": (proj,)}
    if config.word_dim:
        expected_tokens["word_emb_layer.embedding.weight"] = (config.n_word_ids, config.word_dim)
    for i, (width, count) in enumerate(cnn.filters):
        expected_tokens |= {f"convolutions.{i}.weight": (count, cnn.embedding_dim, width),
                            f"convolutions.{i}.bias": (count,)}
    for k in range(cnn.n_highway):
        expected_tokens |= {f"highways._layers.{k}.weight": (2 * n_filters, n_filters),
                            f"highways._layers.{k}.bias": (2 * n_filters,)}
    expected_encoder = {}
    for layer, direction in itertools.product(range(config.lstm.n_layers), ("forward", "backward")):
        prefix = f"{direction}_layer_{layer}"
        expected_encoder |= {f"{prefix}.input_linearity.weight": (4 * cell, proj),
                             f"{prefix}.state_linearity.weight": (4 * cell, proj),
                             f"{prefix}.state_linearity.bias": (4 * cell,),
                             f"{prefix}.state_projection.weight": (proj, cell)}
    for name, state, expected in ((PICKLES[0], token_state, expected_tokens), (PICKLES[1], encoder_state, expected_encoder)):
        _check_shapes(directory / name, state, expected)

    state = {"token_encoder.char_cnn.char_embedding.weight": _with_zero_row(token_state["char_emb_layer.embedding.weight"]),
             "token_encoder.projection.weight": token_state["projection.weight"],
             "token_encoder.projection.bias": token_state["projection.bias"]}
    if config.word_dim:
        state["token_encoder.word_embedding.weight"] = _with_zero_row(token_state["word_emb_layer.embedding.weight"])
    for i in range(len(cnn.filters)):
        for part in ("weight", "bias"):
            state[f"token_encoder.char_cnn.convolutions.{i}.{part}"] = token_state[f"convolutions.{i}.{part}"]
    for k in range(cnn.n_highway):  # theirs [transform; gate on the input] -> [transform; carry = -gate]
        for part in ("weight", "bias"):
            transform, gate = token_state[f"highways._layers.{k}.{part}"].split(n_filters)
            state[f"token_encoder.highway.layers.{k}.{part}"] = torch.cat([transform, -gate])
    for layer in range(config.lstm.n_layers):
        theirs = [{key: encoder_state[f"{direction}_layer_{layer}.{key}"] for key in
                   ("input_linearity.weight", "state_linearity.weight", "state_linearity.bias", "state_projection.weight")}
                  for direction in ("forward", "backward")]
        prefix = f"lstm.layers.{layer}"
        state[f"{prefix}.input_weight"] = torch.stack([_native_gates(t["input_linearity.weight"]) for t in theirs])
        state[f"{prefix}.recurrent_weight"] = torch.stack([_native_gates(t["state_linearity.weight"]) for t in theirs])
        state[f"{prefix}.bias"] = torch.stack([_native_bias(t["state_linearity.bias"], cell) for t in theirs]).unsqueeze(1)
        state[f"{prefix}.projection"] = torch.stack([t["state_projection.weight"] for t in theirs])
    return {name: tensor.contiguous() for name, tensor in state.items()}


def _check_counts(config: ManyLangsConfig, token_state: dict[str, torch.Tensor],
                  encoder_state: dict[str, torch.Tensor], directory: Path) -> None:
    """Each filter bank and highway layer has 2 tensors in token_embedder.pkl, each LSTM layer 8 in
    encoder.pkl: a model config asking for more than the pickles hold is refused before a name is
    listed for each (the original format bounds its counts by the weight file's arrays likewise)."""
    for key, count, per_item, name, state in (
            ("token_embedder.filters", len(config.char_cnn.filters), 2, PICKLES[0], token_state),
            ("token_embedder.n_highway", config.char_cnn.n_highway, 2, PICKLES[0], token_state),
            ("encoder.n_layers", config.lstm.n_layers, 8, PICKLES[1], encoder_state)):
        if count * per_item > len(state):
            raise ConfigError(f"{directory}: the model config's {key} = {count:,} asks for {count * per_item:,} "
                              f"tensors in {name}, which holds {len(state)}")


def _check_shapes(path: Path, state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise WeightFileError(f"{path}: tensors do not match the model config: missing {missing}, unexpected {extra}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise WeightFileError(f"{path}: tensor {name!r} has shape {tuple(state[name].shape)}, the model config "
                                  f"implies {shape}")


def _with_zero_row(table: torch.Tensor) -> torch.Tensor:
    """Their (V, d) table as elmokit's (V + 1, d): row 0 is "no token"."""
    return torch.cat([table.new_zeros(1, table.shape[1]), table])


_THEIR_GATES_TO_NATIVE = (0, 1, 3, 2)  # theirs (i, f, j, o) -> elmokit's (i, f, o, j)


def _native_gates(tensor: torch.Tensor) -> torch.Tensor:
    blocks = tensor.chunk(4, dim=0)
    return torch.cat([blocks[k] for k in _THEIR_GATES_TO_NATIVE])


def _native_bias(bias: torch.Tensor, cell_dim: int) -> torch.Tensor:
    """Their bias holds the forget-gate bias; elmokit's adds FORGET_BIAS at run time."""
    native = _native_gates(bias).clone()
    native[cell_dim:2 * cell_dim] -= BiLstmLayer.FORGET_BIAS
    return native
