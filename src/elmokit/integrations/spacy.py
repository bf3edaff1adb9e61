"""spaCy: the `elmo` pipe, found through the `spacy_factories` entry point once elmokit is installed.

    nlp = spacy.blank("en")
    nlp.add_pipe("elmo", config={"model": "gutenberg-en", "layers": "average"})
    doc = nlp("The cat sat on the mat.")
    doc._.elmo            # (L+1, n, 2P) float32: every layer of the doc's n tokens (spaCy's own tokens)
    doc[1].vector         # (2P,): the equal-weight layer average ("average"), the top layer ("top"), or layer k (k)
    doc.vector            # (2P,): the mean of the token vectors; span.vector the same over the span
    doc.similarity(other) # the cosine of the two vectors (tokens and spans too)
    doc.tensor            # (n, 2P): the token vectors, where spaCy keeps a pipe's per-token features

The vectors are those of `elmokit.ElmoEmbedder` for the same tokens (stateless: a doc's vectors do
not depend on the other docs of the batch), spaCy's whitespace tokens left out: the biLM reads the
words alone, as it was trained (a "\n\n" or an extra space between two words is a token of spaCy's,
no word of the text), and a whitespace token's vectors are zeros, without a vector
(`token.has_vector` False), outside the means of its doc and spans; `nlp.pipe(texts, batch_size=...)` runs that many docs
through the biLM at once. `nlp.to_disk` keeps the pipe's config (the model by its reference: a
name, URL or absolute path, as every saved elmokit pipeline keeps it), and `spacy.load` loads the model
again from there; spaCy saves a config as it was written, so a folder given as a relative path is
refused (it would load from whatever folder `spacy.load` runs in). The vector, similarity and
norm are user hooks of the doc, objects of this module, so a pickled doc keeps them; a doc that
comes back from `nlp.pipe(texts, n_process=N)` has lost them (spaCy serializes docs between
processes without hooks) and `ElmoComponent.add_hooks` puts them back. The workers run torch on
one thread each (`elmokit.devices.one_thread_in_forked_children`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from elmokit.extras import require

require("spacy", "the elmo pipe of spaCy")

from spacy.language import Language  # noqa: E402
from spacy.tokens import Doc, Span, Token  # noqa: E402
from spacy.util import minibatch  # noqa: E402

from elmokit.devices import default_device  # noqa: E402
from elmokit.inference.embedder import ElmoEmbedder  # noqa: E402
from elmokit.inference.layers import select_layers, token_mean  # noqa: E402
from elmokit.model.builtin import BUILTIN_MODEL  # noqa: E402
from elmokit.sources.loading import saved_reference  # noqa: E402

__all__ = ["ElmoComponent", "make_elmo"]

LAYER_CHOICES = ("average", "top")
"""What `layers` may name besides a layer index: the equal-weight average of the L+1 layers, the top layer."""

if not Doc.has_extension("elmo"):
    Doc.set_extension("elmo", default=None)


class ElmoVectors:
    """The doc's user hooks: vectors from `doc._.elmo`, the layer selection `layers`
    ("average", "top" or a layer index), and their cosine. A plain object, so docs pickle."""

    def __init__(self, layers: str | int):
        self.layers = layers

    @staticmethod
    def words(doc: Doc) -> np.ndarray:
        """(n,) bool: which of the doc's tokens the biLM reads (all but spaCy's whitespace tokens)."""
        return doc.to_array("IS_SPACE") == 0

    def tokens(self, doc: Doc, start: int = 0, end: int | None = None) -> np.ndarray:
        """(m, 2P): the selected vectors of the doc's tokens start..end."""
        layers = doc._.elmo[:, start:end]  # (L+1, m, 2P)
        if isinstance(self.layers, int):
            return layers[self.layers]
        return select_layers(layers, self.layers)

    def vector(self, item: Doc | Span | Token) -> np.ndarray:
        """(2P,): a token's selected vector; a doc's or span's mean over its words (zeros for none)."""
        if isinstance(item, Token):
            return self.tokens(item.doc, item.i, item.i + 1)[0]
        doc, start, end = (item.doc, item.start, item.end) if isinstance(item, Span) else (item, 0, len(item))
        return token_mean(self.tokens(doc, start, end)[self.words(doc)[start:end]])

    def has_vector(self, item: Doc | Span | Token) -> bool:
        """Whether the item holds a word the biLM reads (a doc or span of spaces only: no vector)."""
        if isinstance(item, Token):
            return not item.is_space
        doc, start, end = (item.doc, item.start, item.end) if isinstance(item, Span) else (item, 0, len(item))
        return bool(self.words(doc)[start:end].any())

    def vector_norm(self, item: Doc | Span | Token) -> float:
        return float(np.linalg.norm(self.vector(item)))

    def similarity(self, item: Doc | Span | Token, other) -> float:
        """The cosine of the two vectors; 0.0 where either is zero (an empty doc)."""
        first, second = self.vector(item), np.asarray(other.vector, dtype=np.float32)
        norms = float(np.linalg.norm(first)) * float(np.linalg.norm(second))
        return float(np.dot(first, second) / norms) if norms > 0 else 0.0

    def install(self, doc: Doc) -> None:
        for hooks in (doc.user_hooks, doc.user_span_hooks, doc.user_token_hooks):
            hooks.update(vector=self.vector, has_vector=self.has_vector, vector_norm=self.vector_norm,
                         similarity=self.similarity)
        # spaCy's Span.vector_norm calls the span's "vector" hook where a "vector_norm" one is set (so
        # it would return the vector); without one it takes the norm of Span.vector, our vector hook
        del doc.user_span_hooks["vector_norm"]


class ElmoComponent:
    """The `elmo` pipe: sets `doc._.elmo` (L+1, n, 2P), `doc.tensor` (n, 2P) and the vector hooks.

    Args:
        nlp, name: spaCy's (the pipeline and the pipe's name).
        model: anything `elmokit.load_model` takes: the built-in "gutenberg-en" (the default), a
            published name, a TF-Hub handle, or a model folder as an absolute path (a relative one is
            refused: spaCy saves the config as written, and `spacy.load` elsewhere would miss it).
        layers: what `token.vector` is: "average" (the equal-weight mean of the L+1 layers, the
            default), "top", or a layer index 0..L (0: the context-free token layer).
        batch_size: docs run through the biLM at once where the pipe is given no batch size
            (`nlp.pipe(texts, batch_size=N)` gives its own N, spaCy's convention).
        device: where the biLM runs ("cpu", "cuda", "cuda:N", "auto"); the arrays are numpy. None
            (the default, saved as null: no choice recorded in the pipeline) is every elmokit
            command's default where the pipe loads: ELMOKIT_DEVICE, else "auto" (the GPU when
            torch sees one; `elmokit.devices.default_device`).
        threads: torch's CPU threads (None, the default: `elmokit.devices.use_threads`'s, from the
            CPUs this process may use and the other work on them).
    """

    def __init__(self, nlp: Language, name: str = "elmo", *, model: str = BUILTIN_MODEL,
                 layers: str | int = "average", batch_size: int = 64, device: str | None = None,
                 threads: int | None = None):
        if batch_size < 1:
            raise ValueError(f"elmo pipe: batch_size must be >= 1, got {batch_size}")
        if saved_reference(model) != str(model) and not Path(model).is_absolute():
            absolute = str(Path(model).resolve())
            raise ValueError(f"elmo pipe: model {model!r} is a path relative to this working directory, and spaCy "
                             f"saves the config as written, so spacy.load in another folder would miss it: give it "
                             f"absolute, {absolute!r} (a pipeline saved with a relative one loads with spacy.load(PATH, "
                             f"config={{'components': {{'elmo': {{'model': {absolute!r}}}}}}}))")
        self.name = name
        self.embedder = ElmoEmbedder(model, device=default_device() if device is None else device, threads=threads)
        n_layers = self.embedder.bilm.config.n_output_layers
        if isinstance(layers, bool) or not (layers in LAYER_CHOICES or isinstance(layers, int)
                                            and 0 <= layers < n_layers):
            raise ValueError(f"elmo pipe: layers must be {', '.join(map(repr, LAYER_CHOICES))} or a layer index "
                             f"0..{n_layers - 1} of {model!r}, got {layers!r}")
        self.vectors = ElmoVectors(layers)
        self.batch_size = batch_size

    def __call__(self, doc: Doc) -> Doc:
        return next(iter(self.pipe([doc])))

    def pipe(self, docs: Iterable[Doc], batch_size: int | None = None) -> Iterator[Doc]:
        """The docs in order, `batch_size` of them through the biLM at once."""
        for batch in minibatch(docs, size=batch_size or self.batch_size):
            texts = [[doc[i].text for i in np.flatnonzero(self.vectors.words(doc))] for doc in batch]
            for doc, layers in zip(batch, self.embedder.embed_many(texts, rows=len(batch)), strict=True):
                self.set_annotations(doc, layers)
                yield doc

    def set_annotations(self, doc: Doc, layers: np.ndarray) -> None:
        """`layers` (L+1, m, 2P) of the doc's m words into `doc._.elmo` (L+1, n, 2P) over its n
        tokens (zeros at whitespace tokens), `doc.tensor` and the hooks."""
        words = self.vectors.words(doc)
        if not words.all():
            spread = np.zeros((layers.shape[0], len(doc), layers.shape[2]), layers.dtype)
            spread[:, words] = layers
            layers = spread
        doc._.elmo = layers
        doc.tensor = np.ascontiguousarray(self.vectors.tokens(doc))  # (n, 2P)
        self.add_hooks(doc)

    def add_hooks(self, doc: Doc) -> Doc:
        """Install the pipe's vector, similarity and norm hooks on a doc that has `doc._.elmo`.

        `nlp.pipe(texts, n_process=N)` sends each doc back from its worker through `Doc.to_bytes`,
        which keeps `doc._.elmo` and `doc.tensor` (so `token.vector`) but drops the hooks (spaCy's
        warning W109): without them `doc.vector` and `span.vector` are spaCy's plain mean of
        `doc.tensor`, whitespace tokens included. `for doc in nlp.pipe(texts, n_process=2):
        pipe.add_hooks(doc)` gives them back."""
        self.vectors.install(doc)
        return doc


@Language.factory("elmo", default_config={"model": BUILTIN_MODEL, "layers": "average", "batch_size": 64,
                                          "device": None, "threads": None})
def make_elmo(nlp: Language, name: str, model: str, layers: str | int, batch_size: int, device: str | None,
              threads: int | None) -> ElmoComponent:
    """spaCy's factory of the `elmo` pipe (the `spacy_factories` entry point names it)."""
    return ElmoComponent(nlp, name, model=model, layers=layers, batch_size=batch_size, device=device,
                         threads=threads)
