"""`elmo vocab`: count a tokenized corpus and write the softmax vocabulary (see elmokit.training.vocab)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from elmokit.commands.common import add_progress_argument
from elmokit.io import refuse_output_over_input, refuse_overwrite
from elmokit.textfiles import expand_paths
from elmokit.training.vocab import make_vocab, stats_path


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "vocab", help="count tokens and write vocab.txt (+ vocab.json with the corpus counts)",
        description="Count the tokens of tokenized files (one sentence per line, plain or .gz, "
                    "files or globs) and write the bilm-tf vocabulary: <S>, </S>, <UNK>, then "
                    "tokens by descending count (ties by token). Beside it, a .json file records "
                    "n_tokens (words + one </S> per sentence, as bilm-tf's n_train_tokens), "
                    "n_sentences, n_types and the options, for the trainer.")
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="tokenized files or globs (quote globs)")
    parser.add_argument("-o", "--out", type=Path, required=True, help="vocabulary file to write, e.g. vocab.txt")
    parser.add_argument("--min-count", type=int, default=1, help="keep tokens seen at least this often (default: 1)")
    parser.add_argument("--max-size", type=int, default=None,
                        help="keep at most this many entries, the 3 special tokens included")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing vocabulary and its .json")
    add_progress_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    refuse_output_over_input(expand_paths(args.inputs), [args.out, stats_path(args.out)])
    refuse_overwrite([args.out, stats_path(args.out)], args.overwrite)
    stats = make_vocab(args.inputs, args.out, min_count=args.min_count, max_size=args.max_size,
                       progress=not args.no_progress)
    logging.getLogger(__name__).info(
        f"{stats['vocab_size']:,} entries written to {args.out} (of {stats['n_types']:,} types); "
        f"{stats['n_sentences']:,} sentences, {stats['n_tokens']:,} tokens with </S>, "
        f"{stats['n_unk_words']:,} words out of vocabulary; counts in {stats_path(args.out)}")
    return 0
