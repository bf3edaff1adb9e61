"""The English model that ships inside the package (trained by elmokit on Project Gutenberg)."""

from __future__ import annotations

from pathlib import Path

BUILTIN_MODEL = "gutenberg-en"
MODELS_DIR = Path(__file__).resolve().parents[1] / "models"  # elmokit/models/


def builtin_model_dir() -> Path:
    """The directory of the built-in model (native format: config.json + model.safetensors)."""
    directory = MODELS_DIR / BUILTIN_MODEL
    if not (directory / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the built-in model is not in this installation ({directory}); "
            "give a model directory, or an options JSON file and an HDF5 weight file"
        )
    return directory
