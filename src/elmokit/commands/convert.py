"""`elmo convert`: original options JSON + HDF5 <-> native directory (config.json + safetensors);
an ELMoForManyLangs folder -> native (its vocabulary in manylangs_vocab.json beside them); any
ELMo biLM -> one ONNX graph (`--to-onnx`, `elmokit.inference.onnx_export`)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from elmokit.commands.common import add_model_arguments, model_from_args, model_paths, model_reference
from elmokit.io import atomic_write_text, check_replaceable, refuse_output_over_input, refuse_overwrite
from elmokit.model.builtin import BUILTIN_MODEL
from elmokit.model.manylangs import ManyLangsBiLM, VOCABULARY_NAME
from elmokit.sources.tfhub import module_folder, module_provenance
from elmokit.model.weights import CONFIG_NAME, PROVENANCE_NAME, WEIGHTS_NAME, refuse_same_file, save_original, save_pretrained
from elmokit.training.model_card import CARD_NAME

ORIGINAL_NAMES = ("options.json", "weights.hdf5")  # what `--to-original DIR` writes in DIR


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "convert", help="convert between the original HDF5 files and the native format, or to ONNX",
        description="Convert a model. Original -> native: `elmo convert --options-file O "
                    "--weight-file W --to-native DIR`. Native -> original: `elmo convert --model DIR "
                    "--to-original OPTIONS.json WEIGHTS.hdf5` (or `--to-original OUT_DIR`: OUT_DIR/options.json and "
                    "OUT_DIR/weights.hdf5). A TF-Hub ELMo module folder or .tar.gz -> either: "
                    "`elmo convert --model FOLDER --to-native DIR` or `--to-original DIR` (provenance.json, or the "
                    "options' elmokit_provenance key, names the module and keeps its elmo mix; docs/loading.md). An ELMoForManyLangs model folder -> native: "
                    "`elmo convert --model FOLDER --to-native DIR` (its character and word vocabularies go to "
                    "DIR/manylangs_vocab.json); the original format cannot hold those, so --to-original "
                    "refuses such a model. An ELMo model (not ELMoForManyLangs) -> one ONNX graph of the stateless biLM for onnxruntime: "
                    "`elmo convert [MODEL options] --to-onnx FILE.onnx` (input char_ids int64 (batch, tokens, 50) "
                    "from batch_to_ids; outputs layers float32 (batch, layers, tokens, 2P) and mask bool (batch, "
                    "tokens); with --mix-weights a third output, the scalar mix; checked against elmokit in "
                    "onnxruntime before it is written; needs the [onnx] extra; docs/deployment.md). Any ELMo model -> "
                    "a folder that sentence-transformers loads: `elmo convert [MODEL options] "
                    "--to-sentence-transformers DIR` (docs/integrations.md).")
    add_model_arguments(parser, positional=True)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--to-native", type=Path, metavar="DIR", help="write a native model directory")
    target.add_argument("--to-original", type=Path, nargs="+", metavar="PATH",
                        help="write an original options JSON and HDF5 weight file: `--to-original DIR` as "
                             f"DIR/{ORIGINAL_NAMES[0]} and DIR/{ORIGINAL_NAMES[1]}, `--to-original OPTIONS WEIGHTS` "
                             "at those two paths")
    target.add_argument("--to-onnx", type=Path, metavar="FILE.onnx",
                        help="write the stateless biLM as one ONNX graph (any batch and length), checked in "
                             "onnxruntime against elmokit before it is renamed into place")
    target.add_argument("--to-sentence-transformers", type=Path, metavar="DIR",
                        help="write a folder that sentence-transformers loads (SentenceTransformer(DIR), no "
                             "trust_remote_code): encode(texts) gives elmo serve's sentence vectors; with a model "
                             "card for the Hugging Face Hub (needs the [sentence-transformers] extra; "
                             "docs/integrations.md)")
    parser.add_argument("--license", metavar="ID",
                        help="with --to-sentence-transformers: the weights' license for the card's metadata, a Hub "
                             "license id such as apache-2.0 (default: the model's record; apache-2.0 for the "
                             "built-in model; else unknown)")
    parser.add_argument("--mix-weights", type=_floats, metavar="S0,S1,...",
                        help="with --to-onnx: add an output `mixed` (batch, tokens, 2P), the scalar mix "
                             "gamma * sum_k softmax(s)_k layer_k with these L+1 parameters s (before the softmax, "
                             "as Elmo's scalar_mix_parameters; 0,0,0 is the average of 3 layers)")
    parser.add_argument("--mix-gamma", type=_finite, default=1.0, metavar="G",
                        help="with --mix-weights: the mix's gamma (default 1)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    parser.set_defaults(func=run)


def _original_paths(given: list[Path]) -> list[Path]:
    """`--to-original`'s options and weights paths: a folder's two files, or the two paths given."""
    if len(given) == 1:
        if given[0].suffix.lower() in (".json", ".hdf5", ".h5") and not given[0].is_dir():
            raise ValueError(f"--to-original {given[0]}: one path is a folder to write {' and '.join(ORIGINAL_NAMES)} "
                             f"in, and this names a file: give both, --to-original OPTIONS.json WEIGHTS.hdf5")
        if given[0].exists() and not given[0].is_dir():
            raise ValueError(f"--to-original {given[0]}: one path is a folder to write {' and '.join(ORIGINAL_NAMES)} "
                             f"in, and this is a file (give OPTIONS WEIGHTS to name both files)")
        return [given[0] / name for name in ORIGINAL_NAMES]
    if len(given) > 2:
        raise ValueError(f"--to-original takes a folder DIR or the two files OPTIONS WEIGHTS, got {len(given)} paths")
    return given


def _floats(text: str) -> list[float]:
    try:
        values = [float(value) for value in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(value) for value in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated finite numbers such as 0,0,0, got {text!r}")
    return values


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    if args.mix_weights is not None and not args.to_onnx:
        raise ValueError("--mix-weights adds an output to the ONNX graph: give it with --to-onnx")
    if args.mix_gamma != 1.0 and args.mix_weights is None:
        raise ValueError("--mix-gamma scales the mix that --mix-weights adds: give both, or neither")
    if args.license is not None and not args.to_sentence_transformers:
        raise ValueError("--license goes on the model card that --to-sentence-transformers writes: give both")
    if args.to_original:
        args.to_original = _original_paths(args.to_original)
    written = ([args.to_native / name for name in (CONFIG_NAME, WEIGHTS_NAME, VOCABULARY_NAME, PROVENANCE_NAME, CARD_NAME)]
               if args.to_native else args.to_original or [args.to_onnx or args.to_sentence_transformers])
    refuse_output_over_input(model_paths(args), written)  # before the model is read; a folder replaced whole too
    if args.to_onnx:
        return _to_onnx(args)
    if args.to_sentence_transformers:
        return _to_sentence_transformers(args)
    if args.to_original:
        refuse_same_file(args.to_original)  # before loading: the options JSON would replace the weights
    model = model_from_args(args)
    module = module_folder(model_reference(args))  # a TF-Hub module: its record goes with the files
    record = module_provenance(module, model_reference(args)) if module is not None else None
    names = [CONFIG_NAME, WEIGHTS_NAME, *([VOCABULARY_NAME] if isinstance(model, ManyLangsBiLM) else [])]
    outputs = [args.to_native / name for name in names] if args.to_native else args.to_original
    refuse_overwrite(outputs, args.overwrite)
    if args.to_native:
        for stale in (PROVENANCE_NAME, CARD_NAME):  # the replaced model's record and card: not this model's
            if args.overwrite:
                (args.to_native / stale).unlink(missing_ok=True)
        save_pretrained(model, args.to_native)
        if record is not None:
            atomic_write_text(args.to_native / PROVENANCE_NAME, json.dumps(record, indent=2) + "\n")
            names.append(PROVENANCE_NAME)
        print(f"wrote {', '.join(names[:-1])} and {names[-1]} in {args.to_native}")
    else:
        args.to_original[0].parent.mkdir(parents=True, exist_ok=True)  # DIR of `--to-original DIR`
        save_original(model, *args.to_original, provenance=record)
        print(f"wrote {args.to_original[0]} and {args.to_original[1]}")
    return 0


def _to_onnx(args: argparse.Namespace) -> int:
    from elmokit.inference.onnx_export import TOLERANCE, export_onnx, require_onnx

    require_onnx("elmo convert --to-onnx")  # before the model is loaded
    refuse_overwrite([args.to_onnx], args.overwrite)
    check_replaceable(args.to_onnx)  # a folder, or a file above it, said before the model loads
    report = export_onnx(model_from_args(args), args.to_onnx, mix_parameters=args.mix_weights, mix_gamma=args.mix_gamma)
    print(f"wrote {args.to_onnx} ({report['bytes'] / 1e6:.1f} MB; outputs {', '.join(report['outputs'])}): "
          f"onnxruntime matches elmokit within {report['max_abs_diff']:.2g} (checked to {TOLERANCE:g})")
    return 0


def _to_sentence_transformers(args: argparse.Namespace) -> int:
    from elmokit.extras import require

    require("sentence-transformers", "elmo convert --to-sentence-transformers")  # before the model is loaded
    from elmokit.integrations.sentence_transformers import save_sentence_transformers

    refuse_overwrite([args.to_sentence_transformers], args.overwrite)
    model = model_from_args(args)
    reference = model_reference(args) or (f"{args.options_file} + {args.weight_file}" if args.options_file
                                          else BUILTIN_MODEL)
    save_sentence_transformers(model, args.to_sentence_transformers, license=args.license, overwrite=args.overwrite,
                               source=reference)
    print(f"wrote {args.to_sentence_transformers}: SentenceTransformer({str(args.to_sentence_transformers)!r}) "
          "loads it (modules.json, the biLM in elmokit's native layout, README.md for the Hub)")
    return 0
