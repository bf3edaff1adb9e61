"""What `TaskRun.predict` and `TaskRun.evaluate` return.

    TagPrediction    a tagger's sentence: tokens, tags (entity tags in BIO), each tag's probability,
                     and for entity tags the spans with their probabilities
    LabelPrediction  a classifier's sentence: the label, its probability, every label's
    Evaluation       the scores of labelled examples, the predictions, and a table as its str

Probabilities (see `elmokit.tasks.confidence`): a CRF tagger's are marginals of the CRF
(forward-backward), a softmax tagger's and a classifier's the softmax of their scores.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elmokit.tasks.card import format_scores


@dataclass(frozen=True)
class Span:
    """An entity: tokens `start` to `end` (exclusive) with type `label`; `confidence` is the
    model's probability that those tokens carry exactly these tags and the next one does not
    continue the entity."""

    label: str
    start: int
    end: int
    text: str
    confidence: float

    def __repr__(self) -> str:
        return f"Span({self.label} {self.text!r} [{self.start}:{self.end}] {self.confidence:.2f})"


@dataclass(frozen=True)
class TagPrediction:
    """A tagged sentence. `confidences[i]` is the probability of `tags[i]` at token i; `spans` are
    the entities (entity tags only, else None)."""

    tokens: list[str]
    tags: list[str]
    confidences: list[float]
    spans: list[Span] | None = None

    def to_dict(self) -> dict:
        item = {"tokens": self.tokens, "tags": self.tags, "confidences": [round(c, 4) for c in self.confidences]}
        if self.spans is not None:
            item["spans"] = [{"label": s.label, "start": s.start, "end": s.end, "text": s.text,
                              "confidence": round(s.confidence, 4)} for s in self.spans]
        return item

    def __repr__(self) -> str:
        if self.spans is not None:
            shown = ", ".join(repr(span) for span in self.spans) or "no entity"
            return f"TagPrediction({len(self.tokens)} tokens: {shown})"
        pairs = [f"{token}/{tag} {c:.2f}" for token, tag, c in zip(self.tokens, self.tags, self.confidences)]
        more = f" ... (+{len(pairs) - 12})" if len(pairs) > 12 else ""
        return f"TagPrediction({' '.join(pairs[:12])}{more})"


@dataclass(frozen=True)
class LabelPrediction:
    """A classified sentence: `label`, its probability `confidence`, and every label's."""

    tokens: list[str]
    label: str
    confidence: float
    probabilities: dict[str, float] = field(repr=False)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "label": self.label, "confidence": round(self.confidence, 4),
                "probabilities": {k: round(v, 4) for k, v in self.probabilities.items()}}

    def __repr__(self) -> str:
        text = " ".join(self.tokens)
        return f"LabelPrediction({self.label!r} {self.confidence:.2f}: {text[:60]!r}{'...' if len(text) > 60 else ''})"


@dataclass(frozen=True)
class Evaluation:
    """Scores of labelled examples: `scores` (accuracy in %, or span precision, recall, F1 overall
    and `per_type`), `predictions` (bare labels, in order), how many, and from where."""

    scores: dict
    predictions: list = field(repr=False)
    n: int
    source: str
    metric: str

    @property
    def score(self) -> float:
        """The main figure: accuracy (%) or span F1."""
        return self.scores[self.metric]

    def __str__(self) -> str:
        return format_scores({"file": self.source, "n": self.n, **self.scores})

    def __repr__(self) -> str:
        name = "span F1" if self.metric == "f1" else "accuracy"
        return f"Evaluation({name} {self.score:.2f} on {self.n:,} sentences of {self.source})"
