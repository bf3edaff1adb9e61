"""tasks/confidence.py's entity spans against brute force: every tag path of a tiny CRF
enumerated in plain Python, and (without a CRF) every path of independent softmaxes."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from elmokit.tasks.confidence import entity_spans
from elmokit.tasks.crf import CRF
from elmokit.tasks.scores import bio_spans

LABELS = ["B-X", "I-X", "B-Y", "I-Y", "O"]
TAG_IDS = {label: index for index, label in enumerate(LABELS)}


class Tagger:
    def __init__(self, crf: CRF | None):
        self.crf = crf


def path_scores(crf: CRF | None, emissions: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Unnormalised probability of every tag path of one sentence (n, K), in plain Python."""
    emitted = emissions.tolist()
    n, k = len(emitted), len(emitted[0])
    scores = {}
    for path in itertools.product(range(k), repeat=n):
        if crf is None:  # independent softmaxes: the product of each position's softmax
            scores[path] = math.prod(math.exp(emitted[t][tag]) / sum(map(math.exp, emitted[t])) for t, tag in enumerate(path))
            continue
        score = crf.start[path[0]].item() + crf.end[path[-1]].item() + sum(emitted[t][tag] for t, tag in enumerate(path))
        score += sum(crf.transitions[a, b].item() for a, b in zip(path, path[1:]))
        scores[path] = math.exp(score)
    return scores


def brute_force(crf: CRF | None, emissions: torch.Tensor, tags: list[str], start: int, end: int, label: str) -> float:
    """p(positions start..end-1 carry exactly `tags` there and position `end` is not I-label)."""
    scores = path_scores(crf, emissions)
    wanted = [TAG_IDS[tag] for tag in tags[start:end]]

    def holds(path):
        return list(path[start:end]) == wanted and (end >= len(path) or path[end] != TAG_IDS[f"I-{label}"])

    return sum(score for path, score in scores.items() if holds(path)) / sum(scores.values())


@pytest.mark.parametrize("with_crf", [True, False])
def test_entity_spans_match_every_path_enumerated(with_crf):
    torch.manual_seed(3)
    crf = None
    if with_crf:
        crf = CRF(len(LABELS))
        with torch.no_grad():
            for parameter in crf.parameters():
                parameter.normal_()
    # a span at the start, one in the middle followed by a token, one that ends the sentence,
    # two adjacent spans of the same type, an I- opening a span, and a shorter padded row
    tags = [["B-X", "I-X", "O", "B-Y", "I-Y"],
            ["B-Y", "B-Y", "I-X", "O", "B-X"],
            ["O", "I-X", "O", "B-Y", "B-X"],
            ["B-X", "O", "I-Y"]]
    emissions = torch.randn(len(tags), 5, len(LABELS))
    mask = torch.tensor([[True] * len(row) + [False] * (5 - len(row)) for row in tags])
    emissions[~mask] = 30.0  # padding that would dominate if it were read
    sentences = [[f"w{i}" for i in range(len(row))] for row in tags]
    found = entity_spans(Tagger(crf), emissions, mask, sentences, tags, TAG_IDS)
    assert [[(s.label, s.start, s.end) for s in row] for row in found] == \
        [sorted(bio_spans(row), key=lambda span: span[1]) for row in tags]
    assert sum(map(len, found)) == 11
    for row, spans in enumerate(found):
        n = len(tags[row])
        for span in spans:
            expected = brute_force(crf, emissions[row, :n], tags[row], span.start, span.end, span.label)
            assert span.confidence == pytest.approx(expected, abs=1e-5), (row, span)
            assert span.text == " ".join(sentences[row][span.start:span.end])
    assert entity_spans(Tagger(crf), emissions, mask, sentences, [["O"] * len(row) for row in tags], TAG_IDS) == [[]] * 4


def test_one_partition_call_for_the_sentences_and_one_for_all_spans():
    """log Z of every sentence in one call, every span's restricted log Z in another: no loop
    over spans (each of which would run the forward algorithm over all steps)."""
    crf = CRF(len(LABELS))
    calls = []
    original = crf.log_partition
    crf.log_partition = lambda emissions, mask: calls.append(tuple(emissions.shape)) or original(emissions, mask)
    tags = [["B-X", "I-X", "O", "B-Y"], ["B-Y", "O", "B-X", "I-X"], ["O", "O", "O", "O"]]
    emissions = torch.randn(3, 4, len(LABELS))
    spans = entity_spans(Tagger(crf), emissions, torch.ones(3, 4, dtype=torch.bool), [["w"] * 4] * 3, tags, TAG_IDS)
    assert [len(row) for row in spans] == [2, 2, 0]
    assert calls == [(3, 4, 5), (4, 4, 5)]  # the 3 sentences, then the 4 spans
