"""`elmo prepare`: raw text -> tokenized shards, one sentence per line (see elmokit.training.corpus)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from elmokit.commands.common import add_progress_argument
from elmokit.io import refuse_output_over_input
from elmokit.textfiles import expand_paths
from elmokit.training.corpus import PREPARE_RECORD, prepare_corpus


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "prepare", help="split raw text into sentences and Moses tokens, written as shards",
        description="Read raw text (plain or .gz, one document or paragraph per line; files or "
                    "globs), split it into sentences (sentencex) and Moses tokens (sacremoses), "
                    "and write OUT/shard-00000.txt.gz, ... with one sentence per line, tokens "
                    "separated by single spaces, plus OUT/prepare.json with the counts (written first "
                    "as unfinished: elmo train and elmo vocab refuse the shards of a run that did not finish). "
                    "Chinese (--lang zh) is segmented into words with jieba instead of Moses. "
                    "Already tokenized input (PTB-like) is detected and only has its whitespace "
                    "normalised. A line that is not valid UTF-8 stops the run with its file and "
                    "line number, unless --skip-bad-lines.")
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="raw text files or globs (quote globs)")
    parser.add_argument("-o", "--out", type=Path, required=True, help="output directory for the shards")
    parser.add_argument("--shard-size", type=int, default=100_000, help="sentences per shard (default: 100000)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="processes for splitting and tokenizing (default: all cores)")
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--pretokenized", dest="pretokenized", action="store_true", default=None,
                      help="input is already one tokenized sentence per line: pass it through")
    form.add_argument("--raw", dest="pretokenized", action="store_false",
                      help="input is raw text: always split and tokenize (default: detect)")
    parser.add_argument("--lang", default="en",
                        help="language for sentence splitting and Moses (default: en): a code Moses knows "
                             "(those sacremoses ships nonbreaking prefixes for, and ja, ko, cjk; an unknown code "
                             "is refused); zh: Chinese, segmented into words with jieba (pip install 'elmokit[zh]')")
    parser.add_argument("--plain", action="store_true", help="write plain .txt shards instead of .txt.gz")
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="skip lines that are not valid UTF-8 (counted, the first one reported) "
                             "instead of stopping at the first one")
    parser.add_argument("--overwrite", action="store_true", help="replace shard files already in OUT")
    add_progress_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {args.workers}")
    written = [args.out / PREPARE_RECORD, *sorted(args.out.glob("shard-*.txt*"))]  # the old shards: replaced
    refuse_output_over_input(expand_paths(args.inputs), written)
    stats = prepare_corpus(
        args.inputs, args.out, shard_size=args.shard_size, workers=args.workers,
        pretokenized=args.pretokenized, lang=args.lang, compress=not args.plain,
        skip_bad_lines=args.skip_bad_lines, overwrite=args.overwrite, progress=not args.no_progress)
    form = "pre-tokenized (passed through)" if stats.pretokenized else "raw (split and tokenized)"
    skipped = (f"; {stats.bad_lines:,} undecodable lines skipped, the first at {stats.first_bad_line}"
               if stats.bad_lines else "")
    logging.getLogger(__name__).info(f"{len(stats.input_files)} input files, {form}: {stats.sentences:,} sentences, "
                                     f"{stats.tokens:,} tokens in {len(stats.shards)} shards under {args.out}{skipped}")
    return 0
