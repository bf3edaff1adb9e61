"""How sure a task model is: the probability of each predicted tag, of each entity span, of each
class.

* A CRF tagger predicts the Viterbi path; the confidence of its tag at token t is the CRF's
  marginal p(y_t = that tag | sentence), by forward-backward (`CRF.marginals`): the mass of all
  tag paths through that tag, not the probability of the whole path.
* A span's confidence is the probability that its tokens carry exactly the predicted tags and
  the token after it (if any) does not carry I-TYPE (which would make the span longer): the CRF's
  partition function restricted to those tags over the full one (the full one once per sentence,
  every span's restricted one in the same batched call: `entity_spans`); without a CRF, the
  product over those tokens of the probability of the allowed tags.
* A softmax tagger's and a classifier's probabilities are the softmax of their scores.

Shape notation: B batch, T tokens, n tokens of one sentence, K tags or classes, S spans.
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


def span_allowed(tag_ids: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, follow: torch.Tensor,
                 n_tags: int) -> torch.Tensor:
    """The tags each span lets every position take, (S, T, K) bool: inside the span only its
    predicted tag, at the position after it anything but the tag that would continue it (past
    the sentence's end that position is padding, which no probability reads), elsewhere any tag.

    Args: tag_ids (S, T) the predicted tags of each span's sentence (any value past its length);
    starts, ends (S,) the span [start, end); follow (S,) the id of I-TYPE, or -1 where the tag
    set has none."""
    positions = torch.arange(tag_ids.shape[1], device=tag_ids.device)  # (T,)
    inside = (positions >= starts[:, None]) & (positions < ends[:, None])  # (S, T)
    exact = torch.nn.functional.one_hot(tag_ids, n_tags).bool()  # (S, T, K)
    after = (positions == ends[:, None]) & (follow >= 0)[:, None]  # (S, T)
    continues = torch.arange(n_tags, device=tag_ids.device) == follow[:, None, None]  # (S, 1, K)
    return (exact | ~inside[..., None]) & ~(after[..., None] & continues)


@torch.no_grad()
def span_probabilities(tagger, emissions: torch.Tensor, mask: torch.Tensor, allowed: torch.Tensor,
                       rows: torch.Tensor, log_z: torch.Tensor | None = None) -> torch.Tensor:
    """(S,) the probability that every position of sentence `rows[s]` takes one of its
    `allowed[s]` tags: emissions (B, T, K) and mask (B, T) of the batch, allowed (S, T, K), rows
    (S,). With a CRF, the partition function restricted to the allowed tags over the full one,
    all S restricted ones in one call; `log_z` (B,), the full ones, is computed when not given.
    Without, the product over the positions of the softmax mass of the allowed tags."""
    span_mask = mask[rows]  # (S, T)
    if tagger.crf is not None:
        if log_z is None:
            log_z = tagger.crf.log_partition(emissions, mask)  # (B,)
        restricted = emissions[rows].masked_fill(~allowed, float("-inf"))  # (S, T, K)
        return (tagger.crf.log_partition(restricted, span_mask) - log_z[rows]).exp()
    mass = (torch.softmax(emissions[rows], dim=-1) * allowed).sum(dim=-1)  # (S, T)
    return torch.where(span_mask, mass, torch.ones_like(mass)).prod(dim=-1)


def span_probability(tagger, emissions: torch.Tensor, allowed: torch.Tensor) -> float:
    """`span_probabilities` of one sentence: emissions (n, K), allowed (n, K) bool -> a float."""
    mask = torch.ones(1, emissions.shape[0], dtype=torch.bool, device=emissions.device)
    rows = torch.zeros(1, dtype=torch.long, device=emissions.device)
    return float(span_probabilities(tagger, emissions[None], mask, allowed[None], rows)[0])


def entity_spans(tagger, emissions: torch.Tensor, mask: torch.Tensor, sentences: list[list[str]],
                 tags: list[list[str]], tag_ids: dict[str, int]) -> list[list[Span]]:
    """The spans of each sentence's predicted BIO tags, in order, each with its probability:
    emissions (B, T, K), mask (B, T), `tags` the predicted tags of each sentence. The partition
    function is computed once per sentence and every span's restricted one in one batched call."""
    found = [(row, label, start, end) for row, row_tags in enumerate(tags)
             for label, start, end in sorted(bio_spans(row_tags), key=lambda span: span[1])]
    spans: list[list[Span]] = [[] for _ in tags]
    if not found:
        return spans
    device = emissions.device
    rows, starts, ends = (torch.tensor(column, device=device) for column in zip(*[(r, s, e) for r, _, s, e in found]))
    follow = torch.tensor([tag_ids.get(f"I-{label}", -1) for _, label, _, _ in found], device=device)
    width = emissions.shape[1]
    predicted = torch.tensor([[tag_ids[tag] for tag in row_tags] + [0] * (width - len(row_tags)) for row_tags in tags],
                             device=device)  # (B, T)
    allowed = span_allowed(predicted[rows], starts, ends, follow, emissions.shape[2])  # (S, T, K)
    probabilities = span_probabilities(tagger, emissions, mask, allowed, rows).tolist()
    for (row, label, start, end), probability in zip(found, probabilities):
        spans[row].append(Span(label, start, end, " ".join(sentences[row][start:end]), probability))
    return spans


@torch.no_grad()
def tag_predictions(tagger, batch, sentences: list[list[str]], labels: list[str],
                    entity_tags: bool) -> list[TagPrediction]:
    """The tagger's prediction of each sentence of `batch`, with probabilities (and spans)."""
    emissions = tagger(batch).float()  # (B, T, K)
    best = tagger.decode(emissions, batch.mask)
    probabilities = tag_probabilities(tagger, emissions, batch.mask)  # (B, T, K)
    tag_ids = {label: index for index, label in enumerate(labels)}
    tags = [[labels[i] for i in ids] for ids in best]
    spans = (entity_spans(tagger, emissions, batch.mask, sentences, tags, tag_ids) if entity_tags
             else [None] * len(best))
    predictions = []
    for row, (tokens, ids) in enumerate(zip(sentences, best)):
        confidences = probabilities[row, torch.arange(len(ids)), torch.tensor(ids)].tolist()
        predictions.append(TagPrediction(list(tokens), tags[row], confidences, spans[row]))
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
