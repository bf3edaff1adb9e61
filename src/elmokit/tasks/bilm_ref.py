"""Which biLM a task run reads, recorded so that the run still finds it after it moves.

A run's task_config.json holds a `bilm` record:

    {"name": "gutenberg-en", "fingerprint": F}          the built-in model, or a published name:
                                                        found by name wherever elmokit is installed
    {"path": "../bilm", "absolute_path": "/x/bilm",     a directory given by path: relative to the
     "fingerprint": F}                                  run directory (they may move together), and
                                                        where it was when the run was trained
    {"path": "/x/bilm", "fingerprint": F}               a run written before names were recorded

F is the first 16 hex digits of `model_fingerprint` (config and every weight). Whatever points at
the biLM (the record, `bilm=` in `elmokit.tasks.load`, `--model` of `elmo task eval|predict`),
the biLM found must have that fingerprint: a different model is an error, never other vectors.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import torch

from elmokit.sources.download import OPTIONS_MAX_BYTES
from elmokit.model.bilm import BiLM
from elmokit.model.builtin import BUILTIN_MODEL, builtin_model_dir
from elmokit.model.config import read_options
from elmokit.sources.loading import load_model, resolve_file
from elmokit.sources.published import published_model
from elmokit.model.weights import model_fingerprint

FINGERPRINT_DIGITS = 16


class BiLMMismatchError(ValueError):
    """The biLM found is not the one a task run was trained with (another fingerprint)."""


def short_fingerprint(bilm: BiLM) -> str:
    return model_fingerprint(bilm)[:FINGERPRINT_DIGITS]


def open_bilm(model: str | Path) -> BiLM:
    """The biLM `model` names: gutenberg-en (the built-in model of this installation), a published
    name or URL, or a model directory: whatever `elmokit.sources.loading.load_model` accepts."""
    return load_model(model)


def is_name(model: str) -> bool:
    """Whether `load_model` reads `model` as a name (the built-in model, a published name, a URL)
    rather than as a path: a name is recorded as it is, and found by name wherever the run goes."""
    return model == BUILTIN_MODEL or published_model(model) is not None or not Path(model).expanduser().exists()


def _builtin_dir() -> Path | None:
    try:
        return builtin_model_dir().resolve()
    except FileNotFoundError:
        return None


def bilm_record(model: str, bilm: BiLM, run_dir: Path) -> dict:
    """The record of the biLM `model` (as the user gave it) for a run written to `run_dir`."""
    fingerprint = short_fingerprint(bilm)
    if is_name(str(model)):
        return {"name": str(model), "fingerprint": fingerprint}
    resolved = Path(model).expanduser().resolve()
    if resolved == _builtin_dir():  # the built-in model given by its path: a name travels better
        return {"name": BUILTIN_MODEL, "fingerprint": fingerprint}
    try:
        relative = os.path.relpath(resolved, Path(run_dir).resolve())
    except ValueError:  # another drive (Windows): no relative path
        relative = str(resolved)
    return {"path": relative, "absolute_path": str(resolved), "fingerprint": fingerprint}


def describe(record: dict) -> str:
    """How a record names its biLM, for messages and model cards."""
    if "name" in record:
        return f"{record['name']} (fingerprint {record['fingerprint']})"
    return f"{record.get('absolute_path') or record['path']} (fingerprint {record['fingerprint']})"


def _candidates(record: dict, run_dir: Path) -> list[Path]:
    places = [run_dir / record["path"]]  # an absolute path stays itself
    if record.get("absolute_path"):
        places.append(Path(record["absolute_path"]))
    return list(dict.fromkeys(places))


def find_bilm(record: dict, run_dir: Path, bilm: str | Path | BiLM | None = None,
              fits: Callable[[BiLM], None] | None = None) -> BiLM:
    """The biLM of a run: `bilm` (a BiLM, or a name or directory) where it is given, else the one
    its record names; checked against the record's fingerprint.

    What can be checked before a download is checked first: the fingerprint's form, and, for a
    published name, whether the task model can read vectors of its shape (`fits` raises if not; it
    is given a weightless biLM built on the meta device from the options file, a few hundred
    bytes), so that an edited record never downloads hundreds of MB only to be refused."""
    expected = record.get("fingerprint")
    if expected is not None and not re.fullmatch(f"[0-9a-f]{{{FINGERPRINT_DIGITS}}}", str(expected)):
        raise BiLMMismatchError(f"{run_dir}: the bilm record's fingerprint must be {FINGERPRINT_DIGITS} hex digits, "
                                f"got {str(expected)[:40]!r}; was task_config.json edited?")
    if bilm is None and "name" in record and fits is not None:
        _check_shape_first(record["name"], run_dir, fits)
    if isinstance(bilm, BiLM):
        found, where = bilm, "the biLM given"
    elif bilm is not None:
        found, where = open_bilm(bilm), str(bilm)
    elif "name" in record:
        try:
            found = open_bilm(record["name"])
        except FileNotFoundError as error:
            raise FileNotFoundError(f"{run_dir}: this run reads the biLM {record['name']!r}, which is not "
                                    f"available here ({error}); give it with bilm= (elmokit.tasks.load) or "
                                    "--model (elmo task eval|predict)") from None
        where = record["name"]
    else:
        places = _candidates(record, run_dir)
        existing = [place for place in places if place.exists()]
        if not existing:
            raise FileNotFoundError(f"{run_dir}: the biLM this run was trained with is missing: not at "
                                    f"{' nor '.join(str(p) for p in places)}; give its directory with bilm= "
                                    "(elmokit.tasks.load) or --model (elmo task eval|predict)")
        found, where = load_model(existing[0]), str(existing[0].resolve())
    check_fingerprint(found, record.get("fingerprint"), where, run_dir)
    return found


def _check_shape_first(name: str, run_dir: Path, fits: Callable[[BiLM], None]) -> None:
    """Refuse a published name whose shape the task model cannot read, from its options file alone."""
    published = published_model(name)
    if published is None:
        return
    config = read_options(resolve_file(published.options_url, read_options, max_bytes=OPTIONS_MAX_BYTES))
    with torch.device("meta"):  # the shape alone: no memory, no weights
        shape = BiLM(config)
    try:
        fits(shape)
    except (ValueError, OSError) as error:
        raise BiLMMismatchError(f"{run_dir}: the biLM {name!r} its record names cannot be the one this run was "
                                f"trained with (its shape does not fit the task model: {str(error)[:300]}); its weights "
                                "were not downloaded; was task_config.json edited?") from None


def check_fingerprint(bilm: BiLM, expected: str | None, where: str, run_dir: Path) -> None:
    if expected is None:  # a run from before fingerprints were recorded
        return
    actual = short_fingerprint(bilm)
    if actual != expected:
        raise BiLMMismatchError(
            f"{run_dir}: the biLM at {where} is not the one this run was trained with (fingerprint "
            f"{expected} then, {actual} now; it changed since this run was trained, or is another model): the "
            "task model would read other vectors than it learned from; give the original biLM, or train "
            "the task model again")
