"""A TF-Hub ELMo module on disk, loaded without TensorFlow: the folder (google/elmo/1, 2, 3 as
`?tf-hub-format=compressed` serves them and TF-Hub caches them), its `.tar.gz`, or the copy
TF-Hub left in its cache for a handle.

    folder = module_folder("elmo_3/")          # a folder, a .tar.gz, a cached handle; else None
    bilm = load_tfhub_module(folder)           # the biLM, from variables/variables.*
    weights, scaling = module_mix(folder)      # the `elmo` output's trained mix

A module folder holds `tfhub_module.pb` and `saved_model.pb` (the graph, not read here) and its
weights in TensorFlow's checkpoint format (`elmokit.model.tf_bundle`), named as bilm-tf's
inference graph names them under `bilm/`: `char_embed` (262 rows: a zero row for "no token"
before the 261 of the HDF5 file), `CNN/W_cnn_i`, `CNN_high_k/...`, `CNN_proj/...`, and per
direction d and layer l `RNN_d/RNN/MultiRNNCell/Cell{l}/rnn/lstm_cell/{kernel,bias,projection/kernel}`
(the HDF5 file's `LSTMCell/{W_0,B,W_P_0}`, names also accepted); `aggregation/weights` (L+1)
and `aggregation/scaling` are the module's `elmo` mix, `scaling * sum softmax(weights)_j h_j`.

The architecture comes from the variables' shapes. What no variable holds comes from the
published model of that shape (`elmokit.model.config.PRESETS`: the google/elmo modules are the
`original` biLM) or, for another shape, from bilm-tf's options that every published ELMo uses:
cell and projection clips 3, relu, 50 characters a token (docs/loading.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from elmokit.model.bilm import BiLM
from elmokit.model.config import PRESETS, CharCNNConfig, ConfigError, ElmoConfig, LSTMConfig
from elmokit.model.errors import WeightFileError
from elmokit.model.tf_bundle import BundleEntry, read_index, read_tensors
from elmokit.model.weights import expected_datasets, native_from_original

VARIABLES = Path("variables") / "variables"  # the checkpoint prefix inside a module folder
GRAPH_FILES = ("tfhub_module.pb", "saved_model.pb")
DOCS = "docs/loading.md, 'A TF-Hub module on disk'"
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
MAX_ARCHIVE_MEMBERS = 1000  # a module is a handful of files
_LSTM_NAME = re.compile(r"bilm/RNN_([01])/RNN/MultiRNNCell/Cell(\d+)/"
                        r"(?:rnn/lstm_cell/(kernel|bias|projection/kernel)|LSTMCell/(W_0|B|W_P_0))")
_LSTM_PARTS = {"kernel": "W_0", "bias": "B", "projection/kernel": "W_P_0"}
# What bilm-tf's options give every published ELMo and no variable holds.
PUBLISHED_CLIPS = {"cell_clip": 3.0, "proj_clip": 3.0}


# ---------------------------------------------------------------------------------------------
# Finding the folder
# ---------------------------------------------------------------------------------------------
def is_module_folder(path: Path) -> bool:
    """A folder as TF-Hub writes a module (or a SavedModel): a graph file and a checkpoint."""
    return (path.is_dir() and (path / VARIABLES.with_name("variables.index")).is_file()
            and any((path / name).is_file() for name in GRAPH_FILES))


def looks_like_module_folder(path: Path) -> bool:
    """A folder with a TF-Hub or SavedModel graph file, whole or not (for error messages)."""
    return path.is_dir() and any((path / name).exists() for name in (*GRAPH_FILES, "variables"))


def advice(path: Path) -> str:
    """For a TF-Hub module folder met where a native directory is needed: what reads it."""
    if not looks_like_module_folder(path):
        return ""
    return ("; it is a TensorFlow (TF-Hub) module folder: load_model, hub.Module and every --model read one, "
            f"and `elmo convert --model {path} --to-native DIR` writes a native directory ({DOCS})")


def is_module_archive(path: Path) -> bool:
    return path.is_file() and path.name.lower().endswith(ARCHIVE_SUFFIXES)


def tfhub_cache_dir() -> Path:
    """Where TF-Hub caches modules: $TFHUB_CACHE_DIR, else <the temporary folder>/tfhub_modules."""
    return Path(os.environ.get("TFHUB_CACHE_DIR") or Path(tempfile.gettempdir()) / "tfhub_modules")


def cached_module(handle: str) -> Path | None:
    """The module TF-Hub cached for `handle` (its folder is the SHA-1 of the handle exactly as
    given), if a whole one is there."""
    folder = tfhub_cache_dir() / hashlib.sha1(handle.encode("utf-8")).hexdigest()
    return folder if is_module_folder(folder) else None


def module_folder(reference: str | Path | None) -> Path | None:
    """The TF-Hub module folder `reference` names: a module folder, a module archive (extracted
    into elmokit's cache once, `extract_module_archive`), or a TF-Hub handle whose module is in
    TF-Hub's cache; None for anything else."""
    if reference is None:
        return None
    text = str(reference)
    if "://" in text:
        return cached_module(text)
    path = Path(text).expanduser()
    if is_module_folder(path):
        return path
    if is_module_archive(path):
        return extract_module_archive(path)
    return None


@contextlib.contextmanager
def named_as_given(given: str | Path | None, folder: Path):
    """Errors of reading `folder` name what the user gave first, where that was an archive or a
    handle (the folder is then elmokit's or TF-Hub's cache, a name they never wrote)."""
    try:
        yield
    except WeightFileError as error:
        if given is None or Path(str(given)) == folder:
            raise
        raise WeightFileError(f"{given} (read from {error})") from None


# ---------------------------------------------------------------------------------------------
# Reading the variables
# ---------------------------------------------------------------------------------------------
def _hdf5_name(name: str) -> str | None:
    """The original HDF5 file's name of a module variable, or None if it is not the biLM's."""
    match = _LSTM_NAME.fullmatch(name)
    if match:
        direction, layer, tf_part, hdf5_part = match.groups()
        return f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell/{hdf5_part or _LSTM_PARTS[tf_part]}"
    if name == "bilm/char_embed" or re.fullmatch(r"bilm/CNN(_high_\d+|_proj)?/[Wb]_\w+", name):
        return name.removeprefix("bilm/")
    return None


def _not_elmo(folder: Path, entries: dict[str, BundleEntry], missing: str) -> WeightFileError:
    found = ", ".join(f"{name} {list(entry.shape)}" for name, entry in list(entries.items())[:8])
    more = f" and {len(entries) - 8} more" if len(entries) > 8 else ""
    return WeightFileError(f"{folder}: a TensorFlow module, but not an ELMo module: no {missing} among its "
                           f"{len(entries)} variables ({found}{more}); an ELMo module holds bilm/char_embed, "
                           f"bilm/CNN/W_cnn_0, ..., bilm/RNN_0/... ({DOCS})")


def _variable_shape(entries: dict[str, BundleEntry], name: str) -> tuple[int, ...]:
    return entries[name].shape


def module_config(folder: Path, variables: dict[str, BundleEntry]) -> ElmoConfig:
    """The biLM's shape from its variables' shapes (`variables`: HDF5 name -> entry); the clips
    from the published model of that shape, else bilm-tf's published options."""
    rows, embedding_dim = (_variable_shape(variables, "char_embed") + (0, 0))[:2]
    if len(_variable_shape(variables, "char_embed")) != 2 or rows not in (261, 262):
        raise WeightFileError(f"{folder}: bilm/char_embed has shape {list(_variable_shape(variables, 'char_embed'))}, "
                              "expected (262, E) or (261, E): 261 character ids (+ a row for 'no token')")
    filters, highways, layers = [], 0, 0
    while f"CNN/W_cnn_{len(filters)}" in variables:
        shape = _variable_shape(variables, f"CNN/W_cnn_{len(filters)}")
        if len(shape) != 4:
            raise WeightFileError(f"{folder}: bilm/CNN/W_cnn_{len(filters)} has shape {list(shape)}, expected "
                                  "(1, width, E, filters)")
        filters.append((shape[1], shape[3]))
    while f"CNN_high_{highways}/W_carry" in variables:
        highways += 1
    while f"RNN_0/RNN/MultiRNNCell/Cell{layers}/LSTMCell/W_0" in variables:
        layers += 1
    for needed, count in (("bilm/CNN/W_cnn_0", len(filters)), ("bilm/RNN_0/RNN/MultiRNNCell/Cell0", layers)):
        if count == 0:
            raise WeightFileError(f"{folder}: no {needed} variable: not an ELMo module ({DOCS})")
    if "CNN_proj/W_proj" not in variables or len(_variable_shape(variables, "CNN_proj/W_proj")) != 2:
        raise WeightFileError(f"{folder}: no bilm/CNN_proj/W_proj (F, P) variable: not an ELMo module ({DOCS})")
    kernel = _variable_shape(variables, "RNN_0/RNN/MultiRNNCell/Cell0/LSTMCell/W_0")
    if len(kernel) != 2 or kernel[1] % 4:
        raise WeightFileError(f"{folder}: its LSTM kernel has shape {list(kernel)}, expected (2P, 4C)")
    try:
        char_cnn = CharCNNConfig(embedding_dim, tuple(filters), highways)
        shape = ElmoConfig(char_cnn, LSTMConfig(kernel[1] // 4, _variable_shape(variables, "CNN_proj/W_proj")[1], layers))
    except ConfigError as error:
        raise WeightFileError(f"{folder}: its variables' shapes are not an ELMo biLM's: {error}") from None
    for preset in PRESETS.values():  # a published shape: its options
        if _same_variable_shape(preset, shape):
            return ElmoConfig(char_cnn, LSTMConfig(shape.lstm.cell_dim, shape.lstm.projection_dim, layers,
                                                   preset.lstm.cell_clip, preset.lstm.proj_clip))
    return ElmoConfig(char_cnn, LSTMConfig(shape.lstm.cell_dim, shape.lstm.projection_dim, layers, **PUBLISHED_CLIPS))


def _same_variable_shape(a: ElmoConfig, b: ElmoConfig) -> bool:
    return (a.char_cnn == b.char_cnn and (a.lstm.cell_dim, a.lstm.projection_dim, a.lstm.n_layers)
            == (b.lstm.cell_dim, b.lstm.projection_dim, b.lstm.n_layers))


def _variables(folder: Path) -> tuple[dict[str, BundleEntry], dict[str, str]]:
    """The checkpoint's entries, and HDF5 name -> module name of the biLM's variables."""
    entries = read_index(folder / VARIABLES.with_name("variables.index"))
    names: dict[str, str] = {}
    for name in entries:
        hdf5 = _hdf5_name(name)
        if hdf5 is not None:
            if hdf5 in names:
                raise WeightFileError(f"{folder}: {names[hdf5]} and {name} are the same weight under two names")
            names[hdf5] = name
    if "char_embed" not in names:
        raise _not_elmo(folder, entries, "bilm/char_embed")
    return entries, names


def read_module(folder: str | Path) -> tuple[ElmoConfig, dict[str, np.ndarray]]:
    """The biLM's config and its weights as the original HDF5 file names them (float32, the
    261-row char table), checked against the shapes the config implies before any is read."""
    folder = Path(folder)
    entries, names = _variables(folder)
    variables = {hdf5: entries[name] for hdf5, name in names.items()}
    config = module_config(folder, variables)
    expected = expected_datasets(config)
    extra = sorted(names[hdf5] for hdf5 in set(names) - set(expected))
    missing = sorted(set(expected) - set(names))
    if missing or extra:
        raise WeightFileError(f"{folder}: its variables do not make one biLM of the shape they imply: "
                              + (f"missing {missing}" if missing else "") + ("; " if missing and extra else "")
                              + (f"unexpected {extra}" if extra else ""))
    for hdf5, shape in expected.items():
        found = variables[hdf5].shape
        if found != shape and not (hdf5 == "char_embed" and found == (shape[0] + 1, shape[1])):
            raise WeightFileError(f"{folder}: {names[hdf5]} has shape {list(found)}, but the other variables "
                                  f"imply {list(shape)}")
    arrays = read_tensors(folder / VARIABLES, entries, [names[hdf5] for hdf5 in expected])
    arrays = {hdf5: arrays[names[hdf5]] for hdf5 in expected}
    if arrays["char_embed"].shape[0] == 262:  # bilm-tf's inference table: row 0 is "no token"
        arrays["char_embed"] = arrays["char_embed"][1:]
    return config, arrays


def load_tfhub_module(folder: str | Path) -> BiLM:
    """The biLM of a TF-Hub ELMo module folder (see the module docstring)."""
    config, arrays = read_module(folder)
    model = BiLM(config)
    model.load_state_dict(native_from_original(arrays, config))
    return model.eval()


def module_mix(folder: str | Path) -> tuple[list[float], float] | None:
    """The module's `elmo` mix, (`aggregation/weights` before their softmax, `aggregation/scaling`),
    or None if it has none; WeightFileError for one without the other."""
    folder = Path(folder)
    entries, names = _variables(folder)
    present = [name for name in ("aggregation/weights", "aggregation/scaling") if name in entries]
    if len(present) == 1:  # half a mix: its `elmo` output would silently be another one
        missing = ({"aggregation/weights", "aggregation/scaling"} - set(present)).pop()
        raise WeightFileError(f"{folder}: the module has {present[0]} but no {missing}: its `elmo` output's mix "
                              f"is incomplete (a TF-Hub ELMo module holds both)")
    if not present:
        return None
    arrays = read_tensors(folder / VARIABLES, entries, ["aggregation/weights", "aggregation/scaling"])
    weights, scaling = arrays["aggregation/weights"].reshape(-1), arrays["aggregation/scaling"].reshape(-1)
    if scaling.size != 1:
        raise WeightFileError(f"{folder}: aggregation/scaling has shape {list(entries['aggregation/scaling'].shape)}, "
                              "expected a scalar")
    n_outputs = module_config(folder, {hdf5: entries[name] for hdf5, name in names.items()}).n_output_layers
    if weights.size != n_outputs:
        raise WeightFileError(f"{folder}: aggregation/weights holds {weights.size} weights, expected one a layer of "
                              f"the module's biLM, {n_outputs}")
    return [float(w) for w in weights], float(scaling[0])


def module_provenance(folder: str | Path, given: str | Path | None = None) -> dict:
    """What a conversion records of the module it read: the folder (and the archive `given`, when
    the folder is its extraction), the handle TF-Hub cached it for (its `<hash>.descriptor.txt`),
    the checkpoint index's SHA-256 and the module's mix."""
    folder = Path(folder).resolve()
    record = {"converted_from": "TF-Hub module", "module_folder": str(folder),
              "variables_index_sha256": hashlib.sha256((folder / VARIABLES.with_name("variables.index"))
                                                       .read_bytes()).hexdigest()}
    if given is not None and is_module_archive(Path(given).expanduser()):
        record["module_archive"] = str(Path(given).expanduser().resolve())
    descriptor = folder.with_name(folder.name + ".descriptor.txt")
    if descriptor.is_file():
        for line in descriptor.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Module: "):
                record["tfhub_handle"] = line.removeprefix("Module: ").strip()
    mix = module_mix(folder)
    if mix is not None:
        record["elmo_mix"] = {"weights": mix[0], "scaling": mix[1],
                              "formula": "scaling * sum_j softmax(weights)_j * layer_j"}
    return record


# ---------------------------------------------------------------------------------------------
# A module's .tar.gz, extracted safely
# ---------------------------------------------------------------------------------------------
def max_archive_bytes() -> int:
    """The most bytes a module archive may unpack to: the download cap (ELMOKIT_MAX_DOWNLOAD_GB)."""
    from elmokit.sources.download import max_download_bytes

    return max_download_bytes()


def extract_module_archive(archive: Path) -> Path:
    """The module folder of a TF-Hub module archive, extracted once into elmokit's cache
    (`<cache>/tfhub/<SHA-256 of the archive>`). Refused before anything is written: a member whose
    path leaves the folder (absolute, `..`), a link or device, more than MAX_ARCHIVE_MEMBERS
    members or more bytes than `max_archive_bytes`; the folder is staged and renamed into place."""
    from elmokit.sources.cache import cache_dir

    digest = hashlib.sha256()
    with open(archive, "rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    target = cache_dir() / "tfhub" / digest.hexdigest()
    if is_module_folder(target):
        return target
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = _checked_members(archive, tar)
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
            try:
                for member in members:
                    destination = staging / member.name
                    if member.isdir():
                        destination.mkdir(parents=True, exist_ok=True)
                        continue
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(member) as source, open(destination, "wb") as out:
                        shutil.copyfileobj(source, out)
                staging.chmod(0o755)
                if not is_module_folder(staging):
                    raise WeightFileError(f"{archive}: not a TF-Hub module archive (no variables/variables.index "
                                          f"with a tfhub_module.pb or saved_model.pb; {DOCS})")
                try:
                    staging.rename(target)
                except OSError:  # another process extracted it first
                    if not is_module_folder(target):
                        raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except (tarfile.TarError, EOFError, OSError) as error:
        if isinstance(error, WeightFileError):
            raise
        raise WeightFileError(f"{archive}: not a readable module archive ({error})") from None
    return target


def _checked_members(archive: Path, tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    members, total, cap = [], 0, max_archive_bytes()
    for member in tar:
        if len(members) >= MAX_ARCHIVE_MEMBERS:
            raise WeightFileError(f"{archive}: more than {MAX_ARCHIVE_MEMBERS} members: not a TF-Hub module")
        name = member.name.removeprefix("./")
        parts = Path(name).parts
        if name.startswith("/") or ".." in parts or (parts and parts[0].endswith(":")):
            raise WeightFileError(f"{archive}: member {member.name!r} would be written outside the module folder")
        if not (member.isfile() or member.isdir()):
            kind = "a link" if member.issym() or member.islnk() else "not a file or folder"
            raise WeightFileError(f"{archive}: member {member.name!r} is {kind}; a module archive holds files only")
        total += member.size
        if total > cap:
            raise WeightFileError(f"{archive}: its members hold more than {cap:,} bytes "
                                  "(ELMOKIT_MAX_DOWNLOAD_GB): refused before extracting")
        if name and name != ".":
            member.name = name
            members.append(member)
    return members
