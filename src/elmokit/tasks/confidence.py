"""How sure a task model is: the probability of each predicted tag, of each entity span, of each
class.

* A CRF tagger predicts the Viterbi path; the confidence of its tag at token t is the CRF's
  marginal p(y_t = that tag | sentence), by forward-backward (`CRF.marginals`): the mass of all
  tag paths through that tag, not the probability of the whole path.
* A span's confidence is the probability that its tokens carry exactly the predicted tags and
  the token after it (if any) does not carry I-TYPE (which would make the span longer): the CRF's
  partition function restricted to those tags over the full one; without a CRF, the product over
  those tokens of the probability of the allowed tags.
* A softmax tagger's and a classifier's probabilities are the softmax of their scores.

Shape notation: B batch, T tokens, n tokens of one sentence, K tags or classes.
"""

from __future__ import annotations

import torch

from elmokit.tasks.results import LabelPrediction, Span, TagPrediction
from elmokit.tasks.scores import bio_spans


def tag_probabilities(tagger, emissions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T, K) p(y_t = k | sentence) of every real position, zero at padding."""
    if tagger.crf is not None:
        return tagger.crf.marginals(emissions, mask)
    return torch.softmax(emissions, dim=-1) * mask.unsqueeze(-1)


@torch.no_grad()
def span_probability(tagger, emissions: torch.Tensor, allowed: torch.Tensor) -> float:
    """The probability that every token i takes one of its `allowed[i]` tags: emissions (n, K) of
    one sentence, allowed (n, K) bool."""
    if tagger.crf is not None:
        mask = torch.ones(1, emissions.shape[0], dtype=torch.bool, device=emissions.device)
        restricted = emissions.masked_fill(~allowed, float("-inf"))
        log_p = tagger.crf.log_partition(restricted[None], mask) - tagger.crf.log_partition(emissions[None], mask)
        return float(log_p.exp())
    return float((torch.softmax(emissions, dim=-1) * allowed).sum(dim=-1).prod())


def entity_spans(tagger, emissions: torch.Tensor, tokens: list[str], tags: list[str],
                 tag_ids: dict[str, int]) -> list[Span]:
    """The spans of a predicted BIO sequence, in order, each with its probability."""
    n_tags = emissions.shape[1]
    spans = []
    for label, start, end in sorted(bio_spans(tags), key=lambda span: span[1]):
        allowed = torch.ones(len(tokens), n_tags, dtype=torch.bool, device=emissions.device)
        for position in range(start, end):
            allowed[position] = False
            allowed[position, tag_ids[tags[position]]] = True
        if end < len(tokens) and f"I-{label}" in tag_ids:
            allowed[end, tag_ids[f"I-{label}"]] = False
        spans.append(Span(label, start, end, " ".join(tokens[start:end]),
                          span_probability(tagger, emissions, allowed)))
    return spans


@torch.no_grad()
def tag_predictions(tagger, batch, sentences: list[list[str]], labels: list[str],
                    entity_tags: bool) -> list[TagPrediction]:
    """The tagger's prediction of each sentence of `batch`, with probabilities (and spans)."""
    emissions = tagger(batch).float()  # (B, T, K)
    best = tagger.decode(emissions, batch.mask)
    probabilities = tag_probabilities(tagger, emissions, batch.mask)  # (B, T, K)
    tag_ids = {label: index for index, label in enumerate(labels)}
    predictions = []
    for row, (tokens, ids) in enumerate(zip(sentences, best)):
        tags = [labels[i] for i in ids]
        confidences = probabilities[row, torch.arange(len(ids)), torch.tensor(ids)].tolist()
        spans = entity_spans(tagger, emissions[row, :len(ids)], list(tokens), tags, tag_ids) if entity_tags else None
        predictions.append(TagPrediction(list(tokens), tags, confidences, spans))
    return predictions


@torch.no_grad()
def label_predictions(classifier, batch, sentences: list[list[str]], labels: list[str]) -> list[LabelPrediction]:
    """The classifier's label of each sentence of `batch`, with its probability and every label's."""
    probabilities = torch.softmax(classifier(batch).float(), dim=-1).tolist()  # (B, K)
    predictions = []
    for tokens, row in zip(sentences, probabilities):
        best = max(range(len(row)), key=row.__getitem__)
        predictions.append(LabelPrediction(list(tokens), labels[best], row[best], dict(zip(labels, row))))
    return predictions
