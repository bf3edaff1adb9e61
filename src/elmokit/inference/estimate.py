"""What an `elmo embed` run will write, and what it did: the size estimated before anything is
written (and the limit it is held to), and the report after (`elmokit.inference.files`).

    scan of the input (lines, tokens per line)  -> estimate_output_bytes  -> check_output_size
        (logged; above max_output_bytes: OutputTooLargeError; low disk: a warning)
    the run                                      -> EmbedReport (sentences, tokens, time, bytes)
"""

from __future__ import annotations

import array
import itertools
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elmokit.progress import format_count

# The options (files.EmbedOptions) and the embedder (files.Embedder) are typed Any here: files.py
# imports this module, and this one reads only a few of their fields.
log = logging.getLogger("elmokit.inference.files")  # the run's messages come from one logger


@dataclass
class InputScan:
    """What the scan before a run found: the lines, the tokens of each line (as the run will
    tokenize them) and the input's size in bytes (as text)."""

    n_lines: int
    line_tokens: array.array  # tokens of line i, for the estimate and the progress bar
    text_bytes: int

    @property
    def n_tokens(self) -> int:
        return sum(self.line_tokens)

    def tokens_of(self, lines: range) -> int:
        """Tokens of the lines in `lines` (a rank's lines: range(rank, n, world_size))."""
        return sum(itertools.islice(self.line_tokens, lines.start, lines.stop, lines.step))


# Bytes an array costs beyond its floats (measured on files of 300 to 20,000 sentences written
# here; h5py 3, numpy's .npz): an HDF5 dataset's object header and link, a zip member's headers
# and .npy header, plus its key; a Parquet row's line, tokens (the text again), list offsets and
# levels (measured on 306 lines of PTB, 22 tokens a line, pyarrow 26).
ARRAY_OVERHEAD_BYTES = {"hdf5": 350, "npz": 250, "parquet": 520}
# HDF5's superblock and root group; the zip's end record; Parquet's footer (the schema, row groups)
FILE_OVERHEAD_BYTES = {"hdf5": 4_096, "npz": 22, "parquet": 4_096}


def estimate_output_bytes(scan: InputScan, n_layers: int, dim: int, options: Any) -> int:
    """About how many bytes `elmo embed` writes for `scan`'s input: float32 vectors of `dim`
    (2P) per token (or per sentence with `sentence_vectors`), times `n_layers` for "all", an
    overhead per array, and `sentence_to_index` (about the input's text again, with the keys)."""
    vectors = scan.n_lines if options.sentence_vectors else scan.n_tokens
    layers = n_layers if options.output_format == "all" else 1
    data = 4 * dim * layers * vectors
    overhead = ARRAY_OVERHEAD_BYTES[options.file_format] * scan.n_lines
    index = 0 if options.forget_sentences else scan.text_bytes + 12 * scan.n_lines
    return data + overhead + index + FILE_OVERHEAD_BYTES[options.file_format]


def format_bytes(size: float) -> str:
    """1.3 GB, 78.1 MB, 950 kB (powers of 1000, as `ls -h --si` and disk makers count)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size:,.0f} B"


class OutputTooLargeError(ValueError):
    """The estimated output is above `max_output_bytes`; nothing was written."""

    def __init__(self, estimate: int, limit: int, detail: str):
        self.estimate, self.limit = estimate, limit
        super().__init__(f"the output would be about {format_bytes(estimate)} ({detail}), above the limit of "
                         f"{format_bytes(limit)} (max_output_bytes={limit}); nothing was written")


@dataclass
class EmbedReport:
    """What a run of `embed_file_report` did (this process's share of the work)."""

    n_sentences: int  # embedded by this process in this run (not those a resumed run had done)
    n_tokens: int
    seconds: float  # the whole call: scan, embedding, merge
    estimated_bytes: int  # the estimate made before writing (the whole output)
    output_bytes: int | None  # the output's size once written (rank 0), else None

    def summary(self) -> str:
        """"300 sentences, 6,512 tokens in 41.2 s (158 tokens/s); 78.1 MB written (estimated 77.9 MB)";
        a rate below 100 keeps two decimals ("0.43 tokens/s"), and a run without tokens has none."""
        rate = (f" ({format_count(self.n_tokens / self.seconds)} tokens/s)"
                if self.n_tokens and self.seconds > 0 else "")
        size = (f"; {format_bytes(self.output_bytes)} written (estimated {format_bytes(self.estimated_bytes)})"
                if self.output_bytes is not None else "")
        return f"{self.n_sentences:,} sentences, {self.n_tokens:,} tokens in {self.seconds:,.1f} s{rate}{size}"


def check_output_size(embedder: Any, scan: InputScan, options: Any, input_path: Path,
                      output_path: Path, max_output_bytes: int | None, speak: bool = True) -> int:
    """The estimated size of the output; logs it (with `speak`), refuses it above
    `max_output_bytes`, warns when the disk has less room than the run needs."""
    config = embedder.bilm.config
    estimate = estimate_output_bytes(scan, config.n_output_layers, config.output_dim, options)
    per = "sentence" if options.sentence_vectors else "token"
    layers = (f"{config.n_output_layers} layers" if options.output_format == "all"
              else f"the {options.output_format} layer" if options.output_format == "top" else "the layer average")
    detail = (f"{scan.n_lines:,} sentences, {scan.n_tokens:,} tokens; {layers} x {config.output_dim} "
              f"float32 a {per}")
    if max_output_bytes is not None and estimate > max_output_bytes:
        raise OutputTooLargeError(estimate, max_output_bytes, detail)
    if speak:
        log.info(f"embedding {input_path} into {output_path}: {detail}; about {format_bytes(estimate)} to write")
        free = shutil.disk_usage(output_path.resolve().parent).free
        if free < 2 * estimate:  # the segments, then the merged copy beside them for a moment
            log.warning(f"{output_path.resolve().parent} has {format_bytes(free)} free; this run needs about "
                        f"{format_bytes(2 * estimate)} at its end (the segments and the merged output)")
    return estimate
