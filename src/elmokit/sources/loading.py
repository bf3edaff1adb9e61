"""Loading a biLM from whichever form it comes in: the built-in model, a published name or TF-Hub
handle, original files as paths or URLs (downloaded into the cache, `elmokit.sources.download`), a native
model directory or an ELMoForManyLangs folder. The formats themselves: `elmokit.model.weights`
and `elmokit.model.manylangs`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from elmokit.devices import one_thread_in_forked_children
from elmokit.sources.download import OPTIONS_MAX_BYTES, fetch, is_url
from elmokit.sources import tfhub
from elmokit.model.bilm import BiLM
from elmokit.model.config import ConfigError, ElmoConfig, read_options
from elmokit.sources.published import expected_file, published_model, published_names
from elmokit.model.weights import WEIGHTS_NAME, check_weight_file, load_original, load_pretrained


def load_model(model: str | Path | None = None, weight_file: str | Path | None = None) -> BiLM:
    """Load a biLM from whichever form it comes in.

    * nothing, or `"gutenberg-en"`: the built-in English model shipped with elmokit;
    * `(options_file, weight_file)`: the original JSON + HDF5 pair, as paths or http(s) URLs
      (downloaded into the cache, `elmokit.sources.download`);
    * a directory: a native model directory, an ELMoForManyLangs model folder, or a TF-Hub ELMo
      module folder (`elmokit.sources.tfhub`; its `.tar.gz` too, extracted into the cache);
    * a published name (`small`, `medium`, `original`, `original-5.5B`, `pubmed`, `pt`;
      `elmokit.sources.published`) or a TF-Hub handle (`https://tfhub.dev/google/elmo/3`: the
      module TF-Hub cached for it in $TFHUB_CACHE_DIR if there is one, else the published files).

    Children forked from this process from now on run torch on one thread
    (`elmokit.devices.one_thread_in_forked_children`: forked after torch's thread pool ran, they
    would hang).
    """
    from elmokit.model.builtin import BUILTIN_MODEL, builtin_model_dir

    one_thread_in_forked_children()
    if weight_file is not None:
        if model is None:
            raise ValueError("a weight file needs its options file: give both")
        options_path = resolve_file(model, read_options, max_bytes=OPTIONS_MAX_BYTES)
        config = read_options(options_path)
        weights_path = resolve_file(weight_file, lambda path: check_weight_file(path, config, str(model)),
                                    max_bytes=weight_file_cap(config))
        return load_original(options_path, weights_path)
    if model is None or str(model) == BUILTIN_MODEL:
        return load_pretrained(builtin_model_dir())
    module = tfhub.module_folder(model)
    if module is not None:
        with tfhub.named_as_given(model, module):
            return tfhub.load_tfhub_module(module)
    path = Path(model).expanduser()  # "~/models/x" as a shell would read it (a name or URL has no "~")
    if not is_url(str(model)) and path.is_dir():
        if not (path / WEIGHTS_NAME).is_file():  # not native: perhaps an ELMoForManyLangs folder
            from elmokit.model import manylangs

            if manylangs.is_manylangs_dir(path) or manylangs.looks_like_manylangs_dir(path):
                return manylangs.load_manylangs(path)  # a file of theirs missing: the error names it
            if tfhub.looks_like_module_folder(path):
                raise FileNotFoundError(f"{path}: a TensorFlow module folder without its variables/variables.index "
                                        f"and tfhub_module.pb or saved_model.pb: incomplete ({tfhub.DOCS})")
        return load_pretrained(path)
    published = published_model(str(model))
    if published is not None:
        return load_model(published.options_url, published.weight_url)
    if is_url(str(model)):
        raise ValueError(f"{model}: a URL needs its pair (an options JSON URL with a weight file URL), or a "
                         f"published name ({', '.join(published_names())}) or TF-Hub ELMo handle")
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path} (give a model directory, an options JSON file and an "
                                f"HDF5 weight file, {BUILTIN_MODEL!r}, or a published name: "
                                f"{', '.join(published_names())})")
    raise ConfigError(f"{path}: an options file needs its weight file; give both, or a model directory")


def load_with_mix(model: str | Path | None) -> tuple[BiLM, tuple[list[float], float] | None]:
    """The biLM `model` names (as `load_model` reads it) and, for a TF-Hub module, the `elmo`
    output's trained mix (`tfhub.module_mix`; None otherwise), the module found once (an archive
    is hashed once)."""
    folder = tfhub.module_folder(model)
    if folder is None:
        return load_model(model), None
    with tfhub.named_as_given(model, folder):
        return tfhub.load_tfhub_module(folder), tfhub.module_mix(folder)


def saved_reference(reference: str | Path | None) -> str | None:
    """What a saved pipeline (a Flair tagger, a spaCy pipe, a Keras model) keeps of its model: a
    name or URL as given, a local path made absolute, so that it loads from any working directory."""
    from elmokit.model.builtin import BUILTIN_MODEL

    if reference is None:
        return None
    text = str(reference)
    if text == BUILTIN_MODEL or is_url(text) or not Path(text).expanduser().exists():  # as load_model reads them
        return text
    return str(Path(text).expanduser().resolve())


def weight_file_cap(config: ElmoConfig) -> int:
    """The most bytes an original HDF5 weight file of `config` needs, the cap on its download: its
    parameters as float32 (counted on the meta device, nothing allocated) and 1 MB for HDF5's own
    structures (`original`: 374,403,456 bytes of values in a 374,434,792-byte file)."""
    import torch

    with torch.device("meta"):
        skeleton = BiLM(config)
    return 4 * sum(parameter.numel() for parameter in skeleton.parameters()) + 1_000_000


def resolve_file(reference: str | Path, check: Callable[[Path], object] | None = None,
                 max_bytes: int | None = None, repair: bool = False) -> Path:
    """A local path for a file given as a path or an http(s) URL (downloaded into the cache,
    `check`ed and held to its published size and hash before it enters it, at most `max_bytes`
    where no size is published; `repair`: a broken cached copy is downloaded again)."""
    if is_url(str(reference)):
        return fetch(str(reference), check, expected=expected_file(str(reference)), max_bytes=max_bytes,
                     repair=repair)
    return Path(reference).expanduser()
