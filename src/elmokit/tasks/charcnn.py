"""The tagger's character-level word encoder: a char CNN as in BiLSTM-CNN-CRF (Ma & Hovy, 2016).

Each word's characters are embedded, passed through dropout and one convolution, and max-pooled
over the word's characters, giving a vector that sees spelling, capitals and affixes (what a task
vocabulary learned from the training set alone misses for rare and unseen words).

The task's own character vocabulary is built from its training words (0 padding, 1 unknown);
it is not the biLM's byte-level char-id scheme (`elmokit.model.chars`).

Shape notation: B batch, T tokens, W characters of the longest word (capped), C char embedding
dim, F filters.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn

PAD_CHAR, UNK_CHAR = "<pad>", "<unk>"
MAX_WORD_CHARS = 30  # longer words keep their first 30 characters


def build_char_vocab(sentences: Sequence[Sequence[str]], min_count: int = 1) -> list[str]:
    """[PAD, UNK, the characters seen at least `min_count` times in `sentences`, sorted]."""
    counts = Counter(char for sentence in sentences for token in sentence for char in token)
    return [PAD_CHAR, UNK_CHAR, *sorted(char for char, count in counts.items() if count >= min_count)]


def encode_chars(sentences: Sequence[Sequence[str]], char_index: dict[str, int], n_positions: int,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """Character ids (B, T, W) long: 0 at padding, 1 for a character not in the vocabulary."""
    longest = max((len(token) for sentence in sentences for token in sentence), default=1)
    width = min(max(longest, 1), MAX_WORD_CHARS)
    padded = [[[0] * width for _ in range(n_positions)] for _ in sentences]
    for row, sentence in enumerate(sentences):
        for position, token in enumerate(sentence):
            chars = [char_index.get(char, 1) for char in token[:width]]
            padded[row][position][:len(chars)] = chars
    return torch.tensor(padded, dtype=torch.long, device=device)  # (B, T, W)


class CharWordEncoder(nn.Module):
    """word vector = max over characters of conv(dropout(char embeddings)): (B, T, W) -> (B, T, F).

    Args:
        n_chars: character vocabulary size, padding (0) and unknown (1) included.
        char_dim: C. n_filters: F. width: the convolution's width in characters (odd).
        dropout: on the character embeddings, before the convolution.
    """

    def __init__(self, n_chars: int, char_dim: int = 30, n_filters: int = 50, width: int = 3, dropout: float = 0.5):
        super().__init__()
        if width % 2 != 1:
            raise ValueError(f"char CNN width must be odd (the output keeps one position a character), got {width}")
        self.embedding = nn.Embedding(n_chars, char_dim, padding_idx=0)
        self.dropout = nn.Dropout(dropout)
        self.conv = nn.Conv1d(char_dim, n_filters, width, padding=width // 2)
        self.output_dim = n_filters

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        """char_ids (B, T, W), 0 = padding -> (B, T, F), zero for padding tokens."""
        batch_size, n_positions, width = char_ids.shape
        flat = char_ids.reshape(batch_size * n_positions, width)  # (B*T, W)
        embedded = self.dropout(self.embedding(flat)).transpose(1, 2)  # (B*T, C, W)
        features = self.conv(embedded)  # (B*T, F, W)
        is_char = (flat != 0).unsqueeze(1)  # (B*T, 1, W)
        pooled = features.masked_fill(~is_char, float("-inf")).amax(dim=2)  # (B*T, F)
        pooled = pooled.masked_fill(~is_char.any(dim=2), 0.0)  # padding tokens: no characters
        return pooled.reshape(batch_size, n_positions, -1)  # (B, T, F)
