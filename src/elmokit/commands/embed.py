"""`elmo embed`: a file of sentences -> HDF5 with the vectors of every token (spec §10 layout)."""

from __future__ import annotations

import argparse
from pathlib import Path

from elmokit.commands.common import add_model_arguments, model_from_args
from elmokit.elmo import ElmoEmbedder


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "embed", help="embed a file of sentences into HDF5",
        description="Embed INPUT (one whitespace-tokenized sentence per line; a blank line is an "
                    "empty sentence) into OUTPUT (HDF5): one dataset per line, keyed by line number, "
                    "shape (3, n, 2P) with --all, (n, 2P) with --top or --average, and "
                    "'sentence_to_index' mapping each sentence to its key.")
    parser.add_argument("input", type=Path, help="text file, one tokenized sentence per line")
    parser.add_argument("output", type=Path, help="HDF5 file to write")
    layers = parser.add_mutually_exclusive_group()
    layers.add_argument("--all", dest="output_format", action="store_const", const="all",
                        help="all layers (default)")
    layers.add_argument("--top", dest="output_format", action="store_const", const="top", help="top layer only")
    layers.add_argument("--average", dest="output_format", action="store_const", const="average",
                        help="the mean of the layers")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per batch (default 64)")
    parser.add_argument("--use-sentence-keys", action="store_true", help="key datasets by the sentence text")
    parser.add_argument("--forget-sentences", action="store_true", help="do not write sentence_to_index")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    add_model_arguments(parser)
    parser.set_defaults(func=run, output_format="all")


def run(args: argparse.Namespace) -> int:
    if args.input.is_dir():
        raise IsADirectoryError(f"input is a directory, expected a text file: {args.input}")
    if not args.input.is_file():
        raise FileNotFoundError(f"input file not found: {args.input}")
    if args.output.exists() and not args.overwrite:
        raise ValueError(f"output exists: {args.output} (use --overwrite to replace it)")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    embedder = ElmoEmbedder(module=model_from_args(args))
    embedder.embed_file(args.input, args.output, args.output_format, args.batch_size,
                        forget_sentences=args.forget_sentences, use_sentence_keys=args.use_sentence_keys)
    print(f"wrote {args.output}")
    return 0
