"""The Hugging Face Hub's conventions for elmokit's native model folders: `save_pretrained`,
`from_pretrained` and `push_to_hub` (huggingface_hub's `ModelHubMixin`), and the model card with
the Hub's metadata block that every folder written for the Hub carries.

    from elmokit.integrations.huggingface import HuggingFaceBiLM
    bilm = HuggingFaceBiLM.from_pretrained()                   # the built-in model; or "original", a folder, a URL...
    bilm = HuggingFaceBiLM.from_pretrained("user/elmo-repo")   # a Hub repository (downloaded into the HF cache)
    bilm.save_pretrained("my-elmo")                    # config.json, model.safetensors, provenance.json, README.md
    bilm.push_to_hub("user/my-elmo")                   # the same files, one commit (needs `hf auth login`)

A `HuggingFaceBiLM` is a `BiLM` (everything that takes one takes it: `ElmoEmbedder(module=bilm)`,
`Elmo(module=...)`), and its folder is elmokit's native one, so `elmo embed --model my-elmo` and
`elmokit.load_model("my-elmo")` read what `save_pretrained` wrote. The card (README.md) is
elmokit's model card (`elmokit.training.model_card`) under a YAML block the Hub reads: library,
tags, pipeline, license, and where the biLM came from (its source and fingerprint).

Needs huggingface_hub (the `sentence-transformers` extra).
"""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from elmokit.extras import require

require("sentence-transformers", "elmokit.integrations.huggingface", ("huggingface_hub",))

from huggingface_hub import ModelCard, ModelCardData, ModelHubMixin, snapshot_download  # noqa: E402
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError  # noqa: E402

from elmokit.sources.download import is_url, mirrored  # noqa: E402
from elmokit.io import atomic_write_text  # noqa: E402
from elmokit.model.bilm import BiLM  # noqa: E402
from elmokit.model.builtin import BUILTIN_MODEL, builtin_model_dir  # noqa: E402
from elmokit.sources.loading import load_model  # noqa: E402
from elmokit.sources.published import published_model  # noqa: E402
from elmokit.model.weights import (  # noqa: E402
    CONFIG_NAME,
    PROVENANCE_NAME,
    WEIGHTS_NAME,
    WeightFileError,
    load_pretrained,
    model_fingerprint,
    read_provenance,
    save_pretrained,
)
from elmokit.training.model_card import CARD_NAME, bilm_card, markdown_table, software_versions  # noqa: E402

__all__ = ["HuggingFaceBiLM", "hub_card", "model_provenance"]

REPO_URL = "https://github.com/elmokit/elmokit"
HUB_FILES = (CONFIG_NAME, WEIGHTS_NAME, PROVENANCE_NAME, CARD_NAME)
"""What a native folder on the Hub holds, and what `from_pretrained` downloads of a repository."""
BUILTIN_LICENSE = "apache-2.0"  # the built-in model ships inside elmokit, under elmokit's license
UNKNOWN_LICENSE = "unknown"  # the Hub's value for a license nobody recorded


# ---------------------------------------------------------------------------------------------
# Provenance and the card
# ---------------------------------------------------------------------------------------------
def model_provenance(reference: str | Path | None, bilm: BiLM, license: str | None = None) -> dict[str, Any]:
    """Where a biLM loaded from `reference` (as `elmokit.load_model` takes it; None: the built-in
    model) came from, for its card: the folder's provenance.json if it has one (training files,
    tokens, perplexity), a published model's URLs, the reference itself (a local folder by its
    name), the license (`license`, else Apache-2.0 for the built-in model, else "unknown") and
    `model_fingerprint` (the sha256 of its config and weights that task runs record); no absolute
    path of this machine (`without_local_paths`)."""
    name = BUILTIN_MODEL if reference is None else str(reference)
    folder = builtin_model_dir() if name == BUILTIN_MODEL else Path(name)
    recorded = read_provenance(folder) if not is_url(name) and folder.is_dir() else {}
    published = None if folder.exists() else published_model(name)
    local = folder.exists() and not is_url(name)
    source = {"source": f"a local folder named {folder.resolve().name}" if local else name}
    if name == BUILTIN_MODEL:
        source = {"source": f"{BUILTIN_MODEL} (the built-in model of elmokit)"}
    if published is not None:
        served = {"options_url": mirrored(published.options_url), "weight_url": mirrored(published.weight_url)}
        if served["weight_url"] != published.weight_url:  # ELMOKIT_MIRROR's files: nothing ties them to the
            # published ones (no hash is published), so the card names the mirror, not the published model
            source.update(source=f"{name} as served by the mirror ELMOKIT_MIRROR (not checked against the published "
                                 f"files: no hash of them is published)", **served)
        else:
            source.update(published=published.name, options_url=published.options_url,
                          weight_url=published.weight_url, description=published.description)
    given = license or recorded.get("license") or (BUILTIN_LICENSE if name == BUILTIN_MODEL else UNKNOWN_LICENSE)
    return without_local_paths({**recorded, **source, "license": given, "elmokit_fingerprint": model_fingerprint(bilm)})


def without_local_paths(value: Any) -> Any:
    """`value` (provenance: strings, lists, dicts) with every absolute path of the machine that
    wrote it ("/root/runs/train/*.txt.gz", "C:\\data\\vocab.txt", "~/x") cut to its last part
    ("*.txt.gz"): a card and provenance.json meant for the Hub name files, never the builder's folders."""
    if isinstance(value, dict):
        return {key: without_local_paths(item) for key, item in value.items()}
    if isinstance(value, list):
        return [without_local_paths(item) for item in value]
    if isinstance(value, str) and (value.startswith(("/", "~")) or PureWindowsPath(value).is_absolute()):
        return (PureWindowsPath(value) if "\\" in value else PurePosixPath(value)).name or value
    return value


def hub_card(bilm: BiLM, provenance: dict[str, Any], files: dict[str, str], *, library_name: str,
             tags: list[str], pipeline_tag: str, usage: list[str]) -> str:
    """README.md for the Hub: a YAML metadata block (library_name, tags, pipeline_tag, license,
    and the biLM's source and fingerprint), elmokit's model card of `bilm`, `usage` (Markdown
    lines: how to load the folder with `library_name`, first in its "Use it" section), and the
    provenance as a table; absolute local paths cut to their names (`without_local_paths`)."""
    provenance = without_local_paths(provenance)
    metadata = ModelCardData(library_name=library_name, tags=sorted(set(tags)), pipeline_tag=pipeline_tag,
                             license=provenance.get("license", UNKNOWN_LICENSE),
                             elmo_source=provenance.get("source"),
                             elmo_fingerprint=provenance.get("elmokit_fingerprint"))
    n_parameters = bilm.n_parameters
    body = bilm_card(bilm.config, {**provenance, **software_versions()}, n_parameters, files, usage=usage)
    scalars = [(key, value) for key, value in sorted(provenance.items())
               if isinstance(value, (str, int, float, bool)) and key != "license"]
    text = [body.rstrip("\n"), "", "## Provenance", "",
            f"License of the weights: `{provenance.get('license', UNKNOWN_LICENSE)}`.", "",
            markdown_table(("key", "value"), scalars) if scalars else "Not recorded."]
    return str(ModelCard(f"---\n{metadata.to_yaml()}\n---\n" + "\n".join(text)))


NATIVE_USAGE = [
    "From the Hugging Face Hub:", "",
    "```python",
    "from elmokit.integrations.huggingface import HuggingFaceBiLM  # pip install 'elmokit[sentence-transformers]'",
    "from elmokit import ElmoEmbedder", "",
    'bilm = HuggingFaceBiLM.from_pretrained("REPO_ID")  # downloaded into the Hugging Face cache',
    'layers = ElmoEmbedder(module=bilm).embed_sentence(["The", "cat", "sat"])  # (layers, tokens, dims)',
    "```",
]


# ---------------------------------------------------------------------------------------------
# The mixin
# ---------------------------------------------------------------------------------------------
class HuggingFaceBiLM(BiLM, ModelHubMixin, library_name="elmokit", tags=["elmo", "elmokit", "feature-extraction"],
              pipeline_tag="feature-extraction", repo_url=REPO_URL):
    """A `BiLM` with huggingface_hub's `save_pretrained`, `from_pretrained` and `push_to_hub`.

    The folder is elmokit's native layout (config.json, model.safetensors) with provenance.json
    and a model card (`hub_card`). `provenance` (a dict) is what the card records of where the
    weights came from; `from_pretrained` fills it.
    """

    provenance: dict[str, Any]

    @classmethod
    def from_bilm(cls, bilm: BiLM, provenance: dict[str, Any] | None = None) -> HuggingFaceBiLM:
        """The same weights (copied) as a HuggingFaceBiLM, in eval mode on `bilm`'s device. An
        ELMoForManyLangs biLM (its own vocabulary and class) is refused: TypeError."""
        if type(bilm) is not BiLM and not isinstance(bilm, cls):
            raise TypeError(f"HuggingFaceBiLM holds an ELMo BiLM; got a {type(bilm).__name__} (an ELMoForManyLangs model "
                            "keeps a vocabulary of its own: save it with elmokit.save_pretrained and upload that folder)")
        device = next(bilm.parameters()).device
        hub = cls(bilm.config).to(device)  # (a non-persistent buffer rules out building on "meta")
        hub.load_state_dict(bilm.state_dict())
        hub.provenance = dict(provenance) if provenance is not None else {"license": UNKNOWN_LICENSE}
        return hub.eval()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path | None = None, *,
                        license: str | None = None, **hub_kwargs) -> HuggingFaceBiLM:
        """Load a biLM: any reference `elmokit.load_model` takes (None: the built-in model; a
        published name, a TF-Hub handle, a local folder), else a Hugging Face Hub repository id
        ("user/name"), downloaded by huggingface_hub (`revision=`, `cache_dir=`, `token=`,
        `local_files_only=`, ... as `ModelHubMixin.from_pretrained` takes them). `license` is
        recorded on the card when the source records none."""
        reference = pretrained_model_name_or_path
        if reference is None or _is_elmokit_reference(str(reference)):
            if hub_kwargs:
                raise TypeError(f"{sorted(hub_kwargs)} apply to a Hub repository; {reference!r} is loaded by elmokit")
            bilm = load_model(None if reference is None else str(reference))
            return cls.from_bilm(bilm, model_provenance(reference, bilm, license))
        if isinstance(reference, Path) or str(reference).startswith(("/", "./", "../")) \
                or str(reference).count("/") > 1 or "\\" in str(reference):  # a path: no Hub id has this form
            raise FileNotFoundError(f"no model folder {str(reference)!r} (a Hugging Face Hub repository id is "
                                    f"'user/name')")
        try:
            hub = super().from_pretrained(str(reference), **hub_kwargs)
        except (RepositoryNotFoundError, HFValidationError, LocalEntryNotFoundError) as error:  # a mistyped folder too
            raise FileNotFoundError(f"{str(reference)!r}: no model folder here, and the Hugging Face Hub did not give "
                                    f"such a repository ({type(error).__name__}: {str(error)[:200]})") from None
        if license is not None and hub.provenance.get("license", UNKNOWN_LICENSE) == UNKNOWN_LICENSE:
            hub.provenance["license"] = license
        return hub

    def _save_pretrained(self, save_directory: Path) -> None:
        """elmokit's native folder (config.json, model.safetensors), provenance.json and README.md."""
        save_pretrained(self, save_directory)
        provenance = {**getattr(self, "provenance", {}), "elmokit_fingerprint": model_fingerprint(self)}
        provenance.setdefault("license", UNKNOWN_LICENSE)
        atomic_write_text(save_directory / PROVENANCE_NAME, json.dumps(provenance, indent=2) + "\n")
        files = {CONFIG_NAME: "the shapes (ElmoConfig)", WEIGHTS_NAME: "the weights of the biLM",
                 PROVENANCE_NAME: "where the weights came from: source, training record, fingerprint"}
        atomic_write_text(save_directory / CARD_NAME, hub_card(
            self, provenance, files, library_name="elmokit", tags=list(self._hub_mixin_info.model_card_data.tags),
            pipeline_tag="feature-extraction", usage=NATIVE_USAGE))

    @classmethod
    def _from_pretrained(cls, *, model_id: str, revision: str | None, cache_dir: str | Path | None,
                         force_download: bool, proxies: dict | None, resume_download: bool | None,
                         local_files_only: bool, token: str | bool | None, **model_kwargs) -> HuggingFaceBiLM:
        """(huggingface_hub's hook) The folder of `model_id` (a local folder, or the repository's
        `HUB_FILES` downloaded with `snapshot_download`) read by elmokit's `load_pretrained`."""
        if os.path.isdir(model_id):
            directory = Path(model_id)
        else:
            directory = Path(snapshot_download(repo_id=model_id, revision=revision, cache_dir=cache_dir,
                                               force_download=force_download, proxies=proxies, token=token,
                                               local_files_only=local_files_only, allow_patterns=list(HUB_FILES)))
        bilm = load_pretrained(directory)
        provenance = read_provenance(directory)
        fingerprint = model_fingerprint(bilm)
        expected = provenance.get("elmokit_fingerprint")
        if isinstance(expected, str) and expected != fingerprint:
            raise WeightFileError(f"{model_id}: the weights' fingerprint {fingerprint[:16]} is not the "
                                  f"{expected[:16]} its {PROVENANCE_NAME} records: the files were changed or damaged "
                                  f"(download again: force_download=True)")
        provenance.setdefault("license", UNKNOWN_LICENSE)
        if not os.path.isdir(model_id):
            provenance["hub_repository"] = model_id + (f"@{revision}" if revision else "")
        return cls.from_bilm(bilm, provenance)


def _is_elmokit_reference(reference: str) -> bool:
    """True for what `elmokit.load_model` reads itself: the built-in name, a published name or
    TF-Hub handle, a URL, an existing path; False for anything else (a Hub repository id)."""
    return (reference == BUILTIN_MODEL or published_model(reference) is not None or is_url(reference)
            or Path(reference).exists())


def __getattr__(name: str):
    """`HubBiLM`, this class's former name, still imports, with a DeprecationWarning: in elmokit
    "hub" names TF-Hub (`elmokit.hub`), and this is the Hugging Face Hub's class."""
    if name == "HubBiLM":
        import warnings

        warnings.warn("elmokit.integrations.huggingface.HubBiLM is now HuggingFaceBiLM", DeprecationWarning, stacklevel=2)
        return HuggingFaceBiLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
