"""The softmax vocabulary of the biLM (`elmo vocab`) and the `Vocabulary` that maps tokens to ids.

The inputs of ELMo are characters, so any word can be embedded; the vocabulary only names the
classes of the softmax. On disk it is bilm-tf's format: `vocab.txt`, one token per line, with
`<S>`, `</S>`, `<UNK>` first and then the corpus tokens by descending frequency (the
log-uniform negative sampler assumes that order; ties are broken by the token string so the file
is reproducible). Beside it, `vocab.json` records the corpus counts the trainer needs:

    n_tokens     words + one `</S>` per sentence: the number of targets per direction in an epoch,
                 which is what bilm-tf's `n_train_tokens` counts (each sentence of n words gives
                 n + 1 predictions: w1..wn and `</S>` forward, wn..w1 and `<S>` backward)
    n_words      whitespace tokens in the corpus
    n_sentences  non-blank lines
    n_types      distinct tokens in the corpus, before --min-count / --max-size
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from elmokit.model.chars import BOS_TOKEN, EOS_TOKEN
from elmokit.training.corpus import require_finished_shards
from elmokit.textfiles import CorpusError, expand_paths, locate_decode_error, open_text, text_size
from elmokit.io import atomic_write_text

UNK_TOKEN = "<UNK>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
READ_BLOCK_CHARS = 1 << 22  # lines are read in blocks of about 4 M characters


# ---------------------------------------------------------------------------------------------
# Counting a corpus and writing vocab.txt + vocab.json
# ---------------------------------------------------------------------------------------------

def count_tokens(paths: Sequence[Path], progress: bool = False) -> tuple[Counter, int]:
    """Token counts and the number of non-blank lines (sentences) of tokenized files.

    Lines are split on whitespace and counted in C (`Counter.update` over a chained block of
    split lines); a line that is not UTF-8 raises CorpusError naming file:line. `progress`:
    report the characters read (`elmokit.progress`).
    """
    from elmokit.progress import progress_bar

    counts: Counter = Counter()
    n_sentences = 0
    bar = progress_bar(total=sum(map(text_size, paths)), unit="B", unit_scale=True, desc="counting tokens",
                       enabled=progress)
    with bar:
        for path in paths:
            try:
                with open_text(path) as handle:
                    for block in iter(lambda: handle.readlines(READ_BLOCK_CHARS), []):
                        split_lines = list(map(str.split, block))
                        n_sentences += sum(map(bool, split_lines))
                        counts.update(itertools.chain.from_iterable(split_lines))
                        bar.update(sum(map(len, block)))
            except UnicodeDecodeError:
                raise CorpusError(locate_decode_error(path)) from None
    return counts, n_sentences


def build_vocab(counts: Counter, min_count: int = 1, max_size: int | None = None) -> list[str]:
    """`<S>`, `</S>`, `<UNK>`, then tokens seen at least `min_count` times, most frequent first.

    `max_size` caps the whole list, the three special tokens included. Literal `<S>`, `</S>`,
    `<UNK>` in the corpus are not counted again.
    """
    if min_count < 1:
        raise ValueError(f"min_count must be at least 1, got {min_count}")
    if max_size is not None and max_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"max_size must exceed {len(SPECIAL_TOKENS)} (the special tokens), got {max_size}")
    kept = [(token, count) for token, count in counts.items()
            if count >= min_count and token not in SPECIAL_TOKENS]
    kept.sort(key=lambda item: (-item[1], item[0]))
    tokens = list(SPECIAL_TOKENS) + [token for token, _ in kept]
    return tokens[:max_size] if max_size is not None else tokens


def make_vocab(
    inputs: Iterable[str | Path],
    out_path: str | Path,
    min_count: int = 1,
    max_size: int | None = None,
    progress: bool = False,
) -> dict:
    """Count tokenized files (plain or .gz, globs), write `out_path` and the stats JSON beside it
    (`progress`: report the reading, see `elmokit.progress`).

    Returns:
        the stats written to `out_path` with suffix `.json` (see the module docstring).
    """
    if stats_path(Path(out_path)) == Path(out_path):
        raise ValueError(f"{out_path}: a vocabulary file cannot end in .json, where its counts are written beside it "
                         f"(VOCAB.json): name it e.g. vocab.txt")
    paths = expand_paths(inputs)
    require_finished_shards(paths, "the vocabulary's corpus")  # as elmo train does
    counts, n_sentences = count_tokens(paths, progress)
    if n_sentences == 0:
        raise CorpusError(f"no tokens in {', '.join(map(str, paths))}: every line is blank")
    tokens = build_vocab(counts, min_count, max_size)
    n_words = sum(counts.values())
    in_vocab = set(tokens)
    n_unk_words = sum(count for token, count in counts.items() if token not in in_vocab)
    stats = {
        "vocab_size": len(tokens),
        "n_tokens": n_words + n_sentences,
        "n_tokens_counts": "words + one </S> per sentence (bilm-tf's n_train_tokens)",
        "n_words": n_words,
        "n_sentences": n_sentences,
        "n_types": len(counts),
        "n_unk_words": n_unk_words,
        "min_count": min_count,
        "max_size": max_size,
        "files": list(map(str, paths)),
    }
    out_path = Path(out_path)
    atomic_write_text(out_path, "".join(token + "\n" for token in tokens))
    atomic_write_text(stats_path(out_path), json.dumps(stats, indent=2) + "\n")
    return stats


def stats_path(vocab_path: Path) -> Path:
    """vocab.txt -> vocab.json (the corpus counts written beside a vocabulary)."""
    return vocab_path.with_suffix(".json")


# ---------------------------------------------------------------------------------------------
# Vocabulary: tokens <-> ids
# ---------------------------------------------------------------------------------------------

class Vocabulary:
    """Token <-> id map of the softmax; unknown tokens map to `<UNK>`.

    Args:
        tokens: one per id; must hold `<S>`, `</S>`, `<UNK>` (anywhere) and no duplicates.
        n_tokens: corpus size in targets per direction (words + one `</S>` per sentence), if known.
    """

    def __init__(self, tokens: Sequence[str], n_tokens: int | None = None, source: str = "tokens"):
        self.tokens = list(tokens)
        self._ids = {token: index for index, token in enumerate(self.tokens)}
        if len(self._ids) != len(self.tokens):
            duplicate = next(t for t, n in Counter(self.tokens).items() if n > 1)
            raise ValueError(f"{source}: duplicate token {duplicate!r}")
        missing = [token for token in SPECIAL_TOKENS if token not in self._ids]
        if missing:
            raise ValueError(f"{source}: the vocabulary lacks {', '.join(missing)} "
                             f"(it must hold {', '.join(SPECIAL_TOKENS)})")
        self.bos_id = self._ids[BOS_TOKEN]
        self.eos_id = self._ids[EOS_TOKEN]
        self.unk_id = self._ids[UNK_TOKEN]
        self.n_tokens = n_tokens

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        """Read a bilm-tf vocabulary file (one token per line); `n_tokens` from the JSON beside it.

        Raises FileNotFoundError, or ValueError naming file:line for an empty file, a blank
        line, a token with whitespace inside, or a duplicate token.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no vocabulary file {path} (make one with `elmo vocab`)")
        tokens: list[str] = []
        first_line: dict[str, int] = {}
        with open_text(path) as handle:
            try:
                lines = handle.read().split("\n")
            except UnicodeDecodeError:
                raise CorpusError(locate_decode_error(path)) from None
        if lines and lines[-1] == "":
            lines.pop()
        if not lines:
            raise ValueError(f"{path}: the vocabulary is empty")
        for line_number, line in enumerate(lines, start=1):
            token = line.rstrip("\r")
            if not token or len(token.split()) != 1 or token != token.strip():
                raise ValueError(f"{path}:{line_number}: expected one token without spaces, got {line!r}")
            if token in first_line:
                raise ValueError(f"{path}:{line_number}: duplicate token {token!r} "
                                 f"(first on line {first_line[token]})")
            first_line[token] = line_number
            tokens.append(token)
        return cls(tokens, n_tokens=_read_n_tokens(stats_path(path)), source=str(path))

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, "".join(token + "\n" for token in self.tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    def __contains__(self, token: str) -> bool:
        return token in self._ids

    def token_to_id(self, token: str) -> int:
        return self._ids.get(token, self.unk_id)

    def id_to_token(self, index: int) -> str:
        return self.tokens[index]

    def encode(self, tokens: Sequence[str]) -> np.ndarray:
        """Ids of a flat sequence of tokens, `<UNK>` for unknown ones: int64 array (N,)."""
        return np.fromiter(map(self._ids.get, tokens, itertools.repeat(self.unk_id)),
                           dtype=np.int64, count=len(tokens))

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [self.tokens[index] for index in ids]


def _read_n_tokens(path: Path) -> int | None:
    if not path.is_file():
        return None
    try:
        return int(json.loads(path.read_text(encoding="utf-8"))["n_tokens"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: expected a JSON object with an integer 'n_tokens' ({error})") from None
