"""Flair: `ELMoEmbeddings`, a drop-in for `flair.embeddings.ELMoEmbeddings` without AllenNLP.

    from elmokit.integrations.flair import ELMoEmbeddings
    embeddings = ELMoEmbeddings()                 # the built-in model; or "original", a folder, ...
    tagger = SequenceTagger(hidden_size=256, embeddings=embeddings, tag_dictionary=..., tag_type="ner")

Flair's own class needs `allennlp==0.9.0`, which no longer installs beside a current torch; this
one takes the same arguments (`model`, `options_file`, `weight_file`, `embedding_mode`) and Flair's
model names (`small`, `medium`, `original`, `large`, `pt`, `pubmed`), with elmokit's built-in
English model as the default. Each token gets, from the sentence's L+1 layers (L+1, n, 2P):

    "all"      the layers concatenated in order: ((L+1) * 2P,)   (Flair's default)
    "top"      the last layer: (2P,)
    "average"  the equal-weight mean of the layers: (2P,)

the numbers `elmokit.ElmoEmbedder` gives for the same tokens (stateless: a sentence's vectors do
not depend on what else is in the batch, unlike the stateful AllenNLP path Flair used). The biLM
runs on `flair.device`. A saved tagger holds the model's reference (name, URL or absolute path),
not its weights; loading the tagger loads the model again from there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from elmokit.extras import require

require("flair", "elmokit.integrations.flair")

import flair  # noqa: E402
from flair.data import Sentence  # noqa: E402
from flair.embeddings import TokenEmbeddings  # noqa: E402
from flair.embeddings.base import register_embeddings  # noqa: E402

from elmokit.inference.embedder import ElmoEmbedder  # noqa: E402
from elmokit.inference.layers import OUTPUT_FORMATS, select_layers  # noqa: E402
from elmokit.model.builtin import BUILTIN_MODEL  # noqa: E402
from elmokit.sources.loading import load_model, saved_reference  # noqa: E402

__all__ = ["ELMoEmbeddings"]

REGISTERED_NAME = "elmokit.ELMoEmbeddings"
"""The name Flair's embeddings registry (and so a saved tagger) knows the class by."""


@register_embeddings(REGISTERED_NAME)
class ELMoEmbeddings(TokenEmbeddings):
    """ELMo token embeddings for Flair, computed by elmokit (no AllenNLP).

    Args:
        model: the built-in model's name "gutenberg-en" (the default), a published name (Flair's
            `small`, `medium`, `original`, `large`, `pt`, `pubmed`, or elmokit's), a TF-Hub handle,
            or a model folder (native or ELMoForManyLangs): anything `elmokit.load_model` takes.
        options_file, weight_file: the original options JSON and HDF5 weights (paths or URLs),
            given together; they take the place of `model`, as in Flair.
        embedding_mode: "all" (the L+1 layers concatenated, Flair's default), "top" or "average".
        batch_size: at most this many sentences run through the biLM at once.
        threads: torch's CPU threads (default: `elmokit.devices.use_threads`'s, from the CPUs this
            process may use and the other work on them); a setting of this machine, not saved with a tagger.

    Shapes: each token's embedding is ((L+1) * 2P,) for "all", (2P,) otherwise, on `flair.device`.
    """

    def __init__(self, model: str | Path | None = BUILTIN_MODEL, options_file: str | Path | None = None,
                 weight_file: str | Path | None = None, embedding_mode: str = "all", *, batch_size: int = 64,
                 threads: int | None = None):
        if embedding_mode not in OUTPUT_FORMATS:
            raise ValueError(f"embedding_mode must be one of {', '.join(OUTPUT_FORMATS)}, got {embedding_mode!r}")
        if (options_file is None) != (weight_file is None):
            raise ValueError(f"options_file and weight_file go together: got options_file={options_file!r}, "
                             f"weight_file={weight_file!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        model = BUILTIN_MODEL if model is None else model  # None: the default, as everywhere in elmokit
        self.name = f"elmo-{model}-{embedding_mode}"  # Flair's own naming
        self.static_embeddings = True  # the biLM is frozen: Flair may store the vectors between epochs
        super().__init__()
        self.model = saved_reference(model)
        self.options_file = saved_reference(options_file)
        self.weight_file = saved_reference(weight_file)
        self.embedding_mode = embedding_mode
        self.batch_size = batch_size
        self.threads = threads
        self._embedder = self._load_embedder()  # a plain attribute: its biLM is not in the state dict

    def _load_embedder(self) -> ElmoEmbedder:
        if self.options_file is not None:
            bilm = load_model(self.options_file, self.weight_file)
        else:
            bilm = load_model(self.model)
        return ElmoEmbedder(module=bilm, device=flair.device, threads=self.threads)

    @property
    def embedding_length(self) -> int:
        n_layers = self._embedder.bilm.config.n_output_layers if self.embedding_mode == "all" else 1
        return n_layers * self._embedder.output_dim

    def embedder(self) -> ElmoEmbedder:
        """The `ElmoEmbedder` that computes the vectors, moved to `flair.device` if that changed."""
        if self._embedder.device != torch.device(flair.device):
            self._embedder = ElmoEmbedder(module=self._embedder.bilm, device=flair.device, threads=self.threads)
        return self._embedder

    def token_vectors(self, batch: list[list[str]]) -> torch.Tensor:
        """(N, E): the vectors of the N tokens of `batch` (token lists), sentence after sentence."""
        layers, mask = self.embedder().batch_to_embeddings(batch)  # (B, L+1, T, 2P), (B, T)
        selected = select_layers(layers, self.embedding_mode)  # (B, L+1, T, 2P) or (B, T, 2P)
        if self.embedding_mode == "all":
            selected = selected.transpose(1, 2).flatten(2)  # (B, T, (L+1) * 2P): layer 0, then 1, ...
        return selected[mask]  # (N, E)

    def _add_embeddings_internal(self, sentences: list[Sentence]) -> list[Sentence]:
        for start in range(0, len(sentences), self.batch_size):
            chunk = sentences[start:start + self.batch_size]
            vectors = self.token_vectors([[token.text for token in sentence] for sentence in chunk])
            tokens = [token for sentence in chunk for token in sentence]
            for token, vector in zip(tokens, vectors, strict=True):  # Flair keeps a vector per Token object
                token.set_embedding(self.name, vector)
        return sentences

    def to_params(self) -> dict[str, Any]:
        """What a saved tagger stores: the model's reference and the mode, never the weights. The
        class itself travels too, so that unpickling a saved tagger imports this module, which
        registers the class with Flair before Flair looks it up by name."""
        return {"model": self.model, "options_file": self.options_file, "weight_file": self.weight_file,
                "embedding_mode": self.embedding_mode, "batch_size": self.batch_size, "class": type(self)}

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> ELMoEmbeddings:
        params = {key: value for key, value in params.items() if key != "class"}
        return cls(**params)

    def __getstate__(self) -> dict:
        """Pickling (torch.save of a whole model): the model's reference, not its weights."""
        return {key: value for key, value in self.__dict__.items() if key not in ("_embedder", "threads")}

    def __setstate__(self, state: dict) -> None:
        self.threads = None  # the machine that loads it chooses
        self.__dict__.update(state)
        self._embedder = self._load_embedder()

    def extra_repr(self) -> str:
        return f"model={self.name}"

    def __str__(self) -> str:
        return self.name
