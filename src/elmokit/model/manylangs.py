"""ELMoForManyLangs models (HIT-SCIR/ELMoForManyLangs, Che et al. 2018: 44 languages) read into
elmokit's `BiLM`, giving the numbers of their `Embedder.sents2elmo`.

A model folder of theirs holds `config.json` (their training options; `config_path` names the
model config), the model config (`cnn_50_100_512_4096_sample.json` for the published models),
`char.dic` and `word.dic` ("entry<TAB>id" lines) and two `torch.save` pickles of state dicts,
`token_embedder.pkl` and `encoder.pkl`. Only tensors are unpickled here (`torch.load(...,
weights_only=True)`); anything else in a .pkl is refused.

Their model is ELMo's char CNN and LSTMs (AllenNLP's code) with these differences, all part of
their numbers and reproduced here:

* Characters are Unicode code points looked up in their own vocabulary (`char.dic`; unknown ->
  `<oov>`), not UTF-8 bytes. A token longer than W - 2 code points is cut to W - 2 before both
  lookups (W = their `max_characters_per_token`).
* A token's W char ids: their `create_one_batch` takes `<eow>`'s id for its begin-of-word slot and
  `<bow>`'s for its end-of-word slot (its names are swapped), so a token is
  `[id(<eow>), chars..., id(<bow>), id(<pad>)...]`; their sentence boundaries `<bos>` / `<eos>`
  are `[id(<eow>), id(<bos>), id(<bow>), id(<pad>)...]` (likewise `<eos>`). elmokit's boundary
  strings `<S>` / `</S>` map to these.
* An optional word embedding (`word_dim` > 0; `word.dic`, unknown -> `<oov>`) is concatenated
  before the highway output: projection input = [word vector, highway output].
* Their highway gate g multiplies the input: x <- g * x + (1 - g) * relu(t), so elmokit's carry
  gate (which multiplies the transform) is 1 - g: its weights and bias are theirs negated.
* Their LSTM (AllenNLP's cell) has gates in the order (i, f, j, o) and its stored bias includes the
  forget-gate bias (nothing is added at run time); elmokit adds `BiLstmLayer.FORGET_BIAS` at run
  time, so the stored f block is theirs minus that.
* Layer 0 is the token representation twice, [token | token], as in ELMo.

Their LSTM carries its state from one batch to the next; elmokit is stateless, which equals their
numbers for every sentence of a first batch (a fresh `Embedder`).

elmokit's ids: every id is theirs + 1, so that 0 stays "no token"; with a word embedding a token's
row has W + 1 ids, the last one its word id.
"""

from __future__ import annotations

import itertools
import json
import operator
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from elmokit.io import atomic_write_text
from elmokit.kernels import linear
from elmokit.model.bilm import BiLM
from elmokit.model.chars import BOS_TOKEN, EOS_TOKEN
from elmokit.model.config import CharCNNConfig, ConfigError, LSTMConfig, ManyLangsConfig
from elmokit.model.encoder import CharCNN, Highway
from elmokit.model.lstm import BiLstm, BiLstmLayer
from elmokit.model.weights import WeightFileError, _check_finite

# Their names for the special entries of char.dic and word.dic.
BOS, EOS, OOV, PAD, BOW, EOW = "<bos>", "<eos>", "<oov>", "<pad>", "<bow>", "<eow>"
SPECIAL_CHARS = (BOS, EOS, OOV, PAD, BOW, EOW)

VOCABULARY_NAME = "manylangs_vocab.json"  # the native format's file for both vocabularies
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


# ---------------------------------------------------------------------------------------------
# Vocabulary: token strings -> ids (their create_one_batch, vectorised)
# ---------------------------------------------------------------------------------------------
class ManyLangsVocabulary:
    """Their character vocabulary (and word vocabulary, if the model has a word embedding).

    Args:
        chars: entry -> their id (single characters and the six special entries).
        words: entry -> their id, or None without a word embedding.
        max_chars: W, their `max_characters_per_token`.
    """

    def __init__(self, chars: dict[str, int], words: dict[str, int] | None, max_chars: int):
        missing = [name for name in SPECIAL_CHARS if name not in chars]
        if missing:
            raise ValueError(f"the character vocabulary lacks the special entries {missing}")
        if words is not None and OOV not in words:
            raise ValueError(f"the word vocabulary lacks the special entry {OOV!r}")
        if max_chars < 3:
            raise ValueError(f"max_characters_per_token must be at least 3, got {max_chars}")
        self.chars, self.words, self.max_chars = chars, words, max_chars
        singles = {ord(entry): index for entry, index in chars.items() if len(entry) == 1}
        self._codes = np.array(sorted(singles), dtype=np.int64)  # code points in the vocabulary, sorted
        self._code_ids = np.array([singles[code] for code in self._codes.tolist()], dtype=np.int64)
        self._boundaries = {token: self._boundary_row(char) for token, char in ((BOS, BOS), (EOS, EOS))}

    @property
    def width(self) -> int:
        """Ids a token: W chars, plus its word id with a word embedding."""
        return self.max_chars + (self.words is not None)

    def _boundary_row(self, name: str) -> np.ndarray:
        row = np.full(self.max_chars, self.chars[PAD], dtype=np.int64)
        row[:3] = (self.chars[EOW], self.chars[name], self.chars[BOW])  # their swapped begin/end of word
        return row

    def token_ids(self, tokens: Sequence[str]) -> np.ndarray:
        """int64 (N, W) ids (N, W + 1 with a word embedding) of a flat list of tokens, each their
        id + 1; "<S>" / "</S>" (and their own "<bos>" / "<eos>") are the sentence boundaries."""
        if not all(map(isinstance, tokens, itertools.repeat(str))):
            bad = next(t for t in tokens if not isinstance(t, str))
            raise TypeError(f"tokens must be str, got {type(bad).__name__}: {bad!r}")
        n = len(tokens)
        cut = list(map(operator.getitem, tokens, itertools.repeat(slice(0, self.max_chars - 2))))
        lengths = np.fromiter(map(len, cut), dtype=np.int64, count=n)  # code points
        codes = np.frombuffer("".join(cut).encode("utf-32-le", "surrogatepass"), dtype="<u4").astype(np.int64)
        slot = np.searchsorted(self._codes, codes).clip(max=max(len(self._codes) - 1, 0))
        known = self._codes[slot] == codes if len(self._codes) else np.zeros(len(codes), bool)
        char_ids = np.where(known, self._code_ids[slot] if len(self._codes) else 0, self.chars[OOV])

        ids = np.full((n, self.max_chars), self.chars[PAD], dtype=np.int64)  # (N, W)
        ids[:, 0] = self.chars[EOW]
        rows = np.repeat(np.arange(n), lengths)
        ids[rows, np.arange(len(rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths) + 1] = char_ids
        ids[np.arange(n), lengths + 1] = self.chars[BOW]

        given, kept = np.array(tokens, dtype=object).reshape(n), np.array(cut, dtype=object).reshape(n)
        boundaries = {BOS: (given == BOS_TOKEN) | (kept == BOS), EOS: (given == EOS_TOKEN) | (kept == EOS)}
        for name, where in boundaries.items():
            ids[where] = self._boundaries[name]
        if self.words is not None:
            word_ids = np.fromiter(map(self.words.get, cut, itertools.repeat(self.words[OOV])), np.int64, n)
            for name, where in boundaries.items():
                word_ids[where] = self.words.get(name, self.words[OOV])
            ids = np.concatenate([ids, word_ids[:, None]], axis=1)  # (N, W + 1)
        return ids + 1

    # ---- the native format's file ---------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        text = json.dumps({"chars": self.chars, "words": self.words}, ensure_ascii=False)
        atomic_write_text(Path(directory) / VOCABULARY_NAME, text + "\n")

    @classmethod
    def load(cls, directory: str | Path, max_chars: int) -> "ManyLangsVocabulary":
        path = Path(directory) / VOCABULARY_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{directory}: an ELMoForManyLangs model in the native format needs "
                                    f"{VOCABULARY_NAME} beside config.json")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ConfigError(f"{path}: not valid JSON ({error})") from None
        if not isinstance(data, dict) or not isinstance(data.get("chars"), dict) \
                or not isinstance(data.get("words"), (dict, type(None))):
            raise ConfigError(f"{path}: expected {{\"chars\": {{entry: id}}, \"words\": {{entry: id}} or null}}")
        for name in ("chars", "words"):
            table = data[name] or {}
            if not all(map(_is_id, table.values())):
                raise ConfigError(f"{path}: {name}: every id must be an int >= 0")
        try:
            return cls(data["chars"], data["words"], max_chars)
        except ValueError as error:
            raise ConfigError(f"{path}: {error}") from None


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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


# ---------------------------------------------------------------------------------------------
# The model: their token encoder, ELMo's LSTMs
# ---------------------------------------------------------------------------------------------
class ManyLangsTokenEncoder(nn.Module):
    """Their context-free token representation: char CNN over their character vocabulary ->
    highway -> [word vector, highway output] -> projection to P.

    Input (N, W) ids, or (N, W + 1) with the word id last; output (N, P).
    """

    def __init__(self, config: ManyLangsConfig):
        super().__init__()
        cnn = config.char_cnn
        self.max_chars = config.max_characters_per_token
        self.char_cnn = CharCNN(cnn.embedding_dim, cnn.filters, cnn.activation)
        # their character table, with row 0 for "no token" (elmokit's ids are theirs + 1)
        self.char_cnn.char_embedding = nn.Embedding(config.n_char_ids + 1, cnn.embedding_dim, padding_idx=0)
        self.highway = Highway(cnn.n_filters, cnn.n_highway)
        self.word_embedding = (nn.Embedding(config.n_word_ids + 1, config.word_dim, padding_idx=0)
                               if config.word_dim else None)
        self.projection = nn.Linear(config.word_dim + cnn.n_filters, config.lstm.projection_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        width = self.max_chars + (self.word_embedding is not None)
        if ids.shape[-1] != width:
            raise ValueError(f"token ids of width {ids.shape[-1]}, but this ELMoForManyLangs model takes {width} "
                             "a token: make them with the model's own batch_ids (bilm.batch_ids(sentences)), "
                             "not ELMo's byte-level batch_to_ids")
        features = self.highway(self.char_cnn(ids[:, :self.max_chars]))  # (N, F)
        if self.word_embedding is not None:
            words = self.word_embedding(ids[:, self.max_chars]).to(features.dtype)  # (N, word_dim)
            features = torch.cat([words, features], dim=-1)  # (N, word_dim + F), their order
        return linear(features, self.projection.weight, self.projection.bias)  # (N, P)


class ManyLangsBiLM(BiLM):
    """An ELMoForManyLangs biLM: their token encoder and vocabulary, elmokit's `BiLstm`.

    Everything downstream of the ids (boundaries, layers, ElmoEmbedder, Elmo, the engine) is
    `BiLM`'s; only the ids (`token_ids`) and the token encoder differ.
    """

    def __init__(self, config: ManyLangsConfig, vocabulary: ManyLangsVocabulary, dropout: float = 0.0):
        nn.Module.__init__(self)  # not BiLM.__init__: that builds ELMo's byte-level token encoder
        if vocabulary.max_chars != config.max_characters_per_token:
            raise ConfigError(f"the vocabulary is for {vocabulary.max_chars} characters a token, the config "
                              f"for {config.max_characters_per_token}")
        if (vocabulary.words is not None) != (config.word_dim > 0):
            raise ConfigError("a word vocabulary goes with a word embedding (word_dim > 0), and only with one")
        for name, table, rows in (("character", vocabulary.chars, config.n_char_ids),
                                  ("word", vocabulary.words or {}, config.n_word_ids)):
            largest = max(table.values(), default=-1)
            if largest >= rows:
                raise ConfigError(f"the {name} vocabulary has id {largest}, but its table has {rows} rows")
        self.config = config
        self.vocabulary = vocabulary
        self.token_encoder = ManyLangsTokenEncoder(config)
        self.lstm = BiLstm(config, dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()  # the same module names as ELMo's token encoder
        if self.token_encoder.word_embedding is not None:
            with torch.no_grad():
                nn.init.uniform_(self.token_encoder.word_embedding.weight, -0.25, 0.25)
                self.token_encoder.word_embedding.weight[0].zero_()

    def token_ids(self, tokens: list[str]) -> np.ndarray:
        """int64 (N, W) ids (W + 1 with a word embedding) in their vocabulary, shifted by one."""
        return self.vocabulary.token_ids(tokens)

    def save_vocabulary(self, directory: str | Path) -> None:
        """The native format's vocabulary file (`save_pretrained` calls this)."""
        self.vocabulary.save(directory)


def build_native(config: ManyLangsConfig, directory: str | Path):
    """A builder `config -> ManyLangsBiLM` for `load_pretrained`, with the vocabulary saved in
    `directory` (read once)."""
    vocabulary = ManyLangsVocabulary.load(directory, config.max_characters_per_token)
    return lambda config: ManyLangsBiLM(config, vocabulary)


# ---------------------------------------------------------------------------------------------
# Their model folder
# ---------------------------------------------------------------------------------------------
def is_manylangs_dir(path: str | Path | None) -> bool:
    """True for a folder holding their config.json and both weight pickles."""
    if path is None:
        return False
    path = Path(path)
    return path.is_dir() and all((path / name).is_file() for name in ("config.json", *PICKLES))


def load_manylangs(path: str | Path) -> ManyLangsBiLM:
    """Build a `ManyLangsBiLM` from an ELMoForManyLangs model folder (their Embedder's model).

    Raises:
        FileNotFoundError, ConfigError, WeightFileError: naming the file and what is wrong; a .pkl
            holding anything but tensors is refused without running it.
    """
    directory = Path(path)
    model_config = read_model_config(directory)
    tokens = model_config["token_embedder"]
    chars = read_dictionary(directory / "char.dic")
    words = read_dictionary(directory / "word.dic") if tokens["word_dim"] > 0 else None
    try:
        vocabulary = ManyLangsVocabulary(chars, words, tokens["max_characters_per_token"])
    except ValueError as error:
        raise ConfigError(f"{directory}: {error} (char.dic / word.dic)") from None
    token_state, encoder_state = (read_state_dict(directory / name) for name in PICKLES)
    config = _config_from(model_config, token_state, directory)
    state = _native_state(config, token_state, encoder_state, directory)  # checked before anything is built
    model = ManyLangsBiLM(config, vocabulary)  # so its sizes are those of the pickles' tensors
    model.load_state_dict(state)
    return model.eval()


def read_model_config(directory: Path) -> dict[str, Any]:
    """Their model config, found as their Embedder finds it: `config_path` of config.json relative
    to the folder, else its file name in the folder, else one of the configs their package ships."""
    options = _read_json(directory / "config.json")
    name = options.get("config_path")
    if not isinstance(name, str):
        raise ConfigError(f"{directory / 'config.json'}: no \"config_path\" naming the model config")
    for candidate in (directory / name, directory / Path(name).name):
        if candidate.is_file():
            config, source = _read_json(candidate), candidate
            break
    else:
        if Path(name).name not in KNOWN_CONFIGS:
            raise FileNotFoundError(f"{directory / 'config.json'}: config_path {name!r} is neither in the folder nor "
                                    f"one of ELMoForManyLangs' own configs ({', '.join(KNOWN_CONFIGS)})")
        config, source = KNOWN_CONFIGS[Path(name).name], Path(name).name
    _check_model_config(config, source)
    return config


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


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
    for key, least in (("char_dim", 1), ("word_dim", 0), ("n_highway", 0), ("max_characters_per_token", 3)):
        _require_int(tokens, key, source, "token_embedder", least)


def _require_int(section: dict, key: str, source, where: str, least: int) -> None:
    value = section.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(f"{source}: {where}.{key} must be an int >= {least}, got {value!r}")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A `torch.save`d state dict, unpickling nothing but tensors (`weights_only=True`): a pickle
    holding any other object is refused before that object is built."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (an ELMoForManyLangs model folder holds it)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise WeightFileError(f"{path}: refused: it holds something other than tensors, and elmokit unpickles "
                              f"nothing else ({reason})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise WeightFileError(f"{path}: not a readable torch state dict ({error})") from None
    if not isinstance(state, dict) or not all(isinstance(key, str) and isinstance(value, torch.Tensor)
                                              for key, value in state.items()):
        raise WeightFileError(f"{path}: expected a state dict (names -> tensors), got {type(state).__name__}")
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            raise WeightFileError(f"{path}: tensor {name!r} has dtype {tensor.dtype}, expected floating point")
        _check_finite(path, f"tensor {name!r}", tensor)
    return {name: tensor.float() for name, tensor in state.items()}


def _config_from(model_config: dict, token_state: dict[str, torch.Tensor], directory: Path) -> ManyLangsConfig:
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


def _native_state(config: ManyLangsConfig, token_state: dict[str, torch.Tensor],
                  encoder_state: dict[str, torch.Tensor], directory: Path) -> dict[str, torch.Tensor]:
    """Their two state dicts as `ManyLangsBiLM`'s, after checking every name and shape."""
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
