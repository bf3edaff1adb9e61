"""Arguments shared by several subcommands: which model to load."""

from __future__ import annotations

import argparse
from pathlib import Path

from elmokit.model import BiLM
from elmokit.weights import load_model


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model (default: the built-in English model)")
    group.add_argument("--model", type=Path, help="native model directory (config.json + model.safetensors)")
    group.add_argument("--options-file", type=Path, help="original options JSON (with --weight-file)")
    group.add_argument("--weight-file", type=Path, help="original HDF5 weight file (with --options-file)")


def model_from_args(args: argparse.Namespace) -> BiLM:
    if args.model is not None and (args.options_file or args.weight_file):
        raise ValueError("give either --model or --options-file with --weight-file, not both")
    if (args.options_file is None) != (args.weight_file is None):
        raise ValueError("--options-file and --weight-file go together")
    if args.options_file is not None:
        return load_model(args.options_file, args.weight_file)
    return load_model(args.model)
