"""`elmo similar`: the occurrences of a word in a corpus nearest to it in a query sentence, per
layer (the ELMo paper's polysemy demo), and optionally a 2-D picture of all its occurrences."""

from __future__ import annotations

import argparse
import logging
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
from elmokit.io import refuse_output_over_input, refuse_overwrite
from elmokit.inference.embedder import ElmoEmbedder
from elmokit.inference.files import check_input_file, make_tokenizer
from elmokit.extras import require
from elmokit.inference.similar import (
    check_max_length,
    cue_labels,
    find_similar,
    highlight,
    kmeans,
    pca_2d,
    plot_occurrences,
    query_position,
    read_corpus_lines,
)

DESCRIPTION = """\
Find the occurrences of a word in CORPUS (UTF-8, one sentence per line) whose contextual vectors
are nearest (cosine) to the word's vector in the query sentence, at each layer of the biLM.
Layer 0 is the context-free token layer: every occurrence of the same word has the same vector
there (cosine 1.0000), while layers 1 and 2 separate the word's senses and uses.

The query word is --position (0-based token index) or the first occurrence of --word. Neighbours
are printed best first as: rank, cosine, line number (1-based) and the sentence with the word in
[brackets]; each layer's header gives the range of cosines over all occurrences.

--plot OUT.png draws every occurrence of the word in CORPUS at --plot-layer, projected on its two
principal components (PCA), the query as a black star. Points are coloured by --colour-by cue
words (each occurrence gets the first cue word its sentence contains, case-insensitive, or
'other'), or else by k-means clusters (--clusters, cosine geometry) of the full vectors."""


MAX_CLUSTERS = 20  # --clusters: the colours of one plot


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "similar", help="nearest occurrences of a word in context, per layer (polysemy demo)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", type=Path, help="text file (plain or .gz), one sentence per line")
    parser.add_argument("--query", required=True, help="the query sentence (tokenized like the corpus)")
    parser.add_argument("--position", type=int, help="0-based index of the query word in the query sentence")
    parser.add_argument("--word", help="the query word: its first occurrence in the query sentence")
    parser.add_argument("--any-word", action="store_true",
                        help="rank every token of the corpus, not only occurrences of the same word")
    parser.add_argument("--top-k", type=int, default=5, help="neighbours to show per layer (default: 5)")
    parser.add_argument("--layer", type=int, action="append",
                        help="a layer to rank by (0 = token layer); repeat for several (default: all)")
    parser.add_argument("--tokenize", action="store_true",
                        help="query and corpus are raw text: Moses-tokenize them (default: whitespace)")
    parser.add_argument("--plot", type=Path, metavar="OUT.png", help="write a 2-D PCA picture of the occurrences")
    parser.add_argument("--plot-layer", type=int, help="layer to picture (default: the top layer)")
    parser.add_argument("--colour-by", metavar="CUE,CUE,...",
                        help="colour the picture by cue words found in each sentence, e.g. sport,theatre")
    parser.add_argument("--clusters", type=int, default=2,
                        help="k-means clusters to colour by, without --colour-by (default: 2)")
    parser.add_argument("--overwrite", action="store_true", help="replace the --plot file if it exists")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per batch (default: 64)")
    parser.add_argument("--max-length", type=int, default=256,
                        help="longer corpus sentences are embedded in overlapping windows (default: 256)")
    add_model_arguments(parser)
    add_progress_argument(parser)
    add_device_arguments(parser, dtype=True)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    refuse_output_over_input([args.corpus, *model_paths(args)], [] if args.plot is None else [args.plot])
    check_input_file(args.corpus, "corpus")
    if args.plot is not None:
        if args.plot.is_dir():
            raise IsADirectoryError(f"--plot is a directory, expected a file name: {args.plot}")
        refuse_overwrite([args.plot], args.overwrite)
        require("plot", "elmo similar --plot")  # before the corpus is embedded, not after
    for name in ("top_k", "batch_size", "clusters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.clusters > MAX_CLUSTERS:  # k-means loops over k in Python, and a plot tells apart a few colours
        raise ValueError(f"--clusters must be at most {MAX_CLUSTERS} (colours a plot tells apart), got {args.clusters}")
    check_max_length(args.max_length)
    query = make_tokenizer(args.tokenize)(args.query)
    position = query_position(query, args.position, args.word)
    embedder = ElmoEmbedder(module=model_from_args(args), device=device_from_args(args), dtype=args.dtype)
    n_layers = embedder.bilm.config.n_output_layers
    layers = sorted(set(args.layer)) if args.layer else list(range(n_layers))
    plot_layer = n_layers - 1 if args.plot_layer is None else args.plot_layer
    for layer in [*layers, plot_layer]:
        if not 0 <= layer < n_layers:
            raise ValueError(f"layer {layer} does not exist: the model has layers 0 to {n_layers - 1}")

    result = find_similar(embedder, query, position, args.corpus, layers, args.top_k, args.any_word,
                          plot_layer if args.plot else None, args.tokenize, args.batch_size, args.max_length,
                          progress=not args.no_progress)
    print_result(args, query, position, result)
    if args.plot is not None:
        _plot(args, query, position, result, embedder, plot_layer)
    return 0


def print_result(args: argparse.Namespace, query: list[str], position: int, result) -> None:
    kind = "any word" if args.any_word else f"occurrences of {result.word!r}"
    print(f"query: {highlight(query, position)}")
    print(f"corpus: {args.corpus} ({result.n_sentences:,} sentences); ranking {kind} by cosine")
    wanted = {int(line) for n in result.neighbours for line in n.lines}
    tokenize = make_tokenizer(args.tokenize)
    texts = {i: tokenize(line) for i, line in read_corpus_lines(args.corpus, wanted).items()}
    for neighbours in result.neighbours:
        name = "context-free token layer" if neighbours.layer == 0 else f"biLSTM layer {neighbours.layer}"
        print(f"\nlayer {neighbours.layer} ({name}):", end=" ")
        if neighbours.n_seen == 0:
            print(f"no occurrence of {result.word!r} in the corpus")
            continue
        print(f"{neighbours.n_seen:,} candidates, cosine {neighbours.lowest:.4f} to {neighbours.highest:.4f}")
        if neighbours.layer == 0 and not args.any_word and result.context_free:
            print(f"  (every occurrence of {result.word!r} has the same layer-0 vector as the query)")
        for rank, (score, line, token) in enumerate(zip(neighbours.scores, neighbours.lines,
                                                        neighbours.positions), start=1):
            print(f"  {rank:2d}  {score:.4f}  line {line + 1}: {highlight(texts[int(line)], int(token))}")


def _plot(args: argparse.Namespace, query: list[str], position: int, result, embedder: ElmoEmbedder,
          plot_layer: int) -> None:
    if len(result.plot_vectors) == 0:
        raise ValueError(f"nothing to plot: {result.word!r} does not occur in {args.corpus}")
    vectors = torch.from_numpy(result.plot_vectors).double()  # (N, 2P)
    mean, axes, projections = pca_2d(vectors)
    query_point = (torch.from_numpy(result.query_vectors[plot_layer]).double() - mean) @ axes  # (2,)
    if args.colour_by:
        cues = [cue.strip() for cue in args.colour_by.split(",") if cue.strip()]
        tokenize = make_tokenizer(args.tokenize)
        lines = read_corpus_lines(args.corpus, set(result.plot_lines.tolist()))
        texts = {i: tokenize(line) for i, line in lines.items()}
        labels = cue_labels([texts[int(line)] for line in result.plot_lines], cues)
        how = f"cue words {', '.join(cues)}"
    else:
        labels = [f"cluster {c + 1}" for c in kmeans(vectors, args.clusters).tolist()]
        how = f"{args.clusters}-means clusters"
    title = f"{result.word!r}: {len(vectors)} occurrences, layer {plot_layer}, PCA; colour: {how}"
    plot_occurrences(args.plot, projections.numpy(), labels, query_point.numpy(), title)
    logging.getLogger(__name__).info(f"wrote {args.plot} ({len(vectors)} occurrences)")
