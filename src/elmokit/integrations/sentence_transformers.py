"""sentence-transformers: ELMo as a `SentenceTransformer`, giving the sentence vectors `elmo serve` gives.

    elmo convert --to-sentence-transformers elmo-st           # the built-in model; or --model M

    from sentence_transformers import SentenceTransformer
    model = SentenceTransformer("elmo-st")                   # no trust_remote_code
    vectors = model.encode(["I like apples.", "They play football."])   # (2, 2P) float32

The folder holds one module, `ELMoSentenceEncoder` (named in modules.json), saved in the folder's
root as elmokit's native model (config.json, model.safetensors) with provenance.json, the module's
settings (elmokit_sentence_transformers.json) and a model card with the Hub's metadata block
(README.md). `encode(texts)` Moses-tokenizes each text (`elmokit.tokenize`, as `elmo serve` does),
runs the biLM statelessly and returns `elmokit.inference.layers.sentence_vector`: the mean over the
tokens of the equal-weight average of the L+1 layers, what `elmo serve`'s `/v1/embeddings` answers
for the same raw text (zeros for a text without tokens). `output_value="token_embeddings"` gives
the layer average of each token, (n, 2P). The biLM is a frozen feature extractor here.

`model.save(path)` writes the same folder again (the card kept). Needs sentence-transformers >= 5
(the `sentence-transformers` extra).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from elmokit.extras import require

require("sentence-transformers", "elmokit.integrations.sentence_transformers",
        ("sentence_transformers", "huggingface_hub"))  # sacremoses: when texts are tokenized

from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.base.modules import InputModule  # noqa: E402

from elmokit.inference.embedder import ElmoEmbedder  # noqa: E402
from elmokit.inference.layers import select_layers, sentence_vector  # noqa: E402
from elmokit.integrations.huggingface import UNKNOWN_LICENSE, hub_card, model_provenance  # noqa: E402
from elmokit.io import atomic_write_text, durable_replace, refuse_output_over_input, staging_folder  # noqa: E402
from elmokit.model.bilm import BiLM  # noqa: E402
from elmokit.sources.loading import load_model  # noqa: E402
from elmokit.model.weights import (  # noqa: E402
    CONFIG_NAME, PROVENANCE_NAME, WEIGHTS_NAME, model_fingerprint, read_provenance, save_pretrained)
from elmokit.tokenizer import tokenize  # noqa: E402
from elmokit.training.model_card import CARD_NAME  # noqa: E402

__all__ = ["ELMoSentenceEncoder", "save_sentence_transformers"]

SETTINGS_NAME = "elmokit_sentence_transformers.json"
ST_TAGS = ["sentence-transformers", "feature-extraction", "elmo", "elmokit"]
ST_PIPELINE = "feature-extraction"  # not "sentence-similarity": the vectors are not trained for it (ST_USAGE)
ST_USAGE = [
    "With sentence-transformers:", "",
    "```python",
    "from sentence_transformers import SentenceTransformer  # pip install 'elmokit[sentence-transformers]'", "",
    'model = SentenceTransformer("path/to/this/directory")  # or its Hub repository id',
    'vectors = model.encode(["I like apples.", "They play football."])  # (2, dims)',
    "```", "",
    "Each text is Moses-tokenized (`elmokit.tokenize`) and its vector is the mean over its tokens of the "
    "equal-weight average of the biLM's layers: the vector `elmo serve --model path/to/this/directory` "
    "answers on `/v1/embeddings` for the same text. The module, `elmokit.integrations.sentence_transformers."
    "ELMoSentenceEncoder`, comes with elmokit: no `trust_remote_code`.", "",
    "**What these sentence vectors are for.** Features for a model trained on top of them (a classifier, a "
    "probe), and the similarity of texts in form and wording. They are not trained for similarity of meaning: "
    "as a search index, a text's nearest neighbours by cosine are often about something else, and on a "
    "labelled set they find texts of the query's label hardly more often than chance, and no more often "
    "than a bag of words does (elmokit's docs/integrations.md gives the measurement and the script that "
    "makes it). For search, use a model trained for sentence similarity.", "",
    "**A sentence-transformers folder is code.** `SentenceTransformer(folder)` imports the Python module "
    "that the folder's `modules.json` names: as with a pickle, load a folder only from a source you trust.",
]


class ELMoSentenceEncoder(InputModule):
    """The sentence-transformers module of an ELMo biLM: raw texts -> sentence vectors (B, 2P).

    Args:
        model: a `BiLM`, or anything `elmokit.load_model` takes (None: the built-in model; a
            published name, a TF-Hub handle, a folder, ...).
        lang: the Moses language of `elmokit.tokenize` ("en").
        provenance: what the saved card records of where the biLM came from (default: from `model`).
        threads: torch's CPU threads (default: `elmokit.devices.use_threads`'s, from the CPUs this
            process may use and the other work on them); not saved. `SentenceTransformer(folder,
            model_kwargs={"threads": N})` gives it to a saved module.
    """

    config_file_name = SETTINGS_NAME
    config_keys = ["lang"]

    def __init__(self, model: BiLM | str | Path | None = None, lang: str = "en",
                 provenance: dict[str, Any] | None = None, threads: int | None = None):
        if not isinstance(lang, str) or not lang:
            raise TypeError(f"ELMoSentenceEncoder: lang must be a Moses language code such as 'en', got {lang!r}")
        super().__init__()
        self.bilm = model if isinstance(model, BiLM) else load_model(None if model is None else str(model))
        self.lang = lang
        self.threads = threads
        self.provenance = provenance if provenance is not None else (
            {"source": "a BiLM passed in Python"} if isinstance(model, BiLM) else model_provenance(model, self.bilm))
        self._embedder: ElmoEmbedder | None = None

    def preprocess(self, inputs: list[str], prompt: str | None = None, **kwargs) -> dict[str, Any]:
        """Texts -> {"tokens": their Moses tokens, "attention_mask": (B, T) int64, 1 on tokens}."""
        if prompt:
            inputs = [prompt + text for text in inputs]
        for i, text in enumerate(inputs):
            if not isinstance(text, str):
                raise TypeError(f"ELMoSentenceEncoder embeds texts: input {i} is a {type(text).__name__}")
        tokens = [tokenize(text, self.lang) for text in inputs]
        lengths = torch.tensor([len(sentence) for sentence in tokens], dtype=torch.int64)  # (B,)
        width = int(lengths.max()) if len(tokens) else 0
        mask = (torch.arange(width) < lengths.unsqueeze(1)).to(torch.int64)  # (B, T)
        return {"tokens": tokens, "attention_mask": mask}

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        """Adds "token_embeddings" (B, T, 2P), each token's layer average (zero past its
        sentence), and "sentence_embedding" (B, 2P), `sentence_vector` of the layers; float32 on
        the biLM's device."""
        layers, lengths = self._embedder_here().batch_layers(features["tokens"])  # (B, L+1, T, 2P), (B,)
        layers = layers.float()
        features["token_embeddings"] = select_layers(layers, "average")  # (B, T, 2P)
        features["sentence_embedding"] = sentence_vector(layers, lengths)  # (B, 2P)
        return features

    def _embedder_here(self) -> ElmoEmbedder:
        """elmokit's stateless embedder of `self.bilm` where the module now is (rebuilt after `.to`)."""
        device = next(self.bilm.parameters()).device
        if self._embedder is None or self._embedder.device != device:
            self._embedder = ElmoEmbedder(module=self.bilm, device=device, threads=self.threads)
        return self._embedder

    def get_embedding_dimension(self) -> int:
        return self.bilm.output_dim

    get_sentence_embedding_dimension = get_embedding_dimension  # sentence-transformers < 5.4's name

    def save(self, output_path: str, *args, safe_serialization: bool = True, **kwargs) -> None:
        """elmokit's native model (config.json, model.safetensors), provenance.json and the settings."""
        save_pretrained(self.bilm, output_path)
        atomic_write_text(Path(output_path) / PROVENANCE_NAME, json.dumps(self.provenance, indent=2) + "\n")
        self.save_config(output_path)

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", token: bool | str | None = None,
             cache_folder: str | None = None, revision: str | None = None, local_files_only: bool = False,
             **kwargs) -> ELMoSentenceEncoder:
        """(sentence-transformers' hook) The module saved in a local folder or a Hub repository."""
        where = dict(subfolder=subfolder, token=token, cache_folder=cache_folder, revision=revision,
                     local_files_only=local_files_only)
        directory = Path(cls.load_dir_path(model_name_or_path, **where))
        settings = cls.load_config(model_name_or_path, **where)
        provenance = read_provenance(directory)
        threads = (kwargs.get("model_kwargs") or {}).get("threads")
        return cls(directory, provenance=provenance, threads=threads, **settings)


def save_sentence_transformers(model: BiLM | str | Path | None, directory: str | Path, *, source: str | None = None,
                               lang: str = "en", license: str | None = None, overwrite: bool = False) -> Path:
    """Write `directory`, a folder `SentenceTransformer(directory)` loads (`elmo convert
    --to-sentence-transformers`): modules.json naming `ELMoSentenceEncoder`, the biLM of `model`
    (as `ELMoSentenceEncoder` takes it) in elmokit's native layout, and README.md, a model card
    with the Hub's metadata (library sentence-transformers, tags, license, the biLM's source and
    fingerprint: `model_provenance` of `source`, the reference a `BiLM` given as `model` was loaded
    from). Written into a temporary folder beside `directory`, then renamed into place; an existing
    `directory` is refused (FileExistsError) unless `overwrite` (a file there always); one that
    holds the model of `model` or `source` (a path), or lies inside its folder, always (ValueError,
    `refuse_output_over_input`)."""
    directory = Path(directory)
    if not isinstance(lang, str) or not lang:  # checked before the biLM is loaded: a folder that cannot encode
        raise TypeError(f"save_sentence_transformers: lang must be a Moses language code such as 'en', got {lang!r}")
    if directory.exists() and not (overwrite and directory.is_dir()):
        raise FileExistsError(f"output exists: {directory} " + ("(overwrite=True replaces it)" if directory.is_dir()
                                                                 else "and is not a folder"))
    # overwrite=True replaces the folder whole: never one holding the model being converted
    refuse_output_over_input([given for given in (model, source) if isinstance(given, (str, Path))
                              and Path(given).exists()], [directory])
    bilm = model if isinstance(model, BiLM) else load_model(None if model is None else str(model))
    if isinstance(model, BiLM) and source is None:
        provenance = {"source": "a BiLM passed in Python", "license": license or UNKNOWN_LICENSE,
                      "elmokit_fingerprint": model_fingerprint(bilm)}
    else:
        provenance = model_provenance(source if isinstance(model, BiLM) else model, bilm, license)
    encoder = ELMoSentenceEncoder(bilm, lang=lang, provenance=provenance)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(directory)
    try:
        SentenceTransformer(modules=[encoder], device="cpu").save(str(staging), create_model_card=False)
        files = {"modules.json": "the sentence-transformers pipeline: one module, ELMoSentenceEncoder",
                 "config_sentence_transformers.json": "sentence-transformers' settings (versions, prompts)",
                 SETTINGS_NAME: "the module's settings (the Moses language)",
                 CONFIG_NAME: "the shapes of the biLM (ElmoConfig)", WEIGHTS_NAME: "the weights of the biLM",
                 PROVENANCE_NAME: "where the weights came from: source, training record, fingerprint"}
        atomic_write_text(staging / CARD_NAME, hub_card(
            encoder.bilm, encoder.provenance, files, library_name="sentence-transformers", tags=ST_TAGS,
            pipeline_tag=ST_PIPELINE, usage=ST_USAGE))
        _replace_folder(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def _replace_folder(new: Path, directory: Path) -> None:
    """Rename the finished folder `new` to `directory`; an old `directory` is moved aside first
    and removed once the new one is in place."""
    old = None
    if directory.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old.", dir=directory.parent))
        os.replace(directory, old / directory.name)
    durable_replace(new, directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
