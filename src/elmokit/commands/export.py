"""`elmo export`: a trained model -> the original options JSON + HDF5, and/or a native directory."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "export", help="write a trained model in the original (bilm-tf/AllenNLP) or native format",
        description="Export a trained model: SOURCE is a training run directory (its best/ model, or "
                    "its last checkpoint with --last), a model directory, a checkpoint.pt file, or "
                    "'gutenberg-en' (the built-in model). "
                    "The original format drops the softmax; the native directory keeps it with vocab.txt.")
    parser.add_argument("source", type=Path, metavar="SOURCE", nargs="?",
                        help="run directory, model directory, checkpoint.pt or 'gutenberg-en' (the "
                             "built-in model) (or --model)")
    parser.add_argument("--model", type=Path, metavar="SOURCE",
                        help="the same as SOURCE, spelled as every command that takes a model spells it")
    parser.add_argument("--last", action="store_true", help="from a run directory, export its last checkpoint "
                        "instead of its best model")
    parser.add_argument("--original", nargs=2, type=Path, metavar=("OPTIONS_JSON", "WEIGHTS_HDF5"),
                        help="write the original options JSON and HDF5 weight file")
    parser.add_argument("--native", type=Path, metavar="DIR",
                        help="write a native model directory (config.json, model.safetensors with the "
                             "softmax, vocab.txt)")
    parser.add_argument("--no-softmax", action="store_true",
                        help="--native without the softmax: a model for embedding only (much smaller)")
    parser.add_argument("--dtype", choices=["float32", "float16"], default="float32",
                        help="storage precision of --native (float16 halves the file; loading gives float32)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace existing output files (even the run's own best/ model)")
    parser.set_defaults(func=run)


def one_source(positional: Path | None, option: Path | None) -> Path:
    """SOURCE or --model: one of them, once."""
    if positional is not None and option is not None and positional != option:
        raise ValueError(f"give the model once: SOURCE {positional} or --model {option}")
    if positional is None and option is None:
        raise ValueError("give the run or model to export: SOURCE or --model")
    return positional if positional is not None else option


def named_source(source: Path) -> Path:
    """SOURCE as a path: 'gutenberg-en' (when no such file is here) is the built-in model's
    directory, as in every command; another model name (published, a URL) is refused by name,
    for `elmo export` converts an elmokit model with its softmax."""
    from elmokit.model.builtin import BUILTIN_MODEL, builtin_model_dir
    from elmokit.sources.published import published_names

    if source.exists():
        return source
    if str(source) == BUILTIN_MODEL:
        return builtin_model_dir()
    if str(source) in published_names() or str(source).startswith(("http:/", "https:/")):  # Path keeps one "/"
        raise ValueError(f"{source}: elmo export converts a model trained by elmokit (a run directory, a model "
                         f"directory, a checkpoint.pt or '{BUILTIN_MODEL}'); a published model is read as it is "
                         "by every command (--model NAME), and `elmo download NAME` puts it in the cache")
    return source


def source_path(source: Path, last: bool = False) -> Path:
    """What `elmo export` reads of SOURCE (no file is opened here): its checkpoint file with
    `last` (a run's checkpoint.pt), a checkpoint file given, else the model folder (a run's best/)."""
    from elmokit.training.checkpoint import CHECKPOINT_NAME
    from elmokit.commands.perplexity import resolve_model_dir

    source = named_source(source)
    if source.is_dir() and last:
        source = source / CHECKPOINT_NAME
    return source if source.is_file() else resolve_model_dir(source)


def load_source(source: Path, last: bool = False):
    """(LanguageModel, vocab path or None, provenance or None) from a run dir, a model dir, a
    checkpoint file or the built-in model's name; a checkpoint's provenance is built from its
    progress and the run's metrics.jsonl beside it (`checkpoint_provenance`), a model dir's is
    its provenance.json."""
    from elmokit.model.weights import read_provenance
    from elmokit.training.checkpoint import (VOCAB_NAME, checkpoint_provenance, load_checkpoint, load_model_dir,
                                             model_from_checkpoint)
    from elmokit.training.loop import METRICS_NAME

    source = source_path(source, last)
    if source.is_file():
        checkpoint = load_checkpoint(source)
        vocab = checkpoint.get("train_config", {}).get("vocab") or None
        local = source.parent / "best" / VOCAB_NAME  # the run's copy, should the original have moved
        vocab = vocab if vocab and Path(vocab).is_file() else (local if local.is_file() else None)
        card = checkpoint_provenance(checkpoint, source.parent / METRICS_NAME) if "progress" in checkpoint else None
        return model_from_checkpoint(checkpoint), vocab, card
    return (*load_model_dir(source), read_provenance(source) or None)


def run(args: argparse.Namespace) -> int:
    from elmokit.training.checkpoint import PROVENANCE_NAME, VOCAB_NAME, save_model_dir
    from elmokit.training.model_card import CARD_NAME
    from elmokit.io import refuse_output_over_input, refuse_overwrite
    from elmokit.model.weights import CONFIG_NAME, WEIGHTS_NAME, refuse_same_file, save_original

    if args.original is None and args.native is None:
        raise ValueError("nothing to do: give --original OPTIONS_JSON WEIGHTS_HDF5 and/or --native DIR")
    native = [args.native / name for name in (CONFIG_NAME, WEIGHTS_NAME, VOCAB_NAME, PROVENANCE_NAME, CARD_NAME)] \
        if args.native is not None else []
    refuse_same_file([*(args.original or []), *native])  # one output must not replace another
    refuse_overwrite([*(args.original or []), *native], args.overwrite)  # before anything is written
    args.source = one_source(args.source, args.model)
    refuse_output_over_input([source_path(args.source, args.last)], [*(args.original or []), *native])
    model, vocab_path, card = load_source(args.source, args.last)
    if args.original is not None:
        save_original(model.bilm, *args.original)
        print(f"wrote {args.original[0]} and {args.original[1]} (original format, softmax dropped)")
    if args.native is not None:
        if vocab_path is None:
            raise FileNotFoundError(f"{args.source}: cannot find the vocabulary of its softmax for --native")
        import torch

        (args.native / PROVENANCE_NAME).unlink(missing_ok=True)  # it would describe the replaced model
        save_model_dir(model, args.native, vocab_path, card, softmax=not args.no_softmax,
                       dtype=getattr(torch, args.dtype), command=export_command(args))
        kept = "without the softmax" if args.no_softmax else "with the softmax"
        print(f"wrote {args.native} (native format {kept}, {args.dtype}, vocab.txt, and its model card "
              f"{CARD_NAME})")
    return 0


def export_command(args: argparse.Namespace) -> str:
    """The `elmo export` command that writes --native as these arguments do (for its model card)."""
    import shlex

    words = ["elmo", "export", str(args.source), *(["--last"] if args.last else []), "--native", str(args.native)]
    words += [*(["--no-softmax"] if args.no_softmax else []), *(["--dtype", args.dtype] if args.dtype != "float32" else [])]
    return shlex.join(words)
