# Why this file is long: the window layout, its exact resumable state and the distributed split
# of the corpus are one mechanism (each depends on the others' order of reading); split, a reader
# would have to hold three files to check that a resumed run sees the same windows.
"""The biLM's training data: shards of tokenized sentences -> windows of the original bilm-tf layout.

In the order data flows:

    shard files (one tokenized sentence per line, plain or .gz)
      -> `SentenceStream`: one epoch, one rank: seeded shard order, lines read one at a time,
         a bounded seeded shuffle buffer
      -> `LMBatcher`: B row streams of sentences packed one after another; windows of U positions
      -> `LMBatch`: char ids and softmax targets of both directions, and the mask

Shape notation: B rows (batch_size), U positions per window (unroll_steps), W = 50 char ids.

The layout (bilm-tf `_get_batch`). A sentence of n words is the forward sequence
`[<S>, w1 .. wn, </S>]` and the backward sequence, the same reversed in place, `[</S>, wn .. w1, <S>]`.
Each gives n + 1 (input, target) pairs, target = the next element of its sequence: forward
`<S>->w1, ..., wn-></S>`, backward `</S>->wn, ..., w1-><S>`; the last element is a target only
(bilm-tf carries it over as the first input of the next window and drops it when the
sentence is used up). A row lays the pairs of its sentences one after another; a window takes
the next U pairs of every row, and a row that has used up its sentence pulls the next sentence
of the shared stream, so position t of both directions always belongs to the same sentence. The
trainer carries the LSTM states of each row from one window to the next (truncated BPTT). Rows
only run dry at the end of the epoch: from then on their positions are padding (mask False,
char ids 0, targets 0).

Distributed reading. The shard order is shuffled by (seed, epoch), identically on every rank;
with at least as many shards as ranks, rank r reads the shards at positions r, r + world_size, ...
of that order; with fewer shards than ranks, every rank reads all shards and keeps the lines whose
running line index (over all lines of the ordered shards, blank ones included) is r modulo
world_size. Either way the ranks' sentences are disjoint and together cover the corpus; ranks
may get different numbers of windows per epoch.

Resuming. `state_dict()` after any batch records the exact position: the shard being read and
the number of lines read from it, the shuffle buffer (its sentences, as text), the RNG state,
and each row's current sentence with how many of its pairs were emitted. `load_state_dict()`
reopens that shard and skips the lines already read (reading, not tokenizing, at most one
shard), so the following batches are identical to those of the uninterrupted run. The state is
plain JSON-serialisable data; its size is dominated by the shuffle buffer (about
`buffer_size` x the mean line length).

Undecodable bytes in a shard are an error naming the file and line (`elmo prepare` only writes
UTF-8; a bad shard is corrupt, and silently training around it would hide that). Blank lines
and files without a sentence are skipped and counted in `SentenceStream.counters`.
"""

from __future__ import annotations

import collections
import gzip
import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import numpy as np
import torch

from elmokit.model.chars import BOS_TOKEN, EOS_TOKEN, MAX_CHARS, tokens_to_char_ids
from elmokit.textfiles import CorpusError, expand_paths, locate_decode_error, open_text, same_files
from elmokit.training.vocab import Vocabulary

STATE_FORMAT = "elmokit.LMBatcher/1"


@dataclass
class LMBatch:
    """One window of B rows x U positions, both directions.

    Attributes:
        forward_char_ids: (B, U, W) int64 char ids of the forward inputs; 0 where mask is False.
        backward_char_ids: (B, U, W) int64 char ids of the backward inputs (sentences reversed).
        forward_targets: (B, U) int64 vocab ids of the next forward element; 0 where mask is False.
        backward_targets: (B, U) int64 vocab ids of the next backward element (the previous word).
        mask: (B, U) bool, True where the position holds a real (input, target) pair; the True
            positions of a row are always a prefix of it.
        n_tokens: number of True entries of mask (targets per direction in this window).
    """

    forward_char_ids: torch.Tensor
    backward_char_ids: torch.Tensor
    forward_targets: torch.Tensor
    backward_targets: torch.Tensor
    mask: torch.Tensor
    n_tokens: int

    def to(self, device: torch.device | str, non_blocking: bool = False) -> LMBatch:
        moved = {name: getattr(self, name).to(device, non_blocking=non_blocking) for name in _TENSOR_FIELDS}
        return LMBatch(**moved, n_tokens=self.n_tokens)

    def pin_memory(self) -> LMBatch:
        pinned = {name: getattr(self, name).pin_memory() for name in _TENSOR_FIELDS}
        return LMBatch(**pinned, n_tokens=self.n_tokens)


_TENSOR_FIELDS = ("forward_char_ids", "backward_char_ids", "forward_targets", "backward_targets", "mask")


# ---------------------------------------------------------------------------------------------
# Sentences: one epoch, one rank, streamed and shuffled in bounded memory
# ---------------------------------------------------------------------------------------------

@dataclass
class ReadCounters:
    """What a `SentenceStream` has read so far (this rank only)."""

    lines: int = 0  # lines read from the shards this rank owns (blank ones included)
    sentences: int = 0  # non-blank lines handed on
    empty_lines: int = 0  # blank or whitespace-only lines skipped
    empty_files: int = 0  # shards read to the end without a single non-blank line


def shard_order(n_files: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Indices of the files in reading order for one epoch: the same on every rank."""
    order = list(range(n_files))
    if shuffle:
        random.Random(f"elmokit-shards-{seed}-{epoch}").shuffle(order)
    return order


class SentenceStream:
    """The sentences (stripped lines) of one epoch for one rank, never holding a whole shard.

    Args:
        files: shard paths, in a fixed order (the shuffle permutes them by seed and epoch).
        seed, epoch: make the shard order and the shuffle buffer's draws.
        rank, world_size: which part of the corpus this process reads (module docstring).
        shuffle: shuffle the shard order and the sentences (through the buffer); False reads
            the files in the given order, line by line.
        buffer_size: sentences held for shuffling; each sentence handed on is drawn at random
            from the buffer, which is refilled with the next line read.
        max_sentences: stop after this many sentences read (None: all of them).
    """

    def __init__(self, files: Sequence[Path], seed: int = 0, epoch: int = 0, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True, buffer_size: int = 10_000,
                 max_sentences: int | None = None):
        if not files:
            raise ValueError("no shard files given")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be at least 1, got {buffer_size}")
        if max_sentences is not None and max_sentences < 1:
            raise ValueError(f"max_sentences must be at least 1, got {max_sentences}")
        if max_sentences is not None and world_size > 1:  # counted per rank: say so rather than read N x ranks
            raise ValueError("max_sentences counts one rank's sentences; give it with world_size 1 only")
        self.max_sentences = max_sentences
        self.files = [Path(f) for f in files]
        self.seed, self.epoch, self.rank, self.world_size = seed, epoch, rank, world_size
        self.shuffle, self.buffer_size = shuffle, buffer_size
        order = shard_order(len(self.files), seed, epoch, shuffle)
        self.split_by_line = len(self.files) < world_size
        owned = order if self.split_by_line else order[rank::world_size]
        self.rank_files = [self.files[index] for index in owned]  # this rank's shards, in order

        self.counters = ReadCounters()
        self._rng = random.Random(f"elmokit-buffer-{seed}-{epoch}-{rank}")
        self._buffer: list[str] = []
        self._exhausted = False  # every owned line has been read into the buffer
        self._file_position = 0  # index into rank_files of the shard being read
        self._line_in_file = 0  # lines read from that shard
        self._line_index = 0  # lines read over all shards, for the split by line
        self._file_had_sentence = False
        self._handle: IO[str] | None = None

    def next_sentence(self) -> str | None:
        """The next sentence (a stripped, non-blank line), or None at the end of the epoch."""
        if not self.shuffle:
            return self._read_line()
        while len(self._buffer) < self.buffer_size and not self._exhausted:
            line = self._read_line()
            if line is None:
                self._exhausted = True
            else:
                self._buffer.append(line)
        if not self._buffer:
            return None
        drawn = self._rng.randrange(len(self._buffer))
        self._buffer[drawn], self._buffer[-1] = self._buffer[-1], self._buffer[drawn]
        return self._buffer.pop()

    def __iter__(self) -> Iterator[str]:
        return iter(self.next_sentence, None)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def _read_line(self) -> str | None:
        """The next non-blank line this rank owns, stripped; None after its last shard."""
        if self.max_sentences is not None and self.counters.sentences >= self.max_sentences:
            self.close()
            return None
        while self._file_position < len(self.rank_files):
            try:
                if self._handle is None:
                    self._open_current()
                line = next(self._handle, None)
            except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as error:
                raise self._read_error(error) from None
            if line is None:
                self._finish_file()
                continue
            self._line_in_file += 1
            self._line_index += 1
            if self.split_by_line and (self._line_index - 1) % self.world_size != self.rank:
                continue
            self.counters.lines += 1
            line = line.strip()
            if not line:
                self.counters.empty_lines += 1
                continue
            self._file_had_sentence = True
            self.counters.sentences += 1
            return line
        return None

    def _open_current(self) -> None:
        """Open the current shard and skip the lines already read from it (after a resume)."""
        self._handle = open_text(self.rank_files[self._file_position])
        collections.deque(itertools.islice(self._handle, self._line_in_file), maxlen=0)

    def _read_error(self, error: Exception) -> CorpusError:
        path = self.rank_files[self._file_position]
        self.close()
        if isinstance(error, UnicodeDecodeError):
            return CorpusError(locate_decode_error(path))
        return CorpusError(f"{path}: corrupt or truncated gzip file ({error})")

    def _finish_file(self) -> None:
        self.close()
        if not self._file_had_sentence:
            self.counters.empty_files += 1
        self._file_position += 1
        self._line_in_file = 0
        self._file_had_sentence = False

    # -- resuming -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        version, internal, gauss = self._rng.getstate()
        return {
            "file_position": self._file_position,
            "line_in_file": self._line_in_file,
            "line_index": self._line_index,
            "file_had_sentence": self._file_had_sentence,
            "exhausted": self._exhausted,
            "buffer": list(self._buffer),
            "rng": [version, list(internal), gauss],
            "counters": asdict(self.counters),
        }

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self._file_position = int(state["file_position"])
        self._line_in_file = int(state["line_in_file"])
        self._line_index = int(state["line_index"])
        self._file_had_sentence = bool(state["file_had_sentence"])
        self._exhausted = bool(state["exhausted"])
        self._buffer = list(state["buffer"])
        version, internal, gauss = state["rng"]
        self._rng.setstate((version, tuple(internal), gauss))
        self.counters = ReadCounters(**state["counters"])


# ---------------------------------------------------------------------------------------------
# Windows: B row streams of sentences, U positions at a time
# ---------------------------------------------------------------------------------------------

class LMBatcher:
    """Iterator over the `LMBatch` windows of one epoch (bilm-tf's layout; module docstring).

    Args:
        files: shard files or globs (one tokenized sentence per line, plain or .gz).
        vocab: maps target tokens to softmax ids (unknown ones to `<UNK>`).
        batch_size: B, rows per window (per rank).
        unroll_steps: U, positions per window (bilm-tf: 20).
        seed, epoch: make the shard order and the sentence shuffle; pass the epoch number so
            every epoch reads the corpus in a new order.
        rank, world_size: this process's part of the corpus (module docstring).
        shuffle: False reads the files in order, sentence after sentence (evaluation).
        buffer_size: sentences in the shuffle buffer.
        max_sentences: read only the first this many sentences (None: all).

    `state_dict()` after any batch and `load_state_dict()` on a batcher built with the same
    arguments continue with exactly the batches the first one would have produced next.
    """

    def __init__(self, files: Sequence[str | Path] | str | Path, vocab: Vocabulary, batch_size: int,
                 unroll_steps: int, seed: int = 0, epoch: int = 0, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, buffer_size: int = 10_000, max_sentences: int | None = None):
        if batch_size < 1 or unroll_steps < 1:
            raise ValueError(f"batch_size and unroll_steps must be at least 1, got {batch_size}, {unroll_steps}")
        self.files = expand_paths([files] if isinstance(files, (str, Path)) else files)
        self.vocab, self.batch_size, self.unroll_steps = vocab, batch_size, unroll_steps
        self.stream = SentenceStream(self.files, seed=seed, epoch=epoch, rank=rank, world_size=world_size,
                                     shuffle=shuffle, buffer_size=buffer_size, max_sentences=max_sentences)
        self._config = {"files": list(map(str, self.files)), "seed": seed, "epoch": epoch, "rank": rank,
                        "world_size": world_size, "shuffle": shuffle, "buffer_size": buffer_size,
                        "batch_size": batch_size, "unroll_steps": unroll_steps}
        if max_sentences is not None:  # states saved before the option existed stay loadable
            self._config["max_sentences"] = max_sentences
        self._rows: list[list[str] | None] = [None] * batch_size  # each row's [<S>, w.., </S>]
        self._offsets = [0] * batch_size  # pairs of that sentence already emitted (0..n+1)
        self.n_batches = 0  # windows produced so far this epoch
        self._finished = False

    @property
    def counters(self) -> ReadCounters:
        return self.stream.counters

    def __iter__(self) -> LMBatcher:
        return self

    def __next__(self) -> LMBatch:
        if self._finished:
            raise StopIteration
        rows = [self._take_pairs(row) for row in range(self.batch_size)]  # B x 4 token lists
        lengths = torch.tensor([len(row[0]) for row in rows], device="cpu")  # (B,)
        if int(lengths.sum()) == 0:
            self._finished = True
            self.stream.close()
            raise StopIteration
        self.n_batches += 1
        return self._make_batch(rows, lengths)

    def _take_pairs(self, row: int) -> tuple[list[str], list[str], list[str], list[str]]:
        """The next up to U pairs of one row in both directions, pulling sentences as needed.

        Returns:
            forward inputs, forward targets, backward inputs, backward targets: token lists of
            one length, shorter than U only when the epoch ran out.
        """
        forward_inputs: list[str] = []
        forward_targets: list[str] = []
        backward_inputs: list[str] = []
        backward_targets: list[str] = []
        while len(forward_inputs) < self.unroll_steps:
            forward = self._rows[row]
            if forward is None or self._offsets[row] == len(forward) - 1:
                line = self.stream.next_sentence()
                if line is None:
                    self._rows[row] = None
                    break
                forward = self._rows[row] = [BOS_TOKEN, *line.split(), EOS_TOKEN]  # n + 2 tokens
                self._offsets[row] = 0
            backward = forward[::-1]  # [</S>, wn .. w1, <S>]
            start = self._offsets[row]
            stop = min(len(forward) - 1, start + self.unroll_steps - len(forward_inputs))
            forward_inputs += forward[start:stop]
            forward_targets += forward[start + 1:stop + 1]
            backward_inputs += backward[start:stop]
            backward_targets += backward[start + 1:stop + 1]
            self._offsets[row] = stop
        return forward_inputs, forward_targets, backward_inputs, backward_targets

    def _make_batch(self, rows: list[tuple[list[str], ...]], lengths: torch.Tensor) -> LMBatch:
        """Tensors of one window from the rows' token lists (row-major, each row a prefix)."""
        batch_size, steps = self.batch_size, self.unroll_steps
        mask = torch.arange(steps, device="cpu") < lengths.unsqueeze(1)  # (B, U)
        flat_mask = mask.view(-1).numpy()  # (B*U,)
        forward_inputs, forward_targets, backward_inputs, backward_targets = (
            list(itertools.chain.from_iterable(column)) for column in zip(*rows, strict=True))  # N tokens each
        n_tokens = len(forward_inputs)
        char_ids = tokens_to_char_ids(forward_inputs + backward_inputs)  # (2N, W)
        target_ids = self.vocab.encode(forward_targets + backward_targets)  # (2N,)

        def scatter(values: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
            out = np.zeros((batch_size * steps, *shape[2:]), dtype=np.int64)  # (B*U, ...)
            out[flat_mask] = values
            return torch.from_numpy(out.reshape(shape))

        return LMBatch(
            forward_char_ids=scatter(char_ids[:n_tokens], (batch_size, steps, MAX_CHARS)),  # (B, U, W)
            backward_char_ids=scatter(char_ids[n_tokens:], (batch_size, steps, MAX_CHARS)),  # (B, U, W)
            forward_targets=scatter(target_ids[:n_tokens], (batch_size, steps)),  # (B, U)
            backward_targets=scatter(target_ids[n_tokens:], (batch_size, steps)),  # (B, U)
            mask=mask,
            n_tokens=n_tokens,
        )

    # -- resuming -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The exact position after the last batch returned: plain JSON-serialisable data."""
        rows = [None if forward is None else [" ".join(forward[1:-1]), offset]
                for forward, offset in zip(self._rows, self._offsets, strict=True)]
        return {"format": STATE_FORMAT, "config": dict(self._config), "n_batches": self.n_batches,
                "finished": self._finished, "rows": rows, "stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (from `state_dict()` of a batcher built with the same arguments)."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not an LMBatcher state: format {state.get('format')!r}, expected {STATE_FORMAT!r}")
        for key in self._config.keys() | state["config"].keys():  # a key absent on one side: None there
            saved, expected = state["config"].get(key), self._config.get(key)
            if saved != expected and not (key == "files" and isinstance(saved, list)
                                          and same_files(saved, expected)):  # the same files however spelt
                raise ValueError(f"the data state was saved with {key}={saved!r}, this batcher has "
                                 f"{key}={expected!r}; build the LMBatcher with the saved arguments")
        if len(state["rows"]) != self.batch_size:
            raise ValueError(f"the data state holds {len(state['rows'])} rows, batch_size is {self.batch_size}")
        self._rows = [None if row is None else [BOS_TOKEN, *row[0].split(), EOS_TOKEN] for row in state["rows"]]
        self._offsets = [0 if row is None else int(row[1]) for row in state["rows"]]
        self.n_batches = int(state["n_batches"])
        self._finished = bool(state["finished"])
        self.stream.load_state_dict(state["stream"])


def eval_batches(files: Sequence[str | Path] | str | Path, vocab: Vocabulary, batch_size: int,
                 unroll_steps: int, rank: int = 0, world_size: int = 1,
                 max_sentences: int | None = None) -> LMBatcher:
    """Windows for perplexity: files in the given order, no shuffling, every pair exactly once
    (of the first `max_sentences` sentences of the files, when given).

    Every sentence of n words contributes its n + 1 forward and n + 1 backward targets once;
    positions past the end are padding (mask False). Sum the per-position losses over the mask
    and divide by the sum of `n_tokens` for the mean negative log-likelihood.
    """
    return LMBatcher(files, vocab, batch_size, unroll_steps, rank=rank, world_size=world_size, shuffle=False,
                     max_sentences=max_sentences)
