"""Scoring text with a trained language model (always the full softmax).

    corpus_perplexity(model, vocab, files)   sentences packed into rows, state carried between
                                             windows, exactly as in training and validation
    sentence_scores(model, vocab, sentences) every sentence alone from a fresh state

Per direction a sentence of n words has n + 1 targets: forward w1 .. wn, </S>; backward
wn .. w1, <S>. Perplexity = exp(mean NLL); the average perplexity is exp of the mean of the two
directions' mean NLL (as bilm-tf).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from elmokit.model.chars import BOS_TOKEN, EOS_TOKEN, MAX_CHARS, tokens_to_char_ids
from elmokit.textfiles import CorpusError, expand_paths
from elmokit.training.data import eval_batches
from elmokit.devices import resolve_device
from elmokit.training.lm import LanguageModel
from elmokit.training.vocab import Vocabulary


@dataclass
class SentenceScore:
    """Summed NLL of each direction over the n + 1 targets of one sentence."""

    n_targets: int
    forward_nll: float
    backward_nll: float

    @property
    def forward_ppl(self) -> float:
        return math.exp(self.forward_nll / self.n_targets)

    @property
    def backward_ppl(self) -> float:
        return math.exp(self.backward_nll / self.n_targets)

    @property
    def ppl(self) -> float:
        return math.exp(0.5 * (self.forward_nll + self.backward_nll) / self.n_targets)


def corpus_perplexity(model: LanguageModel, vocab: Vocabulary, files: str | Path | Sequence[str | Path],
                      batch_size: int = 64, unroll_steps: int = 20, device: str | torch.device = "cpu",
                      max_sentences: int | None = None, progress: bool = False) -> dict[str, float]:
    """forward_ppl, backward_ppl, ppl and n_tokens of every sentence of `files` (of the first
    `max_sentences`, when given); CorpusError if they hold no sentence (an empty or blank-only file).
    `progress`: report the targets scored (`elmokit.progress`)."""
    from elmokit.progress import progress_bar
    from elmokit.training.corpus import count_targets
    from elmokit.training.loop import evaluate

    _check_vocab(model, vocab)
    device = resolve_device(device)
    files = expand_paths([files] if isinstance(files, (str, Path)) else list(files))  # one file or pattern, or many
    batches = eval_batches(files, vocab, batch_size, unroll_steps, max_sentences=max_sentences)
    total = count_targets(files, max_sentences) if progress else None
    with progress_bar(total=total, unit="tokens", unit_scale=True, desc="scoring", enabled=progress) as bar:
        result = evaluate(model.to(device), batches, device, bar=bar)
    if result["n_tokens"] == 0:
        raise CorpusError(f"nothing to score: {', '.join(map(str, files))} "
                          f"{'is' if len(files) == 1 else 'are'} empty or blank; expected one tokenized sentence a line")
    return result


@torch.no_grad()
def sentence_scores(model: LanguageModel, vocab: Vocabulary, sentences: Sequence[Sequence[str]],
                    batch_size: int = 64, device: str | torch.device = "cpu") -> Iterator[SentenceScore]:
    """One `SentenceScore` per sentence (each scored from a fresh LSTM state), in order."""
    _check_vocab(model, vocab)
    device = resolve_device(device)
    model.eval().to(device)
    for start in range(0, len(sentences), batch_size):
        group = sentences[start:start + batch_size]
        forward_ids, backward_ids, forward_targets, backward_targets, mask = _sentence_batch(group, vocab)
        hidden, _ = model.contextualize(forward_ids.to(device), backward_ids.to(device), None)  # (D, B, U, P)
        mask = mask.to(device)
        nll = []
        for direction, targets in enumerate((forward_targets, backward_targets)):
            per_target = model.target_nll(hidden[direction][mask], targets.to(device)[mask])  # (N,)
            per_position = torch.zeros(mask.shape, device=device).masked_scatter(mask, per_target)  # (B, U)
            nll.append(per_position.sum(dim=1).tolist())
        for row, sentence in enumerate(group):
            yield SentenceScore(len(sentence) + 1, nll[0][row], nll[1][row])


def _sentence_batch(sentences: Sequence[Sequence[str]], vocab: Vocabulary) -> tuple[torch.Tensor, ...]:
    """Char ids (B, U, W) and targets (B, U) of both directions and the mask (B, U), U = n + 1."""
    steps = max(len(sentence) for sentence in sentences) + 1
    lengths = torch.tensor([len(sentence) + 1 for sentence in sentences], device="cpu")
    mask = torch.arange(steps, device="cpu") < lengths.unsqueeze(1)  # (B, U), moved by the caller
    forward = [[BOS_TOKEN, *sentence, EOS_TOKEN] for sentence in sentences]
    backward = [sequence[::-1] for sequence in forward]
    flat_mask = mask.view(-1).numpy()

    def scatter(values: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
        out = np.zeros((mask.numel(), *shape[2:]), dtype=np.int64)
        out[flat_mask] = values
        return torch.from_numpy(out.reshape(shape))

    def layout(sequences: list[list[str]]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = [token for sequence in sequences for token in sequence[:-1]]
        targets = [token for sequence in sequences for token in sequence[1:]]
        return (scatter(tokens_to_char_ids(inputs), (len(sequences), steps, MAX_CHARS)),
                scatter(vocab.encode(targets), (len(sequences), steps)))

    forward_ids, forward_targets = layout(forward)
    backward_ids, backward_targets = layout(backward)
    return forward_ids, backward_ids, forward_targets, backward_targets, mask


def _check_vocab(model: LanguageModel, vocab: Vocabulary) -> None:
    if len(vocab) != model.vocab_size:
        raise ValueError(f"the vocabulary has {len(vocab)} tokens but the model's softmax has "
                         f"{model.vocab_size} rows; use the vocab.txt the model was trained with")
