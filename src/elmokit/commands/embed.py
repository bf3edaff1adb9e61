"""`elmo embed`: a file of sentences -> HDF5, .npz or Parquet with the vectors of every token or sentence
(AllenNLP's layout), streamed batch by batch, resumable, and shared across processes by torchrun."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import threading
from pathlib import Path

import torch

from elmokit.commands.common import (
    add_device_arguments,
    add_model_arguments,
    add_progress_argument,
    device_from_args,
    model_from_args,
    model_paths,
)
from elmokit.io import check_replaceable_folder, refuse_output_over_input
from elmokit.inference.embedder import ElmoEmbedder
from elmokit.devices import check_threads
from elmokit.inference.estimate import OutputTooLargeError, format_bytes
from elmokit.inference.files import (
    EmbedOptions,
    close_distributed,
    distributed_from_env,
    embed_file_report,
    fix_malloc_mmap_threshold,
)
from elmokit.inference.parquet import is_parquet
from elmokit.inference.segments import FILE_FORMATS, format_for_path
from elmokit.progress import clear_stop, quiet, request_stop
from elmokit.tokenizer import check_lang

log = logging.getLogger(__name__)
DEFAULT_MAX_OUTPUT_GB = 10.0

DESCRIPTION = """\
Embed INPUT (UTF-8, plain or .gz; one sentence per line, tokens separated by whitespace, or raw
text with --tokenize; a blank line is an empty sentence, its key kept) into OUTPUT.

Layout (as AllenNLP's `elmo` command): one array per input line, keyed by the line number ("0",
"1", ...) or by the sentence text (--use-sentence-keys; a repeated sentence is stored once, and '%',
'/', '\\' and NUL are written %25, %2F, %5C, %00, "." and "sentence_to_index" as %2E and %73entence_to_index,
a blank line as "%"); shape (3, n, 2P) with --all, (n, 2P) with
--top (the last layer) or --average (the mean of the layers). With --sentence-vectors, the mean
over the sentence's tokens instead: (3, 2P) with --all, (2P,) with --top or --average (zeros for an
empty sentence). Plus 'sentence_to_index', a JSON string mapping each sentence to its key (not with
--forget-sentences). OUTPUT is HDF5 (one dataset per key), or .npz (one member per key, for
numpy.load) when it ends in .npz or with --format npz, or Parquet when it ends in .parquet or with
--format parquet: one row per line with the columns line (int64, 0-based), sentence (not with
--forget-sentences), tokens (list of strings) and embedding (float32 nested lists, the array above),
in row groups of about 32 MB (pyarrow: pip install 'elmokit[parquet]'). In Python,
elmokit.read_embeddings(OUTPUT) reads any of them back as {sentence or line number: array}.

Sentences longer than --max-length tokens are embedded in overlapping windows and stitched back.
Work goes to OUTPUT.partial/ and OUTPUT appears only when complete; after an interruption (or a
full disk), the same command with --resume continues from the last checkpoint; --overwrite
discards it instead. One run writes an OUTPUT at a time (OUTPUT.lock). Several processes:
`torchrun --nproc_per_node N -m elmokit embed ...` (each embeds every N-th line; rank 0 merges;
on GPUs each process takes the one of its LOCAL_RANK).

On a Ray cluster (pip install 'elmokit[ray]'; docs/scale.md): `elmo embed --ray ADDRESS --workers N
INPUT... OUTPUT_DIR` embeds text files (or Parquet files with a --text-column) with N actors, each
loading the model once (one GPU each with --device cuda), into Parquet files in OUTPUT_DIR: the rows
above, plus every column of a Parquet input, and `file` with several inputs. ADDRESS: auto (the
cluster this machine belongs to), ray://HOST:10001, or local (a Ray instance on this machine with N
CPUs). Ray shows the progress; OUTPUT_DIR appears when every file is written (OUTPUT_DIR.partial
until then; no --resume).

Before writing, the output's size is estimated from the input's tokens and logged; a run
estimated above --max-output-gb (default 10; inf: no limit) stops there. After, it reports the sentences,
tokens, time, tokens/s and the size written. Progress: a bar on a terminal, a line every 30 s
in a log file (ELMOKIT_PROGRESS_INTERVAL), none with --no-progress or -q.

--device: cpu, cuda, cuda:N or auto (the default: the GPU when torch sees one). --dtype
bfloat16 runs the biLM's products in bfloat16 (the LSTM state and the outputs stay float32):
faster on a CPU with AVX512-BF16 and on GPUs, not exact (speed and error per layer:
bench/results/embed.md). --dtype int8 (the CPU only, one with VNNI or AMX-INT8) runs the LSTM's
input and recurrent products in int8 and the rest of the products in bfloat16, not exact either
(bench/results/embed.md, bench/results/int8_quality.md). --resume refuses a partial made in
another --dtype.

Memory stays bounded however long INPUT is (the peak at 1M and 2M tokens, and within a run by
quarter of its time: bench/results/embed_memory.md): on glibc, blocks above 256 kB get their own mappings, returned when freed. That costs
some speed in page faults; MALLOC_MMAP_THRESHOLD_=33554432 in the environment trades it back for
memory that grows with the input. oneDNN's caches of compiled products are bounded too: when the
first product runs, ONEDNN_PRIMITIVE_CACHE_CAPACITY and LRU_CACHE_CAPACITY are set to 64 in the
environment unless already set (set them to choose other sizes)."""


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "embed", help="embed a file of sentences into HDF5, .npz or Parquet", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", type=Path, nargs="+",
                        help="text file (plain or .gz), one sentence per line (with --ray: one or more, or Parquet files)")
    parser.add_argument("output", type=Path, help="HDF5, .npz or .parquet file to write (with --ray: a folder)")
    layers = parser.add_mutually_exclusive_group()
    layers.add_argument("--all", dest="output_format", action="store_const", const="all",
                        help="all layers (default)")
    layers.add_argument("--top", dest="output_format", action="store_const", const="top", help="top layer only")
    layers.add_argument("--average", dest="output_format", action="store_const", const="average",
                        help="the mean of the layers")
    parser.add_argument("--sentence-vectors", action="store_true",
                        help="one mean-pooled vector per sentence instead of one per token")
    parser.add_argument("--format", choices=FILE_FORMATS, dest="file_format",
                        help="output file format (default: npz or parquet if OUTPUT ends in .npz or .parquet, else hdf5)")
    parser.add_argument("--tokenize", action="store_true",
                        help="INPUT is raw text: Moses-tokenize each line (default: split on whitespace)")
    parser.add_argument("--lang", default="en",
                        help="language for --tokenize, a code Moses knows (those sacremoses ships nonbreaking "
                             "prefixes for, and ja, ko, cjk; an unknown code is refused; default: en)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="sentences in the recurrence at once (default: the engine's choice, 128 rows "
                             "for a full window of sentences, fewer for a short input); the same with --ray, in "
                             "each actor (default 64), whose Ray batches hold 256 lines or this many if more")
    parser.add_argument("--max-length", type=int, default=256,
                        help="longest sentence embedded in one piece; longer ones go in overlapping "
                             "windows (default: 256 tokens)")
    parser.add_argument("--overlap", type=int, default=32,
                        help="context tokens on each side of a window's used part (default: 32)")
    parser.add_argument("--use-sentence-keys", action="store_true", help="key the arrays by the sentence text")
    parser.add_argument("--forget-sentences", action="store_true", help="do not write sentence_to_index")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUTPUT if it exists, and discard an unfinished OUTPUT.partial/")
    parser.add_argument("--resume", action="store_true",
                        help="continue an interrupted run from OUTPUT.partial/ (same input and options)")
    parser.add_argument("--checkpoint-every", type=int, default=EmbedOptions.checkpoint_every,
                        help="sentences between checkpoints, the most --resume redoes (default: 2000)")
    parser.add_argument("--threads", type=int,
                        help="CPU threads for torch (default: the CPUs this process may use, by its affinity "
                             "and cgroup quota, less those other processes keep busy; at least 1)")
    parser.add_argument("--max-output-gb", type=float, default=DEFAULT_MAX_OUTPUT_GB, metavar="GB",
                        help="refuse to start when the output is estimated above GB gigabytes "
                             f"(10^9 bytes; default: {DEFAULT_MAX_OUTPUT_GB:g}); raise it to write more, or "
                             "give inf for no limit")
    on_ray = parser.add_argument_group("on a Ray cluster (docs/scale.md)")
    on_ray.add_argument("--ray", metavar="ADDRESS",
                     help="embed on Ray: auto, ray://HOST:PORT, or local (a Ray instance on this machine)")
    on_ray.add_argument("--workers", type=int, default=1, help="Ray actors, each with the model (default: 1)")
    on_ray.add_argument("--text-column",
                     help="the column of sentences of Parquet inputs (default: text; refused for text inputs)")
    add_progress_argument(parser)
    add_model_arguments(parser)
    add_device_arguments(parser, dtype=True, cuda_device=True)
    parser.set_defaults(func=run, output_format="all")


def run(args: argparse.Namespace) -> int:
    refuse_output_over_input([*args.input, *model_paths(args)], [args.output])  # before anything is read
    if args.tokenize:  # on Ray too, where the actors would tokenize an unknown language as English
        check_lang(args.lang, "--lang")
    if args.ray is not None:
        check_replaceable_folder(args.output)  # replaced whole once every file is written: said now
        return run_on_ray(args)
    if len(args.input) > 1:
        raise ValueError(f"several INPUT files ({len(args.input)}) need --ray; without it, embed one file at a time")
    args.input = args.input[0]
    if Path(args.input).is_file() and is_parquet(args.input):
        raise ValueError(f"{args.input} is a Parquet file: Parquet inputs are read by --ray (--ray local on this "
                         f"machine); without it INPUT is text, one sentence a line")
    options = EmbedOptions(
        output_format=args.output_format, file_format=args.file_format or format_for_path(args.output),
        sentence_vectors=args.sentence_vectors, use_sentence_keys=args.use_sentence_keys,
        forget_sentences=args.forget_sentences, tokenize=args.tokenize, lang=args.lang,
        batch_size=args.batch_size, max_length=args.max_length, overlap=args.overlap,
        checkpoint_every=args.checkpoint_every)
    if args.threads is not None:
        check_threads(args.threads, "--threads")
    if not args.max_output_gb > 0:
        raise ValueError(f"--max-output-gb must be a number of gigabytes > 0 (inf: no limit), got {args.max_output_gb}")
    fix_malloc_mmap_threshold()  # peak memory flat however long the input
    rank, world_size, barrier = distributed_from_env()
    try:
        device = device_from_args(args)
        if device.type == "cuda" and world_size > 1:  # one GPU a process
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        embedder = ElmoEmbedder(module=model_from_args(args), device=device, dtype=args.dtype, threads=args.threads)
        with sigterm_as_interrupt(args.output):
            report = embed_file_report(embedder, args.input, args.output, options, overwrite=args.overwrite,
                                       resume=args.resume, progress=not args.no_progress, rank=rank,
                                       world_size=world_size, barrier=barrier,
                                       max_output_bytes=None if math.isinf(args.max_output_gb)
                                       else int(args.max_output_gb * 1e9))
    except OutputTooLargeError as error:
        needed = f"{error.estimate / 1e9 * 1.1:.2g}"  # above the estimate, which is within a few %
        raise ValueError(f"{args.output} would be about {format_bytes(error.estimate)}, above --max-output-gb "
                         f"{args.max_output_gb:g}; pass --max-output-gb {needed} (or more) to write it, or ask "
                         "for less (--top or --average: one layer; --sentence-vectors: one vector a sentence)"
                         ) from None
    finally:
        close_distributed()
    if rank == 0:
        shared = f" (this process; {world_size} processes)" if world_size > 1 else ""
        log.info(f"wrote {args.output}: {report.summary()}{shared}")
    return 0


def run_on_ray(args: argparse.Namespace) -> int:
    """`elmo embed --ray`: `elmokit.ray.embed_files` with the model loaded here (and sent to each actor)."""
    from elmokit.ray import BATCH_ROWS, embed_files

    not_on_ray = [flag for flag, given in (("--resume", args.resume), ("--use-sentence-keys", args.use_sentence_keys),
                                           ("--format " + str(args.file_format), args.file_format not in (None, "parquet")),
                                           ("--checkpoint-every", args.checkpoint_every != EmbedOptions.checkpoint_every),
                                           ("--max-output-gb", args.max_output_gb != DEFAULT_MAX_OUTPUT_GB))
                  if given]
    if not_on_ray:
        raise ValueError(f"--ray writes a folder of Parquet files; {', '.join(not_on_ray)} does not apply to it")
    if args.threads is not None:
        raise ValueError("--threads does not apply to --ray: each of the --workers actors takes one CPU core")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    gpus = 1 if (args.device or "").startswith("cuda") or (args.cuda_device is not None and args.cuda_device >= 0) else 0
    summary = embed_files(args.input, args.output, address=args.ray, workers=args.workers,
                          text_column=args.text_column, forget_sentences=args.forget_sentences,
                          overwrite=args.overwrite, progress=not (args.no_progress or quiet()), quiet=quiet(),
                          model=model_from_args(args),
                          tokenize=args.tokenize, lang=args.lang, layers=args.output_format,
                          sentence_vectors=args.sentence_vectors, num_gpus=gpus, max_length=args.max_length,
                          overlap=args.overlap,
                          **({} if args.batch_size is None else  # the recurrence's rows, in Ray batches they fill
                             {"forward_rows": args.batch_size, "batch_size": max(BATCH_ROWS, args.batch_size)}),
                          dtype=None if args.dtype == "float32" else args.dtype)
    log.info(f"wrote {args.output}: {summary['rows']:,} rows, {summary['tokens']:,} tokens in {summary['files']} "
             f"Parquet files, {summary['seconds']:.1f} s ({summary['tokens'] / summary['seconds']:,.0f} tokens/s)")
    return 0


@contextlib.contextmanager
def sigterm_as_interrupt(output: Path):
    """SIGTERM (kill, a batch scheduler, torchrun stopping its processes) stops the run as Ctrl-C
    does: the segment being written and the lock are removed, the finished segments kept, and
    the command says so (KeyboardInterrupt: exit status 130)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        reason = f"SIGTERM; the finished segments are kept in {output}.partial: --resume continues the run"
        request_stop(reason)  # should the raise land in a finalizer and be lost, the loop stops at its next check
        raise KeyboardInterrupt(reason)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        clear_stop()
