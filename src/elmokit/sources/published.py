"""The published ELMo models by name, and the URLs and handles users already have in their code.

    resolve_reference("original")                      -> PublishedModel (its two URLs)
    resolve_reference("https://tfhub.dev/google/elmo/3") -> the same published biLM

AllenNLP published four English models (allennlp.org/elmo: small, medium, original, original
5.5B) and hosted two contributed ones (PubMed, Portuguese); each is an options JSON and an HDF5
weight file under https://allennlp.s3.amazonaws.com/models/elmo/ (older code spells the same
files https://s3-us-west-2.amazonaws.com/allennlp/models/elmo/...). TF-Hub's google/elmo/1, 2
and 3 are the `original` biLM (docs/loading.md gives the evidence).
"""

from __future__ import annotations

from dataclasses import dataclass

from elmokit.sources.download import Expected
from elmokit.sources.cache import canonical_url

ALLENNLP_BASE = "https://allennlp.s3.amazonaws.com/models/elmo/"


@dataclass(frozen=True)
class PublishedModel:
    """A published biLM: its name, the URLs of its options JSON and HDF5 weights, and a line on
    what it is (shape, training data)."""

    name: str
    options_url: str
    weight_url: str
    description: str


def _allennlp(name: str, folder: str, stem: str, description: str, weights: str | None = None) -> PublishedModel:
    base = ALLENNLP_BASE + folder + "/"
    return PublishedModel(name, base + f"{stem}_options.json", base + (weights or f"{stem}_weights.hdf5"), description)


PUBLISHED: dict[str, PublishedModel] = {model.name: model for model in (
    _allennlp("small", "2x1024_128_2048cnn_1xhighway", "elmo_2x1024_128_2048cnn_1xhighway",
              "2 x 1024 cells -> 128, 1 highway, 256-dim vectors; 1B Word Benchmark (13.6M parameters)"),
    _allennlp("medium", "2x2048_256_2048cnn_1xhighway", "elmo_2x2048_256_2048cnn_1xhighway",
              "2 x 2048 cells -> 256, 1 highway, 512-dim vectors; 1B Word Benchmark (28.0M parameters)"),
    _allennlp("original", "2x4096_512_2048cnn_2xhighway", "elmo_2x4096_512_2048cnn_2xhighway",
              "2 x 4096 cells -> 512, 2 highway, 1024-dim vectors; 1B Word Benchmark (93.6M parameters; "
              "the paper's model, TF-Hub's google/elmo)"),
    _allennlp("original-5.5B", "2x4096_512_2048cnn_2xhighway_5.5B", "elmo_2x4096_512_2048cnn_2xhighway_5.5B",
              "the original shape trained on 5.5B tokens (Wikipedia and WMT 2008-2012 news crawl)"),
    _allennlp("pubmed", "contributed/pubmed", "elmo_2x4096_512_2048cnn_2xhighway",
              "the original shape trained on PubMed abstracts (contributed)",
              weights="elmo_2x4096_512_2048cnn_2xhighway_weights_PubMed_only.hdf5"),
    _allennlp("pt", "contributed/pt", "elmo_pt",
              "Portuguese (contributed)"),
)}

ALIASES = {"large": "original-5.5B", "5.5b": "original-5.5B", "portuguese": "pt",
           **{name.lower(): name for name in PUBLISHED}}
"""Other spellings of the names (case-insensitive): `large` is Flair's name for the 5.5B model."""

TFHUB_HANDLES = {f"https://tfhub.dev/google/elmo/{version}": "original" for version in (1, 2, 3)}
"""TF-Hub's ELMo modules and the published biLM each one holds."""


def tfhub_name(handle: str) -> str | None:
    """The published name a TF-Hub handle stands for (query and trailing slash ignored), or None."""
    base = handle.split("?")[0].rstrip("/")
    return TFHUB_HANDLES.get(base.replace("http://", "https://", 1))


def published_model(name: str) -> PublishedModel | None:
    """The published model of a name or alias (any case), or of a TF-Hub handle; None otherwise."""
    key = ALIASES.get(name.lower()) or tfhub_name(name)
    return PUBLISHED.get(key) if key else None


def published_names() -> list[str]:
    return list(PUBLISHED)


_SIZES_SEEN = ("the Content-Length AllenNLP's downloader showed (`100%| 336/336`, `374434792/374434792`) in "
               "public notebooks' output: an ELMo tutorial's (2019, `original`) and a CORD-19 notebook's through "
               "Flair's ELMoEmbeddings('pubmed') (2020)")
PUBLISHED_FILES: dict[str, Expected] = {
    PUBLISHED["original"].options_url: Expected(size=336, source=_SIZES_SEEN),
    PUBLISHED["original"].weight_url: Expected(size=374_434_792, source=_SIZES_SEEN),
    PUBLISHED["pubmed"].options_url: Expected(size=336, source=_SIZES_SEEN),
    PUBLISHED["pubmed"].weight_url: Expected(size=374_434_792, source=_SIZES_SEEN),
}
"""What is publicly known of the published files, by URL: sizes seen in public download logs; no
SHA-256 of any of them is published (AllenNLP's pages, its S3 listing and the public copies found
give none), so none is pinned and a mirror's copy is cached under the mirror's own URL
(`elmokit.sources.download`). docs/loading.md lists them."""


def expected_file(url: str) -> Expected | None:
    """The published size and SHA-256 of the file at `url` (any spelling), where known."""
    return PUBLISHED_FILES.get(canonical_url(url))
