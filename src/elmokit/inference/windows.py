"""What a call is cut into: token lists checked, and sentences grouped in windows of bounded
positions (what a call returns, the layer selection and the sentence vector: layers.py)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

from elmokit.model.chars import as_lists


def position_windows(sentences: Iterable[Sequence[str]], max_sentences: int, max_positions: int
                     ) -> Iterator[list[Sequence[str]]]:
    """Consecutive groups of at most `max_sentences` sentences and `max_positions` positions
    (tokens plus the two boundaries; a longer sentence goes alone): what a stream holds at once
    depends on these, never on the input's length."""
    window: list[Sequence[str]] = []
    positions = 0
    for sentence in sentences:
        size = len(sentence) + 2
        if window and (len(window) == max_sentences or positions + size > max_positions):
            yield window
            window, positions = [], 0
        window.append(sentence)
        positions += size
    if window:
        yield window



def check_tokens(sentence: Sequence[str], name: str = "sentence") -> None:
    """TypeError unless `sentence` is a list (any non-str sequence) of token strings: a bare
    string would otherwise be embedded character by character."""
    if isinstance(sentence, (str, bytes)) or not isinstance(sentence, Sequence):
        hint = "; split it into tokens first, e.g. text.split()" if isinstance(sentence, str) else ""
        raise TypeError(f"{name} must be a list of token strings such as ['Hello', 'world'], "
                        f"got {type(sentence).__name__} {sentence!r:.60}{hint}")
    if not all(map(isinstance, sentence, itertools.repeat(str))):
        bad = next(token for token in sentence if not isinstance(token, str))
        raise TypeError(f"{name} must hold token strings, got {type(bad).__name__} {bad!r:.60}")


def token_list(sentence: Sequence[str], name: str = "sentence") -> Sequence[str]:
    """`sentence` checked (`check_tokens`); a numpy array of strings given as a list."""
    sentence = as_lists(sentence)
    check_tokens(sentence, name)
    return sentence


def token_lists(sentences: Sequence[Sequence[str]], name: str = "sentences") -> Sequence[Sequence[str]]:
    """`sentences` checked (`check_sentences`); numpy arrays of strings given as lists."""
    sentences = as_lists(sentences)
    check_sentences(sentences, name)
    return sentences


def check_sentences(sentences: Sequence[Sequence[str]], name: str = "sentences") -> None:
    """TypeError unless `sentences` is a list of token lists (see `check_tokens`)."""
    if isinstance(sentences, (str, bytes)) or not isinstance(sentences, Sequence):
        raise TypeError(f"{name} must be a list of sentences, each a list of token strings such as "
                        f"[['Hello', 'world']], got {type(sentences).__name__} {sentences!r:.60}")
    for index, sentence in enumerate(sentences):
        check_tokens(sentence, f"{name}[{index}]")
