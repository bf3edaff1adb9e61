"""A cache of token representations for an inference-only biLM: the char CNN, highway and
projection run once per distinct word (exact: the token layer is context-free)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import numpy as np
import torch

from elmokit.inference.elmo import bilm_precision, boundary_rows, module_device
from elmokit.kernels import weights_key
from elmokit.model.bilm import BiLM
from elmokit.model.chars import BOS_TOKEN, EOS_TOKEN

class TokenCache:
    """Token string -> its context-free representation (P floats), computed once per word.

    The char CNN and highway are most of a small model's FLOPs; in running text most tokens are
    words already seen. Unseen words go through the encoder in one batch. Bounded: it holds at
    most `max_bytes` of vectors (65,536 words at P = 128, 16,384 at P = 512) and starts over when
    full, so a long input never makes it grow further; the frequent words come back at once.

    The vectors follow the token encoder's weights and the biLM's precision: an edit in place, a
    move of the model (`kernels.weights_key`) or another `dtype` given for it (`elmo.bilm_precision`)
    starts the cache over at the next call.

    Threads: a call that adds words may start over and overwrite any row, so `embeddings` looks
    the rows up and reads them under one lock (`rows` alone is valid until the next addition).
    """

    def __init__(self, bilm: BiLM, max_bytes: int = 32 * 2**20):
        self.bilm = bilm
        row_bytes = 4 * bilm.config.lstm.projection_dim
        self.max_size = max(1024, max_bytes // row_bytes)
        self.vectors = torch.empty(self.max_size, bilm.config.lstm.projection_dim,  # pages touched as filled
                                   device=module_device(bilm))
        self.lock = threading.RLock()
        self.clear()

    def clear(self) -> None:
        self.index: dict[str, int] = {}
        self.weights = self._weights_key()

    def _weights_key(self) -> tuple:
        # the precision too: dtype="int8" (from any holder of the module) moves the encoder to bfloat16 products
        return bilm_precision(self.bilm), weights_key(self.bilm.token_encoder.parameters())

    def __repr__(self) -> str:
        return (f"TokenCache({len(self.index):,} of {self.max_size:,} words, {self.vectors.shape[1]} floats each, "
                f"device={self.vectors.device})")

    def embeddings(self, sentences: Sequence[Sequence[str]]) -> torch.Tensor:
        """The token layer of every position of `sentences` with boundaries, row-major
        (`[<S>, tokens of sentence 0, </S>, <S>, ...]`): (N, P), a copy."""
        lengths = np.fromiter(map(len, sentences), np.int64, len(sentences))
        tokens = [BOS_TOKEN, EOS_TOKEN, *itertools.chain.from_iterable(sentences)]
        with self.lock:
            rows = self.rows(tokens)
            table_rows = boundary_rows(lengths, rows[2:], rows[0], rows[1])
            return self.vectors[torch.from_numpy(table_rows).to(self.vectors.device)]  # (N, P)

    def rows(self, tokens: list[str]) -> np.ndarray:
        with self.lock:
            return self._rows(tokens)

    def _rows(self, tokens: list[str]) -> np.ndarray:
        if self._weights_key() != self.weights:  # the words' vectors were computed with other weights
            self.vectors = self.vectors.new_empty(self.max_size, self.vectors.shape[1], device=module_device(self.bilm))
            self.clear()
        rows = np.fromiter(map(self.index.get, tokens, itertools.repeat(-1)), np.int64, len(tokens))
        missing = rows < 0
        if missing.any():
            new_tokens = list(dict.fromkeys(itertools.compress(tokens, missing)))
            if len(self.index) + len(new_tokens) > self.max_size:
                self.clear()
                new_tokens = list(dict.fromkeys(tokens))
                if len(new_tokens) > self.max_size:  # one call with more distinct words than it holds
                    self.max_size = len(new_tokens)
                    self.vectors = self.vectors.new_empty(self.max_size, self.vectors.shape[1])
            self._add(new_tokens)
            rows = np.fromiter(map(self.index.__getitem__, tokens), np.int64, len(tokens))
        return rows

    def _add(self, tokens: list[str]) -> None:
        start = len(self.index)
        with torch.no_grad():
            self.vectors[start:start + len(tokens)] = self.bilm.encode_words(tokens)  # (n, P)
        self.index.update(zip(tokens, range(start, start + len(tokens))))


