"""How well the sentence vectors of `elmo convert --to-sentence-transformers` retrieve texts like a
query: each sentence of a labelled set asks for its nearest neighbours by cosine among the others,
and the share of them with its own label is counted (precision at 1 and at 10). Beside them, the
same count for a bag of words (the cosine of the texts' Moses token counts, lower-cased) and the
chance level of the labels, so the figure reads against something.

    .venv/bin/python scripts/st_retrieval.py [--model M] [--data FILE.csv] [--out docs/results/st_retrieval.md]

The default set is SST-2's dev split (../shared/data/sst/sst2_binary_sent_dev.csv: label,sentence;
positive or negative movie-review sentences). Writes the table (Markdown) and the same figures as
JSON beside it (.json); docs/integrations.md quotes the table through scripts/sync_pages.py.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "sst" / "sst2_binary_sent_dev.csv"


def read_labelled(path: Path) -> tuple[list[str], np.ndarray]:
    """(texts, labels) of a CSV with the columns label,sentence."""
    with path.open(encoding="utf-8", newline="") as file:
        rows = list(csv.DictReader(file))
    return [row["sentence"] for row in rows], np.array([row["label"] for row in rows])


def precision_at(vectors: np.ndarray, labels: np.ndarray, k: int) -> float:
    """The share of each text's k nearest others (cosine) that carry its label, over all texts."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    unit = vectors / np.where(norms == 0, 1, norms)
    similarity = unit @ unit.T  # (N, N)
    np.fill_diagonal(similarity, -np.inf)  # never itself
    nearest = np.argsort(-similarity, axis=1, kind="stable")[:, :k]  # (N, k)
    return float((labels[nearest] == labels[:, None]).mean())


def bag_of_words(texts: list[str]) -> np.ndarray:
    """(N, V) counts of each text's lower-cased Moses tokens."""
    from elmokit import tokenize

    counts = [Counter(token.lower() for token in tokenize(text)) for text in texts]
    vocabulary = {word: i for i, word in enumerate(sorted(set().union(*counts)))}
    matrix = np.zeros((len(texts), len(vocabulary)), np.float32)
    for row, count in enumerate(counts):
        for word, n in count.items():
            matrix[row, vocabulary[word]] = n
    return matrix


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="what elmokit.load_model takes (default: the built-in model)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="a CSV of label,sentence")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "st_retrieval.md")
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    from elmokit.integrations.sentence_transformers import ELMoSentenceEncoder

    texts, labels = read_labelled(args.data)
    encoder = ELMoSentenceEncoder(args.model)
    elmo = SentenceTransformer(modules=[encoder], device="cpu").encode(texts, batch_size=64)
    shares = np.array(list(Counter(labels.tolist()).values())) / len(labels)
    rows = {"ELMo sentence vectors (mean of the layer average)": elmo, "bag of words (token counts)": bag_of_words(texts)}
    figures = {name: {"p_at_1": precision_at(vectors, labels, 1), "p_at_10": precision_at(vectors, labels, 10)}
               for name, vectors in rows.items()}
    chance = float((shares ** 2).sum())
    model = args.model or "gutenberg-en (built-in)"
    record = {"model": model, "data": args.data.name, "n_texts": len(texts), "chance": chance, "figures": figures,
              "fingerprint": encoder.provenance.get("elmokit_fingerprint")}
    lines = [f"Written by `scripts/st_retrieval.py`: each of the {len(texts):,} sentences of `{args.data.name}` "
             f"asks for its nearest others by cosine; the share of them with its own label. Model: {model}.", "",
             "| vectors | same label, nearest 1 | same label, nearest 10 |", "|---|---:|---:|"]
    lines += [f"| {name} | {f['p_at_1']:.3f} | {f['p_at_10']:.3f} |" for name, f in figures.items()]
    lines += [f"| chance (the labels' shares) | {chance:.3f} | {chance:.3f} |", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines), encoding="utf-8")
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
