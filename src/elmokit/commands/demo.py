"""`elmo demo`: a newcomer's first look: embed sample sentences and show the polysemy demo."""

from __future__ import annotations

import argparse
import time

import numpy as np

from elmokit.commands.common import add_model_arguments, model_from_args
from elmokit.commands.similar import print_result
from elmokit.inference.embedder import ElmoEmbedder
from elmokit.inference.samples import QUERY, SAMPLES
from elmokit.inference.similar import find_similar, query_position

DESCRIPTION = f"""\
Embed {SAMPLES.name}, 24 sentences with "play" in its senses of sport, theatre and music (and a
few others), with the model (default: the built-in English model), and print:

  1. the vectors each sentence gets (L+1 layers of 2P floats a token) and how long it took;
  2. the paper's polysemy demo: the occurrences of "play" nearest to "play" in the query
     sentence, per layer. At layer 0, the context-free token layer, every "play" has the same
     vector; the biLSTM layers tell the senses apart.

Change the query with --query and --word. `elmo similar` does the same on your own corpus."""


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "demo", help="embed sample sentences and show the polysemy demo (start here)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--query", default=QUERY, help=f"query sentence, whitespace-tokenized (default: {QUERY!r})")
    parser.add_argument("--word", default="play", help="the query word (default: play)")
    parser.add_argument("--top-k", type=int, default=4, help="neighbours per layer (default: 4)")
    add_model_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.top_k < 1:  # as elmo similar's
        raise ValueError(f"--top-k must be >= 1, got {args.top_k}")
    bilm = model_from_args(args)
    embedder = ElmoEmbedder(module=bilm)
    config = bilm.config
    n_parameters = bilm.n_parameters
    print(f"model: {args.model or args.weight_file or 'built-in'} ({config.lstm.n_layers} x {config.lstm.cell_dim} cells "
          f"-> {config.lstm.projection_dim}, {config.char_cnn.n_filters} char filters, {n_parameters:,} parameters)")

    sentences = [line.split() for line in SAMPLES.read_text(encoding="utf-8").splitlines() if line.strip()]
    start = time.perf_counter()
    vectors = list(embedder.embed_sentences(sentences, batch_size=32))
    seconds = time.perf_counter() - start
    n_tokens = sum(map(len, sentences))
    print(f"embedded {len(sentences)} sentences, {n_tokens} tokens in {seconds:.2f} s; "
          f"each token gets {vectors[0].shape[0]} layers of {vectors[0].shape[2]} floats")
    first = vectors[0]
    print(f"  e.g. {' '.join(sentences[0][:4])} ...: array {first.shape} float32, "
          f"norms per layer of {sentences[0][1]!r}: " + ", ".join(f"{np.linalg.norm(first[k, 1]):.2f}"
                                                                  for k in range(first.shape[0])))

    query = args.query.split()
    position = query_position(query, None, args.word)
    layers = list(range(config.n_output_layers))
    result = find_similar(embedder, query, position, SAMPLES, layers, args.top_k, False, None, False, 32, 256)
    print()
    print_result(argparse.Namespace(any_word=False, corpus=SAMPLES, tokenize=False), query, position, result)
    return 0
