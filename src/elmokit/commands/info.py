"""`elmo info`: what a model is: shape, parameters, vocabulary, where it came from."""

from __future__ import annotations

import argparse
import json

from pathlib import Path

from elmokit.model.builtin import BUILTIN_MODEL, builtin_model_dir
from elmokit.model.weights import read_provenance
from elmokit.commands.common import add_model_arguments, model_from_args, model_reference


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "info", help="describe a model: shape, parameters, vocabulary, provenance",
        description="Print a model's configuration, parameter count and, for native directories, "
                    "its vocabulary size and training provenance.")
    add_model_arguments(parser, positional=True)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.set_defaults(func=run)


def _count_lines(path: Path) -> int:
    """The lines of a UTF-8 text file; one that is not UTF-8 is an error naming its first bad line."""
    from elmokit.textfiles import CorpusError, locate_decode_error

    try:
        with open(path, encoding="utf-8") as handle:
            return sum(1 for _ in handle)
    except UnicodeDecodeError:
        raise CorpusError(f"{locate_decode_error(path)}; a vocabulary is UTF-8 text, one token a line") from None


def run(args: argparse.Namespace) -> int:
    model = model_from_args(args)
    config = model.config
    facts = {
        "char_cnn": config.char_cnn.__dict__ | {"n_filters": config.char_cnn.n_filters},
        "lstm": config.lstm.__dict__,
        "output_dim": config.output_dim,
        "n_output_layers": config.n_output_layers,
        "parameters": model.n_parameters,
    }
    reference = model_reference(args)
    directory = None
    if reference in (None, BUILTIN_MODEL) and args.options_file is None:
        directory = builtin_model_dir()
    elif reference is not None and Path(reference).is_dir():
        directory = Path(reference)
    elif reference is not None:
        facts["model"] = reference
    if directory is not None:
        facts["model"] = str(directory)
        vocab = directory / "vocab.txt"
        if vocab.is_file():
            facts["vocabulary_size"] = _count_lines(vocab)
        if recorded := read_provenance(directory):
            facts["provenance"] = recorded
    if args.json:
        print(json.dumps(facts, indent=2, default=list))
        return 0
    cnn, lstm = config.char_cnn, config.lstm
    if "model" in facts:
        print(f"model: {facts['model']}")
    print(f"ELMo biLM: {lstm.n_layers} layers x {lstm.cell_dim} cells, projection {lstm.projection_dim}, "
          f"{cnn.n_filters} char filters, {cnn.n_highway} highway")
    print(f"  output: {config.n_output_layers} layers x {config.output_dim} dims")
    print(f"  parameters: {facts['parameters']:,}")
    print(f"  char CNN: embedding {cnn.embedding_dim}, filters {[list(f) for f in cnn.filters]}, {cnn.activation}")
    print(f"  clipping: cell {lstm.cell_clip}, projection {lstm.proj_clip}")
    if "vocabulary_size" in facts:
        print(f"  vocabulary (of its training softmax): {facts['vocabulary_size']:,} tokens")
    for key, value in facts.get("provenance", {}).items():
        print(f"  {key}: {value}")
    return 0
