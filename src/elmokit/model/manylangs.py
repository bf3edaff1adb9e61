"""ELMoForManyLangs models (HIT-SCIR/ELMoForManyLangs, Che et al. 2018: 44 languages) read into
elmokit's `BiLM`, giving the numbers of their `Embedder.sents2elmo`.

A model folder of theirs holds `config.json` (their training options; `config_path` names the
model config), the model config (`cnn_50_100_512_4096_sample.json` for the published models),
`char.dic` and `word.dic` ("entry<TAB>id" lines) and two `torch.save` pickles of state dicts,
`token_embedder.pkl` and `encoder.pkl`. `elmokit.model.manylangs_files` reads them, unpickling
only tensors (`torch.load(..., weights_only=True)`): anything else in a .pkl is refused.

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

Shape notation: N tokens, W their characters a token (`max_characters_per_token`), E char
embedding dim, F total CNN filters, D_w word embedding dim (0: none), P projection dim.
"""

from __future__ import annotations

import itertools
import json
import operator
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
from elmokit.model.config import MAX_MANYLANGS_CHARACTERS, ConfigError, ManyLangsConfig
from elmokit.model.encoder import CharCNN, Highway
from elmokit.model.lstm import BiLstm
from elmokit.model.manylangs_files import (
    PICKLES, config_from, native_state, read_dictionary, read_model_config, read_state_dict)

# Their names for the special entries of char.dic and word.dic.
BOS, EOS, OOV, PAD, BOW, EOW = "<bos>", "<eos>", "<oov>", "<pad>", "<bow>", "<eow>"
SPECIAL_CHARS = (BOS, EOS, OOV, PAD, BOW, EOW)

VOCABULARY_NAME = "manylangs_vocab.json"  # the native format's file for both vocabularies


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
        if not 3 <= max_chars <= MAX_MANYLANGS_CHARACTERS:  # before any (W,) row is allocated
            raise ValueError(f"max_characters_per_token must be in 3..{MAX_MANYLANGS_CHARACTERS}, got {max_chars}")
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


# ---------------------------------------------------------------------------------------------
# The model: their token encoder, ELMo's LSTMs
# ---------------------------------------------------------------------------------------------
class ManyLangsTokenEncoder(nn.Module):
    """Their context-free token representation: char CNN over their character vocabulary ->
    highway -> [word vector, highway output] -> projection to P.

    Input (N, W) ids, or (N, W + 1) with the word id last; output (N, P). Row 0 of both tables is
    "no token" (never read: only real positions are encoded).
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
            words = self.word_embedding(ids[:, self.max_chars]).to(features.dtype)  # (N, D_w)
            features = torch.cat([words, features], dim=-1)  # (N, D_w + F), their order
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


def looks_like_manylangs_dir(path: str | Path) -> bool:
    """True for a folder with any file of theirs (char.dic, a weight pickle): one missing the rest is
    read as theirs, so that the error names the file it lacks."""
    path = Path(path)
    return path.is_dir() and any((path / name).is_file() for name in ("char.dic", *PICKLES))


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
    config = config_from(model_config, token_state, directory)
    state = native_state(config, token_state, encoder_state, directory)  # checked before anything is built
    try:
        model = ManyLangsBiLM(config, vocabulary)  # so its sizes are those of the pickles' tensors
    except ConfigError as error:
        raise ConfigError(f"{directory}: {error} (char.dic / word.dic against the weight pickles)") from None
    model.load_state_dict(state)
    return model.eval()
