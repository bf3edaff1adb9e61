"""THE character-id scheme of ELMo (AllenNLP's). Nothing else in elmokit defines these numbers.

Each token becomes 50 ids: begin-of-word, its first 48 UTF-8 bytes, end-of-word, then in-word
padding; every id is shifted by +1 so that 0 means "no token" (right padding of a batch).

    byte b                 -> b + 1        (1..256)
    begin-of-sentence char -> 257          end-of-sentence char -> 258
    begin-of-word          -> 259          end-of-word          -> 260
    in-word padding        -> 261          no token             -> 0

The sentence-boundary tokens `<S>` and `</S>` are added inside the model (`add_boundaries`);
the literal strings "<S>" and "</S>" in the input map to those same boundary ids.

Everything here is vectorised with NumPy: the only per-token work is `str.encode`, driven by
`map` in C, never a Python loop over tokens or characters.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import torch

MAX_CHARS = 50  # ids per token
MAX_BYTES = MAX_CHARS - 2  # bytes kept per token (begin- and end-of-word take two slots)

# Raw (unshifted) ids of the special characters; bytes are 0..255.
_BOS_CHAR, _EOS_CHAR, _BOW, _EOW, _PAD = 256, 257, 258, 259, 260
SHIFT = 1  # every id is stored +1 so that 0 is free for "no token"

BEGIN_OF_WORD = _BOW + SHIFT
END_OF_WORD = _EOW + SHIFT
IN_WORD_PADDING = _PAD + SHIFT
N_CHAR_IDS = _PAD + SHIFT + 1  # 262 rows in the char-embedding table (row 0 = no token)

BOS_TOKEN = "<S>"
EOS_TOKEN = "</S>"


def _boundary_ids(char: int) -> np.ndarray:
    ids = np.full(MAX_CHARS, IN_WORD_PADDING, dtype=np.int64)
    ids[:3] = (BEGIN_OF_WORD, char + SHIFT, END_OF_WORD)
    return ids


BOS_IDS = _boundary_ids(_BOS_CHAR)  # (50,) [259, 257, 260, 261, ...]
EOS_IDS = _boundary_ids(_EOS_CHAR)  # (50,) [259, 258, 260, 261, ...]


def tokens_to_char_ids(tokens: Sequence[str]) -> np.ndarray:
    """Character ids of a flat sequence of tokens.

    Returns:
        int64 array (N, 50) of shifted ids; every row is a real token (no zeros).
    """
    n = len(tokens)
    if not all(map(isinstance, tokens, itertools.repeat(str))):
        bad = next(t for t in tokens if not isinstance(t, str))
        raise TypeError(f"tokens must be str, got {type(bad).__name__}: {bad!r}")
    # Unencodable lone surrogates are dropped, as the original mapper does.
    encoded = list(map(str.encode, tokens, itertools.repeat("utf-8"), itertools.repeat("ignore")))
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=n)
    data = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    kept = np.minimum(lengths, MAX_BYTES)  # a byte-level cut, as in the original

    ids = np.full((n, MAX_CHARS), IN_WORD_PADDING, dtype=np.int64)  # (N, 50)
    ids[:, 0] = BEGIN_OF_WORD
    rows = np.repeat(np.arange(n), kept)
    slot = np.arange(rows.size) - np.repeat(np.cumsum(kept) - kept, kept)  # byte index in token
    starts = np.cumsum(lengths) - lengths
    ids[rows, slot + 1] = data[starts[rows] + slot].astype(np.int64) + SHIFT
    ids[np.arange(n), kept + 1] = END_OF_WORD

    token_array = np.array(tokens, dtype=object)
    ids[token_array == BOS_TOKEN] = BOS_IDS
    ids[token_array == EOS_TOKEN] = EOS_IDS
    return ids


def as_lists(sentences):
    """Sentences given as numpy arrays of strings (a 2-D array, or arrays in a list), as AllenNLP's
    functions take them, as lists of token strings; anything else as it is (checked by the caller)."""
    if isinstance(sentences, np.ndarray):
        return sentences.tolist()
    if isinstance(sentences, list) and any(isinstance(sentence, np.ndarray) for sentence in sentences):
        return [sentence.tolist() if isinstance(sentence, np.ndarray) else sentence for sentence in sentences]
    return sentences


def batch_to_ids(batch: Sequence[Sequence[str]], *,
                 token_ids: Callable[[list[str]], np.ndarray] | None = None) -> torch.Tensor:
    """Character ids of a batch of tokenized sentences (AllenNLP's `batch_to_ids`).

    Args:
        batch: B lists of token strings (no `<S>`/`</S>`: the model adds them).
        token_ids: the function from a flat token list to its (N, W) ids; default ELMo's
            `tokens_to_char_ids` (a model with its own scheme passes `bilm.token_ids`).

    Returns:
        int64 tensor (B, T, 50), T = the longest sentence; shorter sentences are right-padded
        with all-zero rows. A batch of empty sentences gives (B, 0, 50).
    """
    batch = as_lists(batch)
    if isinstance(batch, str) or not isinstance(batch, Sequence):
        raise TypeError("batch must be a list of sentences (token lists), e.g. [['Hello', 'world']], "
                        f"got {type(batch).__name__}")
    for index, sentence in enumerate(batch):
        if isinstance(sentence, str) or not isinstance(sentence, Sequence):
            raise TypeError(f"batch[{index}] (one of the sentences) must be a list of token strings, "
                            f"got {type(sentence).__name__}: {sentence!r:.60}")
    lengths = np.fromiter(map(len, batch), dtype=np.int64, count=len(batch))
    longest = int(lengths.max()) if len(batch) else 0
    flat = (token_ids or tokens_to_char_ids)(list(itertools.chain.from_iterable(batch)))  # (N, W)

    ids = np.zeros((len(batch), longest, flat.shape[1]), dtype=np.int64)  # (B, T, W)
    rows = np.repeat(np.arange(len(batch)), lengths)
    positions = np.arange(rows.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    ids[rows, positions] = flat
    return torch.from_numpy(ids)


def token_mask(char_ids: torch.Tensor) -> torch.Tensor:
    """True where a position holds a real token (any id > 0). (..., T, 50) -> (..., T) bool."""
    return (char_ids > 0).any(dim=-1)


def add_boundaries(char_ids: torch.Tensor, bos_ids: np.ndarray = BOS_IDS, eos_ids: np.ndarray = EOS_IDS
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Wrap every sentence in `<S>` ... `</S>` (as bilm-tf and AllenNLP).

    Args:
        char_ids: (B, T, W) right-padded ids, on any device.
        bos_ids, eos_ids: (W,) the ids of `<S>` and `</S>` (a model with its own character
            vocabulary has its own; `BiLM.boundary_ids`).

    Returns (on the device of `char_ids`):
        ids: (B, T+2, 50) with BOS at 0, the n tokens at 1..n, EOS at n+1, zeros after.
        mask: (B, T+2) bool, true on positions 0..n+1.
    """
    batch_size, n_tokens, _ = char_ids.shape
    lengths = token_mask(char_ids).sum(dim=1)  # (B,)
    ids = char_ids.new_zeros(batch_size, n_tokens + 2, char_ids.shape[-1])  # (B, T+2, W)
    ids[:, 1:-1] = char_ids
    ids[:, 0] = ids.new_tensor(bos_ids)
    ids[torch.arange(batch_size, device=ids.device), lengths + 1] = ids.new_tensor(eos_ids)
    mask = torch.arange(n_tokens + 2, device=ids.device) < (lengths + 2).unsqueeze(1)  # (B, T+2)
    return ids, mask
