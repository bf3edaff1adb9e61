"""Span F1 with conlleval semantics and accuracy, against hand-computed cases and against seqeval."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elmokit.tasks.scores import accuracy, bio_spans, score_predictions, span_f1


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


def test_span_f1_per_type_hand_computed():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O", "B-PER"]]
    predicted = [["B-PER", "I-PER", "O", "B-ORG"], ["B-ORG", "O", "O"]]
    per_type = span_f1(gold, predicted)["per_type"]
    assert set(per_type) == {"PER", "LOC", "ORG"}
    assert (per_type["PER"]["n_correct"], per_type["PER"]["n_gold"], per_type["PER"]["n_predicted"]) == (1, 2, 1)
    assert per_type["PER"]["precision"] == pytest.approx(100.0) and per_type["PER"]["recall"] == pytest.approx(50.0)
    assert per_type["LOC"]["f1"] == 0.0 and per_type["LOC"]["n_predicted"] == 0
    assert per_type["ORG"]["precision"] == pytest.approx(50.0) and per_type["ORG"]["recall"] == pytest.approx(100.0)


def test_score_predictions_by_metric():
    assert score_predictions([["A", "B"], ["C"]], [["A", "X"], ["C"]], "accuracy") == {"accuracy": pytest.approx(200 / 3)}
    assert score_predictions(["pos", "neg"], ["pos", "pos"], "accuracy") == {"accuracy": pytest.approx(50.0)}
    assert score_predictions([["B-A"]], [["B-A"]], "f1")["f1"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="example 1 has 1 gold labels but 2 predicted"):
        score_predictions([["A"], ["B"]], [["A"], ["B", "B"]], "accuracy")


# ---------------------------------------------------------------------------------------------
# seqeval (its default, conlleval-compatible mode) as an independent oracle
# ---------------------------------------------------------------------------------------------
TAGS = ["O", "O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]
sentence_pairs = st.integers(1, 10).flatmap(lambda n: st.tuples(
    st.lists(st.sampled_from(TAGS), min_size=n, max_size=n), st.lists(st.sampled_from(TAGS), min_size=n, max_size=n)))


@settings(max_examples=200, deadline=None)
@given(st.lists(sentence_pairs, min_size=1, max_size=6))
def test_span_f1_equals_seqeval(pairs):
    seqeval = pytest.importorskip("seqeval.metrics")
    gold, predicted = [list(g) for g, _ in pairs], [list(p) for _, p in pairs]
    ours = span_f1(gold, predicted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # seqeval warns when a score is undefined (0/0); both give 0
        assert ours["precision"] == pytest.approx(100 * seqeval.precision_score(gold, predicted), abs=1e-9)
        assert ours["recall"] == pytest.approx(100 * seqeval.recall_score(gold, predicted), abs=1e-9)
        assert ours["f1"] == pytest.approx(100 * seqeval.f1_score(gold, predicted), abs=1e-9)
        report = seqeval.classification_report(gold, predicted, output_dict=True, zero_division=0)
    for entity_type, scores in ours["per_type"].items():
        if scores["n_gold"] == 0:  # seqeval's report lists only the types of the gold spans
            continue
        assert scores["n_gold"] == report[entity_type]["support"]
        assert scores["precision"] == pytest.approx(100 * report[entity_type]["precision"], abs=1e-9)
        assert scores["recall"] == pytest.approx(100 * report[entity_type]["recall"], abs=1e-9)
        assert scores["f1"] == pytest.approx(100 * report[entity_type]["f1-score"], abs=1e-9)
