"""The page's computation (`POST /explore`): for a query word in a query sentence, its
occurrences in the sentences a person typed, ranked per layer by cosine (the `elmo similar`
idea, with its `LayerNeighbours`), and a 2-D picture per layer (its `pca_2d`, coloured by its
`kmeans` in 2 clusters). The demo's "play" sentences are the page's starting text.

Shapes: L+1 layers, 2P dims; N occurrences.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from elmokit.inference.samples import QUERY, SAMPLES, WORD
from elmokit.inference.similar import LayerNeighbours, highlight, kmeans, pca_2d, query_position
from elmokit.serve.inputs import BadRequest
from elmokit.textfiles import read_lines

TOP_K = 5
MAX_TOKENS = 4096  # tokens of the query and the sentences together: their layers come back from the model
MAX_OCCURRENCES = 256  # occurrences of the word: each is a point of every layer's picture, with its sentence


def examples() -> dict:
    """The page's starting text: the demo's query and its sentences (`elmo demo`)."""
    sentences = [line for line in read_lines(SAMPLES) if line]
    return {"query": QUERY, "word": WORD, "sentences": sentences}


class Occurrences(NamedTuple):
    """Where the query word is: its position in the query, and its (sentence, token) occurrences."""

    word: str
    position: int
    found: list[tuple[int, int]]


def locate(query: list[str], word: str, sentences: list[list[str]]) -> Occurrences:
    """The word in the query and in the sentences; BadRequest(422) where it is missing from either,
    or where the request is past what /explore computes (`MAX_TOKENS`, `MAX_OCCURRENCES`: the page
    is for sentences a person reads, and its answer grows with tokens x occurrences), checked
    before any vector is computed."""
    n_tokens = len(query) + sum(map(len, sentences))
    if n_tokens > MAX_TOKENS:
        raise BadRequest(422, f"the query and the sentences have {n_tokens} tokens, more than the limit of "
                              f"{MAX_TOKENS} tokens that /explore computes: give fewer or shorter sentences")
    try:
        position = query_position(query, None, word)
    except ValueError as error:  # the word is not a token of the query
        raise BadRequest(422, str(error)) from None
    found = [(i, t) for i, tokens in enumerate(sentences) for t, token in enumerate(tokens) if token == word]
    if not found:
        raise BadRequest(422, f"{word!r} does not occur in the sentences: nothing to compare")
    if len(found) > MAX_OCCURRENCES:
        raise BadRequest(422, f"{word!r} occurs {len(found)} times in the sentences, more than the limit of "
                              f"{MAX_OCCURRENCES} occurrences that /explore pictures: give fewer sentences")
    return Occurrences(word, position, found)


def explore(query: list[str], sentences: list[list[str]], vectors: list[np.ndarray], where: Occurrences,
            top_k: int = TOP_K) -> dict:
    """Nearest occurrences and the PCA picture per layer. `vectors[0]` is the query's
    (L+1, n, 2P), then one per sentence of `sentences`; `where` from `locate`."""
    word, position, found = where
    query_vectors = vectors[0][:, position]  # (L+1, 2P)
    lines = np.array([i for i, _ in found])  # (N,)
    positions = np.array([t for _, t in found])  # (N,)
    occurrences = np.stack([vectors[1 + i][:, t] for i, t in found], axis=1)  # (L+1, N, 2P)
    units = occurrences / np.linalg.norm(occurrences, axis=-1, keepdims=True).clip(1e-12)
    query_unit = query_vectors / np.linalg.norm(query_vectors, axis=-1, keepdims=True).clip(1e-12)
    cosines = np.einsum("lnd,ld->ln", units, query_unit).clip(-1.0, 1.0)  # (L+1, N)
    texts = [highlight(sentences[i], t) for i, t in found]
    text_of = dict(zip(found, texts))  # (sentence, token) -> its highlighted text, built once for every layer
    layers = []
    for layer in range(occurrences.shape[0]):
        neighbours = LayerNeighbours(layer)
        neighbours.add(cosines[layer], lines, positions, top_k)
        layers.append({"layer": layer, "name": "context-free token layer" if layer == 0 else f"biLSTM layer {layer}",
                       "neighbours": [{"cosine": round(float(score), 4), "sentence": int(line),
                                       "text": text_of[int(line), int(token)]}
                                      for score, line, token in zip(neighbours.scores, neighbours.lines,
                                                                    neighbours.positions)],
                       **_picture(occurrences[layer], query_vectors[layer], texts, lines)})
    return {"word": word, "query": highlight(query, position), "n_occurrences": len(found), "layers": layers}


def _picture(vectors: np.ndarray, query_vector: np.ndarray, texts: list[str], lines: np.ndarray) -> dict:
    """(N, 2P) occurrences -> their PCA projections, the query's, and 2-means clusters."""
    points = torch.from_numpy(vectors).double()  # (N, 2P)
    mean, axes, projections = pca_2d(points)  # projections (N, 2)
    query_point = (torch.from_numpy(query_vector).double() - mean) @ axes  # (2,)
    clusters = kmeans(points, 2).tolist() if len(points) > 1 else [0]
    return {"points": [{"x": round(float(x), 5), "y": round(float(y), 5), "sentence": int(line), "text": text,
                        "cluster": int(cluster)}
                       for (x, y), line, text, cluster in zip(projections.tolist(), lines, texts, clusters)],
            "query_point": {"x": round(float(query_point[0]), 5), "y": round(float(query_point[1]), 5)}}
