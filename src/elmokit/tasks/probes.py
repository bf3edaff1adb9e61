"""What each biLM layer knows: a linear POS probe and a 1-nearest-neighbour word-sense probe.

* POS (UD EWT): logistic regression on frozen per-token vectors of one layer, trained on train,
  scored on dev and test (UPOS accuracy).
* WSD (SemCor 3.0): documents split into train and held-out; each held-out sense-tagged token
  takes the sense of the nearest training occurrence (cosine of that layer's vectors) of the same
  lemma and WordNet POS. Reported on the covered tokens (lemma seen in training) and on all
  tokens, where uncovered ones back off to WordNet's first sense when a WordNet `index.sense`
  file is given, and count as errors otherwise.

Shape notation: N tokens, L+1 layers, 2P dims a layer, K classes.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from elmokit.model.bilm import BiLM
from elmokit.progress import progress_bar
from elmokit.tasks.features import cached_layers, compute_layers
from elmokit.tasks.readers import UPOS_TAGS, SenseSentence, read_conllu, read_semcor


# ---------------------------------------------------------------------------------------------
# Linear POS probe
# ---------------------------------------------------------------------------------------------
def token_vectors(bilm: BiLM, sentences: Sequence[Sequence[str]], cache_dir: str | Path | None = None,
                  progress: bool = True) -> torch.Tensor:
    """Every token's layers, sentences concatenated: (N, L+1, 2P) fp16."""
    layers = cached_layers(bilm, sentences, cache_dir, progress=progress)
    return torch.cat([layer.transpose(0, 1) for layer in layers])


def train_linear_probe(features: torch.Tensor, labels: torch.Tensor, n_classes: int, epochs: int = 10,
                       batch_size: int = 1024, lr: float = 0.01, seed: int = 0) -> torch.nn.Linear:
    """Multinomial logistic regression (Adam, minibatches) on features (N, D) with labels (N,)."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    probe = torch.nn.Linear(features.shape[1], n_classes)
    optimizer = torch.optim.Adam(probe.parameters(), lr=lr)
    for _ in range(epochs):
        for index in torch.randperm(len(features), generator=generator).split(batch_size):
            optimizer.zero_grad()
            F.cross_entropy(probe(features[index].float()), labels[index]).backward()
            optimizer.step()
    return probe


@torch.no_grad()
def probe_accuracy(probe: torch.nn.Linear, features: torch.Tensor, labels: torch.Tensor) -> float:
    correct = sum((probe(chunk.float()).argmax(-1) == gold).sum().item()
                  for chunk, gold in zip(features.split(8192), labels.split(8192)))
    return 100.0 * correct / max(len(labels), 1)


def pos_probe(bilm: BiLM, data_dir: str | Path, max_train_sentences: int | None = None,
              max_eval_sentences: int | None = None, epochs: int = 10, cache_dir: str | Path | None = None,
              progress: bool = True) -> dict[str, dict[str, float]]:
    """UPOS accuracy (%) of a linear probe on each layer: {"layer_0": {"dev": .., "test": ..}, ...}."""
    root = Path(data_dir) / "ud-english-ewt"
    files = {"train": "en_ewt-ud-train.conllu.gz", "dev": "en_ewt-ud-dev.conllu", "test": "en_ewt-ud-test.conllu"}
    tag_index = {tag: i for i, tag in enumerate(UPOS_TAGS)}
    features, labels = {}, {}
    for split, name in files.items():
        sentences = read_conllu(root / name)
        limit = max_train_sentences if split == "train" else max_eval_sentences
        if limit is not None and len(sentences) > limit:
            sentences = [sentences[i] for i in sorted(random.Random(0).sample(range(len(sentences)), limit))]
        features[split] = token_vectors(bilm, [s.tokens for s in sentences], cache_dir, progress)
        labels[split] = torch.tensor([tag_index[tag] for s in sentences for tag in s.tags])
    results = {}
    for layer in progress_bar(range(bilm.config.n_output_layers), desc="POS probes", enabled=progress, leave=False):
        probe = train_linear_probe(features["train"][:, layer], labels["train"], len(UPOS_TAGS), epochs)
        results[f"layer_{layer}"] = {split: probe_accuracy(probe, features[split][:, layer], labels[split])
                                     for split in ("dev", "test")}
    return results


# ---------------------------------------------------------------------------------------------
# 1-NN word-sense probe
# ---------------------------------------------------------------------------------------------
def lemma_key(sense_key: str) -> str:
    """'say%2:32:00::' -> 'say%2': the lemma and its WordNet POS (adjective satellites 5 -> 3)."""
    lemma, _, rest = sense_key.partition("%")
    pos = rest[:1]
    return f"{lemma.lower()}%{'3' if pos == '5' else pos}"


def read_first_senses(index_sense: str | Path) -> dict[str, str]:
    """WordNet's first (most frequent) sense of each lemma%pos, from `index.sense`
    (`sense_key synset_offset sense_number tag_cnt` a line)."""
    first = {}
    with open(index_sense, encoding="utf-8") as handle:
        for line in handle:
            columns = line.split()
            if len(columns) >= 3 and columns[2] == "1":
                first.setdefault(lemma_key(columns[0]), columns[0])
    return first


def split_documents(sentences: Sequence[SenseSentence], held_out_every: int = 5
                    ) -> tuple[list[SenseSentence], list[SenseSentence]]:
    """Every `held_out_every`-th document (in file order) is held out for evaluation."""
    documents = list(dict.fromkeys(s.document for s in sentences))
    held_out = set(documents[held_out_every - 1::held_out_every])
    return ([s for s in sentences if s.document not in held_out], [s for s in sentences if s.document in held_out])


def sense_vectors(bilm: BiLM, sentences: Sequence[SenseSentence], chunk: int = 2000, progress: bool = True
                  ) -> tuple[torch.Tensor, list[tuple[str, ...]]]:
    """Vectors (N, L+1, 2P) fp16 of the sense-tagged tokens and their gold keys.

    Multiword forms (`took_place`) are split on `_` for the biLM and their words' vectors averaged.
    """
    tagged = [s for s in sentences if any(s.senses)]
    vectors, keys = [], []
    for start in progress_bar(range(0, len(tagged), chunk), desc="SemCor vectors", enabled=progress, leave=False):
        part = tagged[start:start + chunk]
        words = [[w for token in s.tokens for w in (token.split("_") if token.strip("_") else [token]) if w]
                 for s in part]
        layers = compute_layers(bilm, words, progress=False)
        for sentence, sentence_layers in zip(part, layers):
            position = 0
            for token, senses in zip(sentence.tokens, sentence.senses):
                width = max(len([w for w in token.split("_") if w]), 1) if token.strip("_") else 1
                if senses:
                    vectors.append(sentence_layers[:, position:position + width].float().mean(dim=1).half())
                    keys.append(senses)
                position += width
    return torch.stack(vectors), keys


def nearest_neighbour_senses(train_vectors: torch.Tensor, train_keys: Sequence[tuple[str, ...]],
                             test_vectors: torch.Tensor, test_keys: Sequence[tuple[str, ...]]) -> list[str | None]:
    """For each test token, the first sense key of the most cosine-similar training token with the
    same lemma%pos; None where the lemma never occurs in training. Vectors (N, D)."""
    by_lemma: dict[str, list[int]] = defaultdict(list)
    for index, keys in enumerate(train_keys):
        by_lemma[lemma_key(keys[0])].append(index)
    test_by_lemma: dict[str, list[int]] = defaultdict(list)
    for index, keys in enumerate(test_keys):
        test_by_lemma[lemma_key(keys[0])].append(index)
    train_unit = F.normalize(train_vectors.float(), dim=-1)
    test_unit = F.normalize(test_vectors.float(), dim=-1)
    predictions: list[str | None] = [None] * len(test_keys)
    for lemma, test_rows in test_by_lemma.items():
        train_rows = by_lemma.get(lemma)
        if not train_rows:
            continue
        similarity = test_unit[test_rows] @ train_unit[train_rows].T  # (n_test, n_train)
        for row, best in zip(test_rows, similarity.argmax(dim=1).tolist()):
            predictions[row] = train_keys[train_rows[best]][0]
    return predictions


def most_frequent_senses(train_keys: Sequence[tuple[str, ...]]) -> dict[str, str]:
    counts: dict[str, Counter] = defaultdict(Counter)
    for keys in train_keys:
        counts[lemma_key(keys[0])][keys[0]] += 1
    return {lemma: counter.most_common(1)[0][0] for lemma, counter in counts.items()}


def score_senses(predictions: Sequence[str | None], gold: Sequence[tuple[str, ...]],
                 backoff: dict[str, str]) -> dict[str, float]:
    """Accuracy (%) on covered tokens, coverage (%), and accuracy on all tokens without and with backoff."""
    covered = [i for i, p in enumerate(predictions) if p is not None]
    correct_covered = sum(predictions[i] in gold[i] for i in covered)
    with_backoff = correct_covered + sum(backoff.get(lemma_key(gold[i][0])) in gold[i]
                                         for i, p in enumerate(predictions) if p is None)
    n = max(len(gold), 1)
    return {"accuracy_covered": 100.0 * correct_covered / max(len(covered), 1),
            "coverage": 100.0 * len(covered) / n,
            "accuracy_all_no_backoff": 100.0 * correct_covered / n,
            "accuracy_all_with_backoff": 100.0 * with_backoff / n,
            "n_test": len(gold)}


def wsd_probe(bilm: BiLM, semcor_path: str | Path, max_documents: int | None = None, held_out_every: int = 5,
              index_sense: str | Path | None = None, progress: bool = True) -> dict[str, dict[str, float]]:
    """1-NN WSD per layer plus the training-MFS baseline: {"layer_0": {...}, ..., "mfs": {...}}."""
    train, test = split_documents(read_semcor(semcor_path, max_documents), held_out_every)
    train_vectors, train_keys = sense_vectors(bilm, train, progress=progress)
    test_vectors, test_keys = sense_vectors(bilm, test, progress=progress)
    backoff = read_first_senses(index_sense) if index_sense is not None else {}
    results = {}
    for layer in range(bilm.config.n_output_layers):
        predictions = nearest_neighbour_senses(train_vectors[:, layer], train_keys, test_vectors[:, layer], test_keys)
        results[f"layer_{layer}"] = score_senses(predictions, test_keys, backoff)
    mfs = most_frequent_senses(train_keys)
    results["mfs"] = score_senses([mfs.get(lemma_key(keys[0])) for keys in test_keys], test_keys, backoff)
    results["backoff"] = "WordNet first sense" if backoff else "none (no WordNet index.sense given)"
    return results
