"""Task metrics: token/sentence accuracy and entity-level span F1 with conlleval's semantics."""

from __future__ import annotations

from collections.abc import Sequence


def accuracy(gold: Sequence, predicted: Sequence) -> float:
    """Fraction of positions where `predicted` equals `gold` (flat sequences of equal length)."""
    if len(gold) != len(predicted):
        raise ValueError(f"accuracy: {len(gold)} gold labels but {len(predicted)} predictions")
    if not gold:
        return 0.0
    return sum(g == p for g, p in zip(gold, predicted)) / len(gold)


def _split_tag(tag: str) -> tuple[str, str]:
    """'B-PER' -> ('B', 'PER'); 'O' -> ('O', '')."""
    if tag == "O":
        return "O", ""
    prefix, _, entity_type = tag.partition("-")
    if prefix not in ("B", "I") or not entity_type:
        raise ValueError(f"not a BIO tag: {tag!r} (expected O, B-TYPE or I-TYPE)")
    return prefix, entity_type


def bio_spans(tags: Sequence[str]) -> set[tuple[str, int, int]]:
    """Entity spans (type, start, end exclusive) of a BIO sequence, as conlleval finds them.

    A span starts at B-X, at I-X after O, and at I-X after a tag of another type; it ends before
    B, O or a tag of another type. So `O I-PER I-PER` is one PER span and `B-PER I-LOC` two spans.
    """
    spans = set()
    start, current_type = None, ""
    for position, tag in enumerate([*tags, "O"]):
        prefix, entity_type = _split_tag(tag)
        starts_new = prefix == "B" or (prefix == "I" and entity_type != current_type)
        if start is not None and (prefix == "O" or starts_new):
            spans.add((current_type, start, position))
            start, current_type = None, ""
        if starts_new:
            start, current_type = position, entity_type
    return spans


def _prf(n_correct: int, n_gold: int, n_predicted: int) -> dict[str, float]:
    precision = 100.0 * n_correct / n_predicted if n_predicted else 0.0
    recall = 100.0 * n_correct / n_gold if n_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1,
            "n_gold": n_gold, "n_predicted": n_predicted, "n_correct": n_correct}


def span_f1(gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]]) -> dict:
    """Micro-averaged precision, recall and F1 (in %) over exact spans (type and both boundaries),
    as conlleval reports them; sentences are scored separately and the counts summed.
    `per_type` holds the same figures for each entity type found in gold or predictions."""
    if len(gold) != len(predicted):
        raise ValueError(f"span_f1: {len(gold)} gold sentences but {len(predicted)} predicted")
    counts: dict[str, list[int]] = {}  # type -> [correct, gold, predicted]
    for index, (gold_tags, predicted_tags) in enumerate(zip(gold, predicted)):
        if len(gold_tags) != len(predicted_tags):
            raise ValueError(f"span_f1: sentence {index} has {len(gold_tags)} gold tags but "
                             f"{len(predicted_tags)} predicted")
        gold_spans, predicted_spans = bio_spans(gold_tags), bio_spans(predicted_tags)
        for spans, slot in ((gold_spans & predicted_spans, 0), (gold_spans, 1), (predicted_spans, 2)):
            for entity_type, _, _ in spans:
                counts.setdefault(entity_type, [0, 0, 0])[slot] += 1
    totals = [sum(c[slot] for c in counts.values()) for slot in range(3)]
    return {**_prf(*totals), "per_type": {t: _prf(*counts[t]) for t in sorted(counts)}}


def score_predictions(gold: Sequence, predicted: Sequence, metric: str) -> dict:
    """The scores of a split (in %): 'accuracy' over tokens (gold and predicted are tag lists) or
    sentences (one label each), or 'f1': span precision, recall, F1 and per_type, for entity tags."""
    if len(gold) != len(predicted):
        raise ValueError(f"{len(gold)} gold examples but {len(predicted)} predictions")
    if metric == "f1":
        scores = span_f1(gold, predicted)
        return {"f1": scores["f1"], "precision": scores["precision"], "recall": scores["recall"],
                "per_type": scores["per_type"]}
    if gold and isinstance(gold[0], list):
        for index, (gold_row, predicted_row) in enumerate(zip(gold, predicted)):
            if len(gold_row) != len(predicted_row):
                raise ValueError(f"example {index} has {len(gold_row)} gold labels but {len(predicted_row)} predicted")
        gold = [label for row in gold for label in row]
        predicted = [label for row in predicted for label in row]
    return {"accuracy": 100.0 * accuracy(gold, predicted)}
