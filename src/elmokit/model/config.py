"""Typed configuration of the ELMo biLM: char CNN, LSTM stack, presets, JSON in and out.

One `ElmoConfig` builds the model and is saved next to its weights (`config.json`), so a
checkpoint always rebuilds its own model. The original options JSON (bilm-tf's) is read and
written by `ElmoConfig.from_options` / `ElmoConfig.to_options`; docs/formats.md says how bilm-tf
and AllenNLP each read every key, and why elmokit writes what it writes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elmokit.model.chars import MAX_CHARS, N_CHAR_IDS

ACTIVATIONS = ("relu", "tanh")
MAX_CHARACTERS_PER_TOKEN = MAX_CHARS  # options key char_cnn.max_characters_per_token: always 50
# char_cnn.n_characters: 262 is what bilm-tf needs at inference (the 261 trained rows + the zero
# row for "no token"); bilm-tf's training wants 261. AllenNLP ignores the key.
N_CHARACTERS_INFERENCE, N_CHARACTERS_TRAINING = N_CHAR_IDS, N_CHAR_IDS - 1
MAX_ORIGINAL_LAYERS = 8  # bilm-tf maps the weights of LSTM cells Cell0..Cell7 only
# An ELMoForManyLangs model's W (their max_characters_per_token; 50 in every published model): no
# weight's shape depends on it, so no file bounds it; every token's ids and char CNN activations
# are W wide. 1024 keeps tokens of 1022 code points and refuses a W that would allocate gigabytes.
MAX_MANYLANGS_CHARACTERS = 1024

RELEASED_FILTERS = ((1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024))


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _is_int(value: Any) -> bool:
    """An int that is not a bool (JSON `true` must not pass for 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class CharCNNConfig:
    """The context-free token encoder: char embedding → convolutions → highway → projection.

    Args:
        embedding_dim: E, size of each character embedding.
        filters: (width, count) of each convolution bank, in order; F = sum of the counts.
        n_highway: number of highway layers applied to the F pooled features.
        activation: applied after max-pooling each bank, "relu" or "tanh".
    """

    embedding_dim: int = 16
    filters: tuple[tuple[int, int], ...] = RELEASED_FILTERS
    n_highway: int = 1
    activation: str = "relu"

    def __post_init__(self) -> None:
        _require(isinstance(self.filters, (list, tuple))
                 and all(isinstance(f, (list, tuple)) and len(f) == 2 for f in self.filters),
                 f"char_cnn.filters must be a list of [width, count] pairs, got {self.filters!r}")
        filters = tuple(tuple(f) for f in self.filters)
        object.__setattr__(self, "filters", filters)
        _require(_is_int(self.embedding_dim) and self.embedding_dim > 0,
                 f"char_cnn.embedding_dim must be a positive int, got {self.embedding_dim!r}")
        _require(len(filters) > 0, "char_cnn.filters must list at least one (width, count) pair")
        for width, count in filters:
            _require(_is_int(width) and 1 <= width <= MAX_CHARACTERS_PER_TOKEN,
                     f"char_cnn.filters: width must be an int in 1..50, got {width!r}")
            _require(_is_int(count) and count > 0,
                     f"char_cnn.filters: count must be a positive int, got {count!r}")
        _require(_is_int(self.n_highway) and self.n_highway >= 0,
                 f"char_cnn.n_highway must be an int >= 0, got {self.n_highway!r}")
        _require(self.activation in ACTIVATIONS,
                 f"char_cnn.activation must be one of {ACTIVATIONS}, got {self.activation!r}")

    @property
    def n_filters(self) -> int:
        """F, the number of pooled features (the sum of all filter counts)."""
        return sum(count for _, count in self.filters)


@dataclass(frozen=True)
class LSTMConfig:
    """One direction's LSTM stack (the forward and the backward stacks share this shape).

    Args:
        cell_dim: C, the LSTM cell size.
        projection_dim: P, the size of the projected hidden state and of every layer's output.
        n_layers: L.
        cell_clip: clip the cell state to [-cell_clip, cell_clip]; 0 means no clipping
            (written as `null` in the original options, see `ElmoConfig.to_options`).
        proj_clip: clip the projected state likewise; 0 means no clipping.
        use_skip_connections: residual from layer 2 on (must be true, as in every ELMo file).
    """

    cell_dim: int = 1024
    projection_dim: int = 128
    n_layers: int = 2
    cell_clip: float = 3.0
    proj_clip: float = 3.0
    use_skip_connections: bool = True

    def __post_init__(self) -> None:
        for name in ("cell_dim", "projection_dim", "n_layers"):
            value = getattr(self, name)
            _require(_is_int(value) and value > 0, f"lstm.{name} must be a positive int, got {value!r}")
        for name in ("cell_clip", "proj_clip"):
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
                     f"lstm.{name} must be a number >= 0 (0 = no clipping), got {value!r}")
            object.__setattr__(self, name, float(value))
        _require(self.use_skip_connections is True,
                 "lstm.use_skip_connections must be true (every ELMo model uses them)")


@dataclass(frozen=True)
class ElmoConfig:
    """The whole biLM: the token encoder and the LSTM shape of each direction."""

    char_cnn: CharCNNConfig = field(default_factory=CharCNNConfig)
    lstm: LSTMConfig = field(default_factory=LSTMConfig)

    def __post_init__(self) -> None:
        if isinstance(self.char_cnn, dict):
            object.__setattr__(self, "char_cnn", CharCNNConfig(**self.char_cnn))
        if isinstance(self.lstm, dict):
            object.__setattr__(self, "lstm", LSTMConfig(**self.lstm))
        _require(isinstance(self.char_cnn, CharCNNConfig), "char_cnn must be a CharCNNConfig")
        _require(isinstance(self.lstm, LSTMConfig), "lstm must be an LSTMConfig")

    @property
    def output_dim(self) -> int:
        """2P, the size of every ELMo layer."""
        return 2 * self.lstm.projection_dim

    @property
    def n_output_layers(self) -> int:
        """L + 1: the token layer and one per LSTM layer."""
        return self.lstm.n_layers + 1

    # ---- presets -------------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str) -> "ElmoConfig":
        """A named preset with the shape of a released model (see `PRESETS`)."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
        return PRESETS[name]

    # ---- native JSON ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["char_cnn"]["filters"] = [list(f) for f in self.char_cnn.filters]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "elmokit config") -> "ElmoConfig":
        """The native JSON form (`to_dict`); errors name `source` (the file) and the key."""
        _require(isinstance(data, dict), f"{source}: expected a JSON object, got {type(data).__name__}")
        unknown = set(data) - {"char_cnn", "lstm", "manylangs", "elmokit_version"}
        _require(not unknown, f"{source}: unknown config keys: {sorted(unknown)}")
        for key in ("char_cnn", "lstm", *(("manylangs",) if "manylangs" in data else ())):
            _require(key in data, f"{source}: missing key {key!r}")
            _require(isinstance(data[key], dict), f"{source}: {key} must be a JSON object, got {data[key]!r}")
        try:
            sections = {"char_cnn": CharCNNConfig(**data["char_cnn"]), "lstm": LSTMConfig(**data["lstm"])}
            if "manylangs" in data:  # an ELMoForManyLangs model (elmokit.model.manylangs)
                return ManyLangsConfig(**sections, **data["manylangs"])
            return cls(**sections)
        except TypeError as error:  # an unknown or missing key of a section
            raise ConfigError(f"{source}: invalid elmokit config: {error}") from None
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None

    def save(self, path: str | Path) -> None:
        """Write the native JSON, with the version of elmokit that wrote it (`elmokit_version`:
        a record for the reader, ignored when loading)."""
        from elmokit import __version__
        from elmokit.io import atomic_write_text

        atomic_write_text(path, json.dumps({**self.to_dict(), "elmokit_version": __version__}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ElmoConfig":
        return cls.from_dict(_read_json(path), source=str(path))

    # ---- the original options JSON (bilm-tf's) -------------------------------------------
    @classmethod
    def from_options(cls, options: dict[str, Any], source: str = "options") -> "ElmoConfig":
        """Read the original bilm-tf / AllenNLP options dictionary (docs/formats.md, every key).

        A clip of `0`, `null` or no clip key at all means no clipping (AllenNLP clips only for a
        truthy value). `n_highway` absent or `null` means none (bilm-tf's rule), `activation`
        absent means relu. `n_characters` may be 262 (inference) or 261 (bilm-tf's training
        options): the weight file holds 261 rows either way. Other keys are ignored.

        Raises:
            ConfigError: naming `source` and the key, for a missing or invalid value.
        """
        def option(key: str, default: Any = _REQUIRED) -> Any:
            return _option(options, key, source, default)

        chars = option("char_cnn.max_characters_per_token", MAX_CHARACTERS_PER_TOKEN)
        _require(_is_int(chars) and chars == MAX_CHARACTERS_PER_TOKEN,
                 f"{source}: char_cnn.max_characters_per_token must be {MAX_CHARACTERS_PER_TOKEN} (the character "
                 f"ids of every token are {MAX_CHARACTERS_PER_TOKEN} wide), got {chars!r}")
        rows = option("char_cnn.n_characters", None)
        _require(rows is None or (_is_int(rows) and rows in (N_CHARACTERS_INFERENCE, N_CHARACTERS_TRAINING)),
                 f"{source}: char_cnn.n_characters must be {N_CHARACTERS_INFERENCE} (or {N_CHARACTERS_TRAINING} "
                 f"in bilm-tf's training options), got {rows!r}")
        n_highway, cell_clip, proj_clip = (option(key, None) for key in
                                           ("char_cnn.n_highway", "lstm.cell_clip", "lstm.proj_clip"))
        try:
            return cls(
                char_cnn=CharCNNConfig(
                    embedding_dim=option("char_cnn.embedding.dim"),
                    filters=option("char_cnn.filters"),
                    n_highway=0 if n_highway is None else n_highway,
                    activation=option("char_cnn.activation", "relu"),
                ),
                lstm=LSTMConfig(
                    cell_dim=option("lstm.dim"),
                    projection_dim=option("lstm.projection_dim"),
                    n_layers=option("lstm.n_layers"),
                    cell_clip=0.0 if cell_clip is None else cell_clip,
                    proj_clip=0.0 if proj_clip is None else proj_clip,
                    use_skip_connections=option("lstm.use_skip_connections", False),
                ),
            )
        except ConfigError as error:  # name the key as the options file spells it
            message = str(error)
            for native, original in _OPTIONS_NAMES.items():
                message = message.replace(native, original)
            raise ConfigError(message if message.startswith(source) else f"{source}: {message}") from None

    def to_options(self) -> dict[str, Any]:
        """The original options dictionary, written so that bilm-tf and AllenNLP both build the
        model elmokit runs (docs/formats.md: every key, and how each of them reads it).

        No clipping is written as `null`, never as 0: bilm-tf hands the value to TensorFlow's
        `LSTMCell`, which clips whenever it is not None (a clip of 0 zeroes every cell), and
        AllenNLP indexes both keys (so they must be present) and clips only for a truthy value.

        Raises:
            ConfigError: for a shape that bilm-tf would build differently (see
                `check_original_format`).
        """
        self.check_original_format()
        return {
            "lstm": {
                "use_skip_connections": self.lstm.use_skip_connections,
                "projection_dim": self.lstm.projection_dim,
                "cell_clip": self.lstm.cell_clip or None,
                "proj_clip": self.lstm.proj_clip or None,
                "dim": self.lstm.cell_dim,
                "n_layers": self.lstm.n_layers,
            },
            "char_cnn": {
                "activation": self.char_cnn.activation,
                "filters": [list(f) for f in self.char_cnn.filters],
                "n_highway": self.char_cnn.n_highway,
                "embedding": {"dim": self.char_cnn.embedding_dim},
                "n_characters": N_CHARACTERS_INFERENCE,
                "max_characters_per_token": MAX_CHARACTERS_PER_TOKEN,
            },
        }

    def check_original_format(self) -> None:
        """Raise ConfigError unless the original format can hold this model with one meaning.

        AllenNLP always builds the token projection (F -> P) and the LSTM projection (C -> P),
        as elmokit does. bilm-tf builds the token projection only when F != P (and asserts
        F > P), the LSTM projection only when P < C, and loads at most 8 LSTM layers; outside
        those bounds it would run another model, or none, from the same files.
        """
        n_filters, proj = self.char_cnn.n_filters, self.lstm.projection_dim
        cell, layers = self.lstm.cell_dim, self.lstm.n_layers
        _require(n_filters > proj,
                 f"cannot write the original format: the char_cnn.filters give F = {n_filters} features, which "
                 f"must be more than lstm.projection_dim = {proj} (bilm-tf drops the token projection when "
                 "F == P and refuses F < P)")
        _require(proj < cell,
                 f"cannot write the original format: lstm.projection_dim = {proj} must be smaller than "
                 f"lstm.dim (cell_dim) = {cell} (bilm-tf builds its LSTM without the projection otherwise)")
        _require(layers <= MAX_ORIGINAL_LAYERS,
                 f"cannot write the original format: lstm.n_layers = {layers}, but bilm-tf loads at most "
                 f"{MAX_ORIGINAL_LAYERS} layers")


@dataclass(frozen=True)
class ManyLangsConfig(ElmoConfig):
    """An ELMoForManyLangs model (`elmokit.model.manylangs`): ELMo's char CNN and LSTMs, with a
    character vocabulary of its own instead of UTF-8 bytes, and optionally a word embedding whose
    vectors are concatenated with the highway output before the projection.

    Args (beside ELMo's `char_cnn` and `lstm`):
        n_char_ids: rows of their character table (their ids 0..n-1; elmokit's table has one more,
            row 0 for "no token").
        max_characters_per_token: W, the character ids of a token (their `max_characters_per_token`).
        word_dim: size of the word embedding; 0 for none.
        n_word_ids: rows of their word table (0 without a word embedding).
    """

    n_char_ids: int = 1
    max_characters_per_token: int = 50
    word_dim: int = 0
    n_word_ids: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(_is_int(self.n_char_ids) and self.n_char_ids > 0,
                 f"manylangs.n_char_ids must be a positive int, got {self.n_char_ids!r}")
        chars = self.max_characters_per_token
        _require(_is_int(chars) and 3 <= chars <= MAX_MANYLANGS_CHARACTERS,
                 f"manylangs.max_characters_per_token must be an int in 3..{MAX_MANYLANGS_CHARACTERS} (begin of "
                 f"word, a character, end of word at least), got {chars!r}")
        for name in ("word_dim", "n_word_ids"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 0, f"manylangs.{name} must be an int >= 0, got {value!r}")
        _require((self.word_dim > 0) == (self.n_word_ids > 0),
                 f"manylangs: word_dim ({self.word_dim}) and n_word_ids ({self.n_word_ids}) must both be 0 "
                 "(no word embedding) or both positive")
        widest = max(width for width, _ in self.char_cnn.filters)
        _require(widest <= self.max_characters_per_token,
                 f"char_cnn.filters: width {widest} is wider than manylangs.max_characters_per_token = "
                 f"{self.max_characters_per_token}")

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        manylangs = {name: data.pop(name) for name in ("n_char_ids", "max_characters_per_token",
                                                        "word_dim", "n_word_ids")}
        return {**data, "manylangs": manylangs}

    def check_original_format(self) -> None:
        """Always raises: `to_options` (and so `save_original`) refuse this model before writing."""
        raise ConfigError(
            "cannot write the original bilm-tf format (options JSON + HDF5): this is an ELMoForManyLangs "
            f"model, and that format cannot hold its character vocabulary ({self.n_char_ids:,} characters of "
            "its own, where bilm-tf reads UTF-8 bytes)"
            + (f" nor its word embedding ({self.n_word_ids:,} x {self.word_dim})" if self.word_dim else "")
            + "; convert it to elmokit's native format instead (elmo convert --model DIR --to-native OUT)")


_REQUIRED = object()
# elmokit's names -> the options file's names, for error messages about an options file
_OPTIONS_NAMES = {"char_cnn.embedding_dim": "char_cnn.embedding.dim", "lstm.cell_dim": "lstm.dim"}


def _option(options: Any, key: str, source: str, default: Any = _REQUIRED) -> Any:
    """The value at the dotted `key` ("char_cnn.embedding.dim") of an options dictionary;
    `default` when the last part is absent (a missing section is always an error)."""
    *sections, name = key.split(".")
    table = options
    for depth in range(len(sections) + 1):
        where = ".".join(sections[:depth]) or "the options"
        _require(isinstance(table, dict), f"{source}: {where} must be a JSON object, got {table!r}")
        if depth < len(sections):
            _require(sections[depth] in table, f"{source}: missing option {'.'.join(sections[:depth + 1])!r}")
            table = table[sections[depth]]
    if name not in table:
        _require(default is not _REQUIRED, f"{source}: missing option {key!r}")
        return default
    return table[name]


def _read_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as error:  # bad JSON or UTF-8, over-long integers, deep nesting
        raise ConfigError(f"{path}: not valid JSON ({error})") from error
    _require(isinstance(data, dict), f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_options(path: str | Path) -> ElmoConfig:
    """Read an original options JSON file into an `ElmoConfig`."""
    return ElmoConfig.from_options(_read_json(path), source=str(path))


PRESETS: dict[str, ElmoConfig] = {
    # 2x1024_128_2048cnn_1xhighway: 13.6M parameters
    "small": ElmoConfig(CharCNNConfig(16, RELEASED_FILTERS, 1), LSTMConfig(1024, 128)),
    # 2x2048_256_2048cnn_1xhighway
    "medium": ElmoConfig(CharCNNConfig(16, RELEASED_FILTERS, 1), LSTMConfig(2048, 256)),
    # 2x4096_512_2048cnn_2xhighway: 93.6M parameters
    "original": ElmoConfig(CharCNNConfig(16, RELEASED_FILTERS, 2), LSTMConfig(4096, 512)),
    # the built-in gutenberg-en's shape (4.4M parameters with a 10k softmax): what trains at the
    # speed of bench/results/train.md on a small CPU (scripts/gutenberg-cpu.json is the same)
    "gutenberg-cpu": ElmoConfig(CharCNNConfig(16, ((1, 32), (2, 64), (3, 96), (4, 128), (5, 128), (6, 128)), 1),
                                LSTMConfig(512, 128, cell_clip=0.0, proj_clip=0.0)),
}
