"""Typed configuration of the ELMo biLM: char CNN, LSTM stack, presets, JSON in and out.

One `ElmoConfig` builds the model and is saved next to its weights (`config.json`), so a
checkpoint always rebuilds its own model. The original options JSON (spec §1) is read and
written by `ElmoConfig.from_options` / `ElmoConfig.to_options`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ACTIVATIONS = ("relu", "tanh")
MAX_CHARACTERS_PER_TOKEN = 50  # the character mapper hard-codes 50 (spec §1)
N_CHARACTER_IDS = 262  # 256 bytes + 5 special characters + the 0 reserved for "no token"

RELEASED_FILTERS = ((1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024))


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


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
        filters = tuple(tuple(f) for f in self.filters)
        object.__setattr__(self, "filters", filters)
        _require(isinstance(self.embedding_dim, int) and self.embedding_dim > 0,
                 f"char_cnn.embedding_dim must be a positive int, got {self.embedding_dim!r}")
        _require(len(filters) > 0, "char_cnn.filters must list at least one (width, count) pair")
        for width, count in filters:
            _require(isinstance(width, int) and 1 <= width <= MAX_CHARACTERS_PER_TOKEN,
                     f"char_cnn.filters: width must be an int in 1..50, got {width!r}")
            _require(isinstance(count, int) and count > 0,
                     f"char_cnn.filters: count must be a positive int, got {count!r}")
        _require(isinstance(self.n_highway, int) and self.n_highway >= 0,
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
        cell_clip: clip the cell state to [-cell_clip, cell_clip]; 0 means no clipping.
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
            _require(isinstance(value, int) and value > 0,
                     f"lstm.{name} must be a positive int, got {value!r}")
        for name in ("cell_clip", "proj_clip"):
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and value >= 0,
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
    def from_dict(cls, data: dict[str, Any]) -> "ElmoConfig":
        unknown = set(data) - {"char_cnn", "lstm"}
        _require(not unknown, f"unknown config keys: {sorted(unknown)}")
        try:
            return cls(char_cnn=CharCNNConfig(**data["char_cnn"]), lstm=LSTMConfig(**data["lstm"]))
        except (KeyError, TypeError) as error:
            raise ConfigError(f"invalid elmokit config: {error}") from error

    def save(self, path: str | Path) -> None:
        from elmokit.io import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ElmoConfig":
        return cls.from_dict(_read_json(path))

    # ---- the original options JSON (spec §1) ---------------------------------------------
    @classmethod
    def from_options(cls, options: dict[str, Any], source: str = "options") -> "ElmoConfig":
        """Read the original bilm-tf / AllenNLP options dictionary."""
        try:
            cnn, lstm = options["char_cnn"], options["lstm"]
            chars = cnn.get("max_characters_per_token", MAX_CHARACTERS_PER_TOKEN)
            _require(chars == MAX_CHARACTERS_PER_TOKEN,
                     f"{source}: char_cnn.max_characters_per_token must be 50, got {chars!r}")
            return cls(
                char_cnn=CharCNNConfig(
                    embedding_dim=cnn["embedding"]["dim"],
                    filters=tuple(tuple(f) for f in cnn["filters"]),
                    n_highway=cnn["n_highway"],
                    activation=cnn.get("activation", "relu"),
                ),
                lstm=LSTMConfig(
                    cell_dim=lstm["dim"],
                    projection_dim=lstm["projection_dim"],
                    n_layers=lstm["n_layers"],
                    cell_clip=lstm.get("cell_clip") or 0.0,
                    proj_clip=lstm.get("proj_clip") or 0.0,
                    use_skip_connections=lstm.get("use_skip_connections", False),
                ),
            )
        except KeyError as error:
            raise ConfigError(f"{source}: missing option {error.args[0]!r}") from error
        except ConfigError as error:
            message = str(error)
            raise ConfigError(message if message.startswith(source) else f"{source}: {message}") from None

    def to_options(self) -> dict[str, Any]:
        """The original options dictionary, as bilm-tf and AllenNLP read it."""
        return {
            "lstm": {
                "use_skip_connections": self.lstm.use_skip_connections,
                "projection_dim": self.lstm.projection_dim,
                "cell_clip": self.lstm.cell_clip,
                "proj_clip": self.lstm.proj_clip,
                "dim": self.lstm.cell_dim,
                "n_layers": self.lstm.n_layers,
            },
            "char_cnn": {
                "activation": self.char_cnn.activation,
                "filters": [list(f) for f in self.char_cnn.filters],
                "n_highway": self.char_cnn.n_highway,
                "embedding": {"dim": self.char_cnn.embedding_dim},
                "n_characters": N_CHARACTER_IDS,
                "max_characters_per_token": MAX_CHARACTERS_PER_TOKEN,
            },
        }


def _read_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
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
}
