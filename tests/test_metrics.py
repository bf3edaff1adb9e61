"""Span F1 with conlleval semantics and accuracy, against hand-computed cases."""

from __future__ import annotations

import pytest

from elmokit.tasks.metrics import accuracy, bio_spans, span_f1


def test_bio_spans_basic():
    assert bio_spans(["B-PER", "I-PER", "O", "B-LOC"]) == {("PER", 0, 2), ("LOC", 3, 4)}


def test_i_after_o_starts_a_span_as_conlleval_does():
    assert bio_spans(["O", "I-PER", "I-PER", "O"]) == {("PER", 1, 3)}
    assert bio_spans(["I-ORG"]) == {("ORG", 0, 1)}


def test_type_change_and_b_split_spans():
    assert bio_spans(["B-PER", "I-LOC", "I-LOC"]) == {("PER", 0, 1), ("LOC", 1, 3)}
    assert bio_spans(["B-PER", "B-PER", "I-PER"]) == {("PER", 0, 1), ("PER", 1, 3)}
    assert bio_spans(["O", "O"]) == set()


def test_span_f1_hand_computed():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O", "B-MISC", "I-MISC"]]
    predicted = [["B-PER", "I-PER", "O", "B-ORG"],  # PER right, LOC typed wrong
                 ["B-ORG", "O", "B-MISC", "O"]]  # ORG right, MISC boundary wrong
    scores = span_f1(gold, predicted)
    # 2 correct of 4 predicted and 4 gold: P = R = F = 50
    assert scores["n_correct"] == 2 and scores["n_gold"] == 4 and scores["n_predicted"] == 4
    assert scores["precision"] == pytest.approx(50.0)
    assert scores["f1"] == pytest.approx(50.0)


def test_span_f1_unequal_precision_recall():
    gold = [["B-PER", "O", "B-LOC", "O", "B-ORG"]]
    predicted = [["B-PER", "O", "O", "O", "O"]]
    scores = span_f1(gold, predicted)
    assert scores["precision"] == pytest.approx(100.0)
    assert scores["recall"] == pytest.approx(100 / 3)
    assert scores["f1"] == pytest.approx(2 * 100 * (100 / 3) / (100 + 100 / 3))


def test_span_f1_counts_predicted_i_after_o_as_a_span():
    gold = [["O", "B-PER", "I-PER"]]
    assert span_f1(gold, [["O", "I-PER", "I-PER"]])["f1"] == pytest.approx(100.0)
    assert span_f1([["O", "O"]], [["O", "O"]])["f1"] == 0.0


def test_span_f1_rejects_bad_input():
    with pytest.raises(ValueError, match="sentence 0"):
        span_f1([["O"]], [["O", "O"]])
    with pytest.raises(ValueError, match="not a BIO tag"):
        bio_spans(["PER"])


def test_accuracy():
    assert accuracy([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    with pytest.raises(ValueError):
        accuracy([1], [1, 2])
