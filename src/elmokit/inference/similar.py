"""Nearest occurrences of a word in context (the ELMo paper's polysemy demo, its Table 4), and a
2-D picture of all the occurrences of a word.

Given a query sentence and a position in it, every occurrence of the same word form in a corpus
(or of any word) is embedded in its own sentence, and the occurrences are ranked per layer by the
cosine of their vector with the query word's vector. Layer 0 is the context-free token layer:
there every occurrence of a word has the same vector (cosine 1), while the biLSTM layers tell the
senses apart. The corpus is streamed: only the k best of each layer are kept, and only sentences
holding the word are embedded (unless `any_word`).

Shapes: L+1 layers, 2P dims; N occurrences.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from elmokit.inference.embedder import ElmoEmbedder
from elmokit.inference.files import embed_sentences, make_tokenizer, read_lines
from elmokit.extras import require
from elmokit.io import atomic_path

WINDOW_OVERLAP = 32  # tokens of context on each side of a long sentence's windows


@dataclass
class LayerNeighbours:
    """The best `k` occurrences at one layer, best first."""

    layer: int
    scores: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32))  # (k,) cosines
    lines: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # (k,) 0-based line
    positions: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))  # (k,) token index
    n_seen: int = 0
    lowest: float = np.inf
    highest: float = -np.inf

    def add(self, scores: np.ndarray, lines: np.ndarray, positions: np.ndarray, k: int) -> None:
        """Merge a batch of candidates, keeping the k best (ties: the earlier line first)."""
        if scores.size == 0:
            return
        self.n_seen += scores.size
        self.lowest, self.highest = min(self.lowest, scores.min()), max(self.highest, scores.max())
        all_scores = np.concatenate([self.scores, scores])
        all_lines = np.concatenate([self.lines, lines])
        all_positions = np.concatenate([self.positions, positions])
        best = np.lexsort((all_positions, all_lines, -all_scores))[:k]
        self.scores, self.lines, self.positions = all_scores[best], all_lines[best], all_positions[best]


@dataclass
class SimilarResult:
    word: str
    query_vectors: np.ndarray  # (L+1, 2P)
    neighbours: list[LayerNeighbours]
    n_sentences: int  # corpus lines read
    plot_vectors: np.ndarray  # (N, 2P) every occurrence of `word` at the plot layer
    plot_lines: np.ndarray  # (N,) their 0-based lines
    context_free: bool  # layer 0 of every occurrence of `word` equals the query's (to 1e-6)


def query_position(tokens: Sequence[str], position: int | None, word: str | None) -> int:
    """The query token: `position` (0-based), or the first occurrence of `word`."""
    if not tokens:
        raise ValueError("the query sentence is empty")
    if position is None:
        if word is None:
            raise ValueError("give the query word: position=INDEX or word=WORD")
        if word not in tokens:
            raise ValueError(f"word={word!r} is not a token of the query sentence: {' '.join(tokens)}")
        return list(tokens).index(word)
    if not 0 <= position < len(tokens):
        raise ValueError(f"position={position} is outside the query sentence (0 to {len(tokens) - 1})")
    if word is not None and tokens[position] != word:
        raise ValueError(f"position={position} is {tokens[position]!r}, not word={word!r}")
    return position


def check_max_length(max_length: int) -> None:
    """A sentence longer than `max_length` is embedded in windows that keep `WINDOW_OVERLAP`
    tokens of context on each side of the part they contribute: shorter windows cannot."""
    if max_length <= 2 * WINDOW_OVERLAP:
        raise ValueError(f"max_length must be more than {2 * WINDOW_OVERLAP} (longer sentences are embedded in "
                         f"windows with {WINDOW_OVERLAP} tokens of context on each side), got {max_length}")


def find_similar(embedder: ElmoEmbedder, query: Sequence[str], position: int, corpus: Path,
                 layers: Sequence[int], top_k: int = 5, any_word: bool = False, plot_layer: int | None = None,
                 tokenize: bool = False, batch_size: int = 64, max_length: int = 256,
                 progress: bool = False) -> SimilarResult:
    """Rank the occurrences in `corpus` (one sentence per line) by cosine with query[position];
    `progress`: report the corpus read (`elmokit.progress`)."""
    from elmokit.progress import progress_bar
    from elmokit.textfiles import text_size

    check_max_length(max_length)
    word = query[position]
    query_vectors = next(embed_sentences(embedder, [query], max_length=max(max_length, len(query)),
                                         overlap=WINDOW_OVERLAP))[:, position]
    query_unit = query_vectors / np.linalg.norm(query_vectors, axis=-1, keepdims=True).clip(1e-12)  # (L+1, 2P)
    neighbours = [LayerNeighbours(layer) for layer in layers]
    plot_vectors, plot_lines = [], []
    context_free = True
    tokenizer = make_tokenizer(tokenize)
    numbered = enumerate(read_lines(corpus))
    n_sentences = 0
    bar = progress_bar(total=text_size(Path(corpus)), unit="B", unit_scale=True, desc="searching the corpus",
                       enabled=progress)
    while batch := list(itertools.islice(numbered, batch_size * 8)):
        n_sentences += len(batch)
        bar.update(sum(len(line) + 1 for _, line in batch))
        sentences = [(i, tokenizer(line)) for i, line in batch]
        if not any_word:
            sentences = [(i, tokens) for i, tokens in sentences if word in tokens]
        if not sentences:
            continue
        token_arrays = [np.array(tokens, dtype=object) for _, tokens in sentences]
        vectors = np.concatenate(list(embed_sentences(embedder, [t for _, t in sentences], batch_size,
                                                      max_length, WINDOW_OVERLAP)), axis=1)  # (L+1, n_tokens, 2P)
        flat_tokens = np.concatenate(token_arrays)  # (n_tokens,)
        lines = np.repeat([i for i, _ in sentences], [len(t) for t in token_arrays])  # (n_tokens,)
        positions = np.concatenate([np.arange(len(t)) for t in token_arrays])  # (n_tokens,)
        is_word = flat_tokens == word  # (n_tokens,)
        candidates = np.ones_like(is_word) if any_word else is_word
        units = vectors[:, candidates]
        units = units / np.linalg.norm(units, axis=-1, keepdims=True).clip(1e-12)  # (L+1, N, 2P)
        cosines = np.einsum("lnd,ld->ln", units, query_unit).clip(-1.0, 1.0)  # (L+1, N)
        for layer_neighbours in neighbours:
            layer_neighbours.add(cosines[layer_neighbours.layer], lines[candidates], positions[candidates], top_k)
        context_free &= bool(np.abs(vectors[0, is_word] - query_vectors[0]).max(initial=0.0) <= 1e-6)
        if plot_layer is not None:
            plot_vectors.append(vectors[plot_layer, is_word])
            plot_lines.append(lines[is_word])
    dim = query_vectors.shape[-1]
    bar.close()
    return SimilarResult(word, query_vectors, neighbours, n_sentences,
                         np.concatenate(plot_vectors) if plot_vectors else np.empty((0, dim), np.float32),
                         np.concatenate(plot_lines) if plot_lines else np.empty(0, np.int64), context_free)


def read_corpus_lines(corpus: Path, wanted: set[int]) -> dict[int, str]:
    """The text of the given 0-based lines (a second pass, to show the neighbours)."""
    return {i: line for i, line in enumerate(read_lines(corpus)) if i in wanted}


def highlight(tokens: Sequence[str], position: int) -> str:
    """The sentence with the token at `position` in [brackets]."""
    return " ".join([*tokens[:position], f"[{tokens[position]}]", *tokens[position + 1:]])


# ---------------------------------------------------------------------------------------------
# The picture: a 2-D PCA of all occurrences, coloured by cue words or by k-means clusters
# ---------------------------------------------------------------------------------------------
def pca_2d(vectors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, D) -> the mean (D,), the two leading principal axes (D, 2) (zero-padded when fewer
    exist) and the projections (N, 2)."""
    mean = vectors.mean(dim=0)
    centred = vectors - mean  # (N, D)
    _, _, vh = torch.linalg.svd(centred, full_matrices=False)  # vh (min(N, D), D)
    axes = torch.zeros(vectors.shape[1], 2, dtype=vectors.dtype, device=vectors.device)
    axes[:, :min(2, vh.shape[0])] = vh[:2].T
    return mean, axes, centred @ axes


def kmeans(vectors: torch.Tensor, k: int, n_iterations: int = 50, seed: int = 0) -> torch.Tensor:
    """Cluster labels (N,) by k-means (cosine geometry: rows normalised), k-means++ start, seeded."""
    points = torch.nn.functional.normalize(vectors, dim=1)  # (N, D)
    k = min(k, len(points))
    generator = torch.Generator(points.device).manual_seed(seed)
    centres = points[torch.randint(len(points), (1,), generator=generator, device=points.device)]  # (1, D)
    while len(centres) < k:
        distances = torch.cdist(points, centres).min(dim=1).values ** 2  # (N,)
        weights = distances if distances.sum() > 0 else torch.ones_like(distances)
        centres = torch.cat([centres, points[torch.multinomial(weights, 1, generator=generator)]])
    for _ in range(n_iterations):
        labels = torch.cdist(points, centres).argmin(dim=1)  # (N,)
        updated = torch.stack([points[labels == c].mean(0) if (labels == c).any() else centres[c]
                               for c in range(k)])  # (k, D); an emptied cluster keeps its centre
        if torch.equal(updated, centres):
            break
        centres = updated
    return torch.cdist(points, centres).argmin(dim=1)


def cue_labels(sentences: Sequence[Sequence[str]], cues: Sequence[str]) -> list[str]:
    """Each sentence's label: the first cue word (case-insensitive) it contains, else 'other'."""
    lowered = [c.lower() for c in cues]
    labels = []
    for tokens in sentences:
        present = {t.lower() for t in tokens}
        labels.append(next((cue for cue in lowered if cue in present), "other"))
    return labels


def plot_occurrences(path: Path, projections: np.ndarray, labels: Sequence[str], query_point: np.ndarray,
                     title: str) -> None:
    """Scatter the (N, 2) projections coloured by label, the query as a black star, as a PNG.

    Raises:
        MissingExtraError: matplotlib is not installed (the `plot` extra).
    """
    require("plot", "elmo similar --plot")
    from matplotlib.figure import Figure  # no pyplot: no backend is chosen, none is changed

    figure = Figure(figsize=(7, 6))
    axes = figure.subplots()
    for label in sorted(set(labels), key=lambda name: (name == "other", name)):
        chosen = np.array([value == label for value in labels])
        axes.scatter(projections[chosen, 0], projections[chosen, 1], s=18, alpha=0.75,
                     label=f"{label} ({chosen.sum()})")
    axes.scatter([query_point[0]], [query_point[1]], marker="*", s=250, c="black", label="query")
    axes.set_xlabel("principal component 1")
    axes.set_ylabel("principal component 2")
    axes.set_title(title)
    axes.legend(loc="best", fontsize=8)
    figure.tight_layout()
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=100)
