"""`elmo convert`: original options JSON + HDF5 <-> native directory (config.json + safetensors);
an ELMoForManyLangs folder -> native (its vocabulary in manylangs_vocab.json beside them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from elmokit.commands.common import add_model_arguments, model_from_args
from elmokit.io import refuse_overwrite
from elmokit.model.manylangs import ManyLangsBiLM, VOCABULARY_NAME
from elmokit.model.weights import CONFIG_NAME, WEIGHTS_NAME, refuse_same_file, save_original, save_pretrained


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "convert", help="convert between the original HDF5 files and the native format",
        description="Convert a model. Original -> native: `elmo convert --options-file O "
                    "--weight-file W --to-native DIR`. Native -> original: `elmo convert --model DIR "
                    "--to-original OPTIONS.json WEIGHTS.hdf5`. An ELMoForManyLangs model folder -> native: "
                    "`elmo convert --model FOLDER --to-native DIR` (its character and word vocabularies go to "
                    "DIR/manylangs_vocab.json); the original format cannot hold those, so --to-original "
                    "refuses such a model.")
    add_model_arguments(parser)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--to-native", type=Path, metavar="DIR", help="write a native model directory")
    target.add_argument("--to-original", type=Path, nargs=2, metavar=("OPTIONS", "WEIGHTS"),
                        help="write an original options JSON and HDF5 weight file")
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.to_original:
        refuse_same_file(args.to_original)  # before loading: the options JSON would replace the weights
    model = model_from_args(args)
    names = [CONFIG_NAME, WEIGHTS_NAME, *([VOCABULARY_NAME] if isinstance(model, ManyLangsBiLM) else [])]
    outputs = [args.to_native / name for name in names] if args.to_native else args.to_original
    refuse_overwrite(outputs, args.overwrite)
    if args.to_native:
        save_pretrained(model, args.to_native)
        print(f"wrote {', '.join(names[:-1])} and {names[-1]} in {args.to_native}")
    else:
        save_original(model, *args.to_original)
        print(f"wrote {args.to_original[0]} and {args.to_original[1]}")
    return 0
