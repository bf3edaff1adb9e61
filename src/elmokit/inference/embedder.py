"""`ElmoEmbedder`: all L+1 layers of every token as numpy arrays, for sentences, batches, streams
and files (AllenNLP's class of the same name).

Stateless by default: the same sentence gives the same vectors whatever else is in the batch and
whatever came before; `stateful=True` reproduces the original carried LSTM state (as AllenNLP's
biLM, each row of a call starts from that row's final state of the call before).
Threads: one embedder may be called from many threads at once (the token cache and the carried
state are behind locks).
"""

from __future__ import annotations

import itertools
import numbers
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO

import numpy as np
import torch

from elmokit.devices import resolve_device
from elmokit.inference.cache import TokenCache
from elmokit.inference.elmo import (
    CarriedState,
    boundary_mask,
    boundary_rows,
    run_carried,
    place_bilm,
    token_layers,
    run_bilm,
)
from elmokit.inference.engine import bilm_contextualize, contextualize_sentences
from elmokit.inference.streams import default_rows
from elmokit.inference.layers import check_output_format, shape_output
from elmokit.inference.windows import position_windows, token_list, token_lists
from elmokit.model.bilm import BiLM, BiLMOutput
from elmokit.model.chars import BOS_TOKEN, EOS_TOKEN
from elmokit.sources.loading import load_model

# ---------------------------------------------------------------------------------------------
class ElmoEmbedder:
    """All L+1 layers of every token, as float32 arrays (L+1, n, 2P) (AllenNLP's `ElmoEmbedder`).

    Args:
        options_file: original options JSON (a path or an http(s) URL, downloaded into the cache),
            or a model directory (native or ELMoForManyLangs), a published name ("original", ...;
            `elmokit.sources.published`) or TF-Hub handle (then `weight_file` is None), or None for
            the built-in English model.
        weight_file: original HDF5 weights (a path or URL).
        cuda_device: -1 for the CPU (AllenNLP's argument), else a CUDA device index; an alias of `device`.
        stateful: carry the state between calls as the original did; by default every sentence is
            embedded from a fresh state, so results never depend on batching or order.
        cache_tokens: reuse the representation of words already seen (exact: the token layer is
            context-free); on by default.
        module: an already loaded `BiLM` (moved and converted in place: every holder of the
            module runs it in the precision last given for it).
        device: where to run ("cpu", "cuda", "cuda:N", "auto"; default: the CPU).
        dtype: torch.bfloat16 (or "bfloat16"): weights and products in bfloat16, the LSTM state and
            the outputs in float32 (stateless only; faster on a CPU with AVX512-BF16 or AMX:
            bench/results/embed.md gives the speed and error of each shape on the machine it names); "int8" (stateless, on the CPU, one with VNNI or AMX-INT8, float32
            weights): the LSTM's input and recurrent products in int8, the rest of the products
            in bfloat16 (`elmokit.model.int8`; bench/results/int8_quality.md); "float32" (exact), which
            also undoes an earlier "int8" or "bfloat16" on `module`. Default: the biLM's own
            precision (`elmokit.inference.elmo.bilm_precision`): float32 for a model loaded here; for
            `module`, its weights' dtype, or int8 if an earlier `dtype="int8"` marked it.
        threads: torch's CPU threads (for the whole process, as `torch.set_num_threads`). Default:
            the CPUs this process may use that other work leaves free (`elmokit.devices.use_threads`).

    The copies made from the weights (reordered products, the token cache) follow edits in
    place and `load_state_dict` (`elmokit.kernels.weights_key`), not edits through `.data`.
    """

    STREAM_WINDOW = 16  # batches that `embed_sentences` runs through `embed_many` at once
    POSITION_BUDGET = 16_384  # positions `embed_many` runs at once (the original shape: ~200 MB of outputs)
    DEFAULT_BATCH_SIZE = 64  # AllenNLP's: a stateful embedder's batches when no batch_size is given

    def __init__(self, options_file: str | Path | None = None, weight_file: str | Path | None = None,
                 cuda_device: int = -1, *, stateful: bool = False, cache_tokens: bool = True,
                 module: BiLM | None = None, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, threads: int | None = None):
        self.device = resolve_device(device, cuda_device)
        bilm = module if module is not None else load_model(options_file, weight_file)
        self.bilm = place_bilm(bilm, self.device, dtype, False, stateful, "ElmoEmbedder", threads).eval()
        self.bilm.requires_grad_(False)
        self.carried = CarriedState() if stateful else None
        self.cache = TokenCache(self.bilm) if cache_tokens else None

    def __getstate__(self) -> dict:
        """Pickling and copy.deepcopy: the token cache (a lock, and vectors recomputed exactly on
        demand) is left out and rebuilt empty; the carried state travels (`CarriedState`)."""
        return {**self.__dict__, "cache": self.cache is not None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.cache = TokenCache(self.bilm) if state["cache"] else None

    @property
    def output_dim(self) -> int:
        return self.bilm.output_dim

    def reset_states(self) -> None:
        if self.carried is not None:
            self.carried.reset()

    @torch.no_grad()
    def batch_layers(self, batch: Sequence[Sequence[str]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a batch: layers (B, L+1, T, 2P) without boundaries, and lengths (B,)."""
        batch = token_lists(batch, "batch")
        if self.cache is not None:
            output = self._run_cached(batch)
        else:
            output = run_bilm(self.bilm, self.bilm.batch_ids(batch).to(self.device), self.carried)
        return token_layers(output), output.mask.sum(dim=1) - 2

    def _run_cached(self, batch: Sequence[Sequence[str]]) -> BiLMOutput:
        lengths = torch.from_numpy(np.fromiter(map(len, batch), np.int64, len(batch))).to(self.device)
        token_embeddings = self.cache.embeddings(batch)  # (N, P)
        return run_carried(self.carried, len(batch), lambda state: bilm_contextualize(
            self.bilm, token_embeddings, boundary_mask(lengths), state, self.carried is not None))

    def batch_to_embeddings(self, batch: Sequence[Sequence[str]]) -> tuple[torch.Tensor, torch.Tensor]:
        """AllenNLP's `batch_to_embeddings`: the activations (B, L+1, T, 2P) float32 and the mask
        (B, T) bool of a batch of token lists, torch tensors on the embedder's device; zero past
        each sentence (layer 0 is the token layer twice). No sentences: (0, L+1, 0, 2P) and (0, 0)."""
        batch = token_lists(batch, "batch")
        if len(batch) == 0:
            return (torch.zeros(0, self.bilm.config.n_output_layers, 0, self.output_dim, device=self.device),
                    torch.zeros(0, 0, dtype=torch.bool, device=self.device))
        layers, lengths = self.batch_layers(batch)
        mask = torch.arange(layers.shape[2], device=layers.device) < lengths.unsqueeze(1)  # (B, T)
        return layers.float(), mask

    def embed_batch(self, batch: Sequence[Sequence[str]]) -> list[np.ndarray]:
        """One float32 array (L+1, n_i, 2P) per sentence; an empty sentence gives (L+1, 0, 2P).
        `batch` is a list of token lists (a str anywhere a list is expected: TypeError)."""
        batch = token_lists(batch, "batch")
        if len(batch) == 0:
            return []
        if self.carried is not None and len(batch) == 1 and len(batch[0]) == 0:
            # the original does not run the model for [[]]: the carried state stays untouched
            return [np.zeros((self.bilm.config.n_output_layers, 0, self.output_dim), np.float32)]
        layers, lengths = self.batch_layers(batch)
        layers = layers.float().cpu().numpy()
        return [layers[i, :, :n] for i, n in enumerate(lengths.tolist())]

    def embed_sentence(self, sentence: Sequence[str]) -> np.ndarray:
        """(L+1, n, 2P) float32 for one sentence, a list of n token strings (a str: TypeError)."""
        return self.embed_batch([token_list(sentence)])[0]

    def rows_for(self, batch_size: int | None, name: str = "batch_size") -> int:
        """What a `batch_size` argument means here: itself when given (an int >= 1, else an error
        naming `name`; one above sys.maxsize, more than any input holds, counts as sys.maxsize);
        None leaves the choice to the engine: a stateless embedder's rows of the recurrence for a
        full call of `POSITION_BUDGET` positions (`elmokit.inference.streams.default_rows`: 128 rows
        for every published shape; `stream_rows` takes fewer for a shorter input), a stateful one's
        batches AllenNLP's 64 consecutive sentences. On a GPU, where more rows pay further, give
        the rows (docs/gpu.md)."""
        if batch_size is None:
            return self.DEFAULT_BATCH_SIZE if self.carried is not None else self.rows_at(self.POSITION_BUDGET)
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
            raise TypeError(f"{name} must be an int >= 1 or None (the engine's choice), got {batch_size!r}")
        if batch_size < 1:
            raise ValueError(f"{name} must be >= 1 (or None: the engine's choice), got {batch_size}")
        return min(int(batch_size), sys.maxsize)  # more than any input holds: a larger one means the same

    def window_sentences(self, batch_size: int | None) -> int:
        """Sentences `embed_sentences` hands `embed_many` at once, stateless: `STREAM_WINDOW`
        batches of `batch_size`; with None, as many as `POSITION_BUDGET` positions hold (so that a
        window of short sentences still fills the engine's rows, `stream_rows`)."""
        if batch_size is not None:
            return self.rows_for(batch_size) * self.STREAM_WINDOW
        return max(1, self.POSITION_BUDGET // 2)

    def stream_rows(self, sentences: Sequence[Sequence[str]]) -> int:
        """The engine's rows for these sentences run at once (at most `POSITION_BUDGET` positions
        count): `elmokit.inference.streams.default_rows`. A stream of windows (`embed_sentences`,
        `elmo embed`) takes its first window's rows for every window: one row count, so the
        layers' reordered weights (made for the most rows a call has wanted, one set kept) are
        made once."""
        return self.rows_at(sum(len(sentence) + 2 for sentence in sentences))

    def rows_at(self, positions: int) -> int:
        """The engine's rows for a call of `positions` positions at once, of which at most
        `POSITION_BUDGET` count (a call holds no more): `elmokit.inference.streams.default_rows`.
        `elmo serve` takes these for its `--max-batch-tokens` unless given `--rows`."""
        return default_rows(self.bilm.lstm.cell_dim, min(positions, self.POSITION_BUDGET))

    def embed_many(self, sentences: Sequence[Sequence[str]], rows: int | None = None) -> list[np.ndarray]:
        """Stateless: one float32 array (L+1, n_i, 2P) per sentence, `rows` sentences in the
        recurrence at a time, each new sentence taking the row the last one freed (no row idles
        while a long sentence finishes); None: the engine's choice for each group of sentences run
        at once (`stream_rows`). The same numbers as `embed_batch`, sentence by sentence, whatever
        the rows. Memory is bounded: at most `POSITION_BUDGET` positions (or one sentence) run at once."""
        if self.carried is not None:
            raise ValueError("embed_many is stateless; a stateful embedder embeds with embed_batch")
        sentences = token_lists(sentences)
        rows = None if rows is None else self.rows_for(rows, "rows")
        sizes = np.fromiter(map(len, sentences), np.int64, len(sentences)) + 2
        results: list[np.ndarray] = []
        start = 0
        while start < len(sentences):  # consecutive groups of at most POSITION_BUDGET positions
            end = max(start + 1, int(np.searchsorted(np.cumsum(sizes[start:]), self.POSITION_BUDGET, "right")) + start)
            group_rows = rows or self.rows_at(int(sizes[start:end].sum()))  # the sizes already summed
            results.extend(self._embed_streamed(sentences[start:end], group_rows))
            start = end
        return results

    @torch.no_grad()
    def _embed_streamed(self, sentences: Sequence[Sequence[str]], rows: int) -> list[np.ndarray]:
        lengths = np.fromiter(map(len, sentences), np.int64, len(sentences))
        if self.cache is not None:
            token_embeddings = self.cache.embeddings(sentences)  # (N, P)
        else:
            tokens = [BOS_TOKEN, EOS_TOKEN, *itertools.chain.from_iterable(sentences)]
            table = self.bilm.encode_words(tokens)
            table_rows = boundary_rows(lengths, np.arange(2, len(tokens)))
            token_embeddings = table[torch.from_numpy(table_rows).to(table.device)]  # (N, P)
        layers = contextualize_sentences(self.bilm, token_embeddings, lengths + 2, rows)
        layers = [layer.float().cpu().numpy() for layer in layers]  # L+1 of (N, 2P)
        first = np.cumsum(lengths + 2) - (lengths + 2) + 1  # each sentence's first token
        return [np.stack([layer[start:start + n] for layer in layers])  # (L+1, n, 2P), its own copy
                for start, n in zip(first.tolist(), lengths.tolist())]

    def embed_sentences(self, sentences: Iterable[Sequence[str]], batch_size: int | None = None
                        ) -> Iterator[np.ndarray]:
        """A generator: the sentences in order, embedded `batch_size` at a time (None: the
        engine's choice, `rows_for`).

        Stateless, windows of up to `STREAM_WINDOW` batches and `POSITION_BUDGET` positions go
        through `embed_many` with `batch_size` rows in the recurrence (the results do not depend on the batching). Stateful,
        batches are consecutive groups, as in the original.
        """
        rows = self.rows_for(batch_size)
        if isinstance(sentences, (str, bytes)):
            raise TypeError(f"sentences must be an iterable of token lists, got {type(sentences).__name__} "
                            f"{sentences!r:.60}")
        if self.carried is not None:
            iterator = iter(sentences)
            while batch := list(itertools.islice(iterator, rows)):
                yield from self.embed_batch(batch)
            return
        for window in position_windows(sentences, self.window_sentences(batch_size), self.POSITION_BUDGET):
            batch_size = batch_size or self.stream_rows(window)  # None: the first window's, for every window
            yield from self.embed_many(window, rows=batch_size)

    def sentence_vectors(self, sentences: Iterable[Sequence[str]], batch_size: int | None = None,
                         output_format: str = "average") -> np.ndarray:
        """One vector per sentence, float32 (N, 2P): the mean over its tokens of the equal-weight
        average of the layers (`output_format="average"`, TF-Hub's `default` before training), or
        of the top layer ("top"); (N, L+1, 2P) for "all". An empty sentence gives zeros. What
        `elmo embed --sentence-vectors` stores (`elmokit.inference.layers.shape_output`)."""
        check_output_format(output_format)
        vectors = [shape_output(layers, output_format, True) for layers in self.embed_sentences(sentences, batch_size)]
        if not vectors:
            n_layers = self.bilm.config.n_output_layers
            return np.zeros((0, n_layers, self.output_dim) if output_format == "all" else (0, self.output_dim),
                            np.float32)
        return np.stack(vectors)

    def embed_file(self, input_file: str | Path | IO, output_file_path: str | Path, output_format: str = "all",
                   batch_size: int | None = None, forget_sentences: bool = False, use_sentence_keys: bool = False, *,
                   overwrite: bool = False) -> None:
        """Embed a file of whitespace-tokenized sentences, one per line, into HDF5 (as AllenNLP's).

        `input_file` is a path, or an open file (text or binary, as AllenNLP takes it; read to its
        end and closed).

        One dataset per line, keyed by the line number ("0", "1", ...) or by the sentence text
        with `use_sentence_keys`; shape (L+1, n, 2P) for "all", (n, 2P) for "top" and "average";
        plus `sentence_to_index` (JSON) unless `forget_sentences`. A blank line is an empty
        sentence. Streams batch by batch; the file appears only when complete. More options
        (.npz, sentence vectors, resume, long sentences): `elmokit.inference.files.embed_file`.
        An existing `output_file_path` is replaced only with `overwrite=True` (elmokit's own
        argument, after AllenNLP's; as `elmo embed --overwrite`), else FileExistsError.
        """
        from elmokit.inference.files import EmbedOptions, embed_file
        from elmokit.io import refuse_overwrite

        options = EmbedOptions(output_format=output_format, batch_size=batch_size,
                               forget_sentences=forget_sentences, use_sentence_keys=use_sentence_keys)
        refuse_overwrite([output_file_path], overwrite)  # before an open input is copied
        if not hasattr(input_file, "read"):
            embed_file(self, input_file, output_file_path, options, overwrite=overwrite)
            return
        output = Path(output_file_path)
        output.parent.mkdir(parents=True, exist_ok=True)
        handle, copy = tempfile.mkstemp(prefix=f".{output.name}.input.", suffix=".txt", dir=output.parent)
        try:
            with input_file, open(handle, "wb") as file:  # a path the streaming writer can read again
                for chunk in iter(lambda: input_file.read(2**20), type(input_file.read(0))()):
                    file.write(chunk.encode("utf-8") if isinstance(chunk, str) else chunk)
            embed_file(self, copy, output, options, overwrite=overwrite)
        finally:
            Path(copy).unlink(missing_ok=True)

    def __repr__(self) -> str:
        config = self.bilm.config.lstm
        return (f"ElmoEmbedder({config.n_layers} x {config.cell_dim} cells -> {config.projection_dim}, "
                f"{self.bilm.config.n_output_layers} layers of {self.output_dim}, device={self.device}, "
                f"{'stateful' if self.carried is not None else 'stateless'})")


