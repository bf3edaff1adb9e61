"""`elmo train`: train a biLM on your corpus (or continue one, or adapt one to a new domain).

Every field of `TrainConfig` is an option (`--batch-size 64`, `--no-progress`); `--config FILE`
reads a JSON file of them first, and options given on the command line win. With `--resume` the
run's own `train_config.json` is the base. Several processes: `torchrun --nproc_per_node N
-m elmokit train ...` (see docs/training.md). `--auto-resume` continues the run if its directory
holds a checkpoint and starts it otherwise: the one command line of a job that `torchrun
--max-restarts` restarts after losing a worker, or that a scheduler requeues (docs/scale.md).

One `elmo train` writes a run directory at a time (`train.lock` in it); a directory that already
holds a run is continued with `--resume` or replaced with `--overwrite`, never silently.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

ALIASES = {"train_files": ["--train"], "valid_files": ["--valid"]}
LOCK_NAME = "train.lock"


def register(subcommands: argparse._SubParsersAction) -> None:
    from elmokit.training.loop import TrainConfig

    parser = subcommands.add_parser(
        "train", help="train an ELMo biLM on a tokenized corpus",
        description="Train (or --resume, or --init-from a trained model) an ELMo biLM. Options "
                    "override the JSON file given with --config; see docs/training.md.")
    parser.add_argument("--config", type=Path, help="JSON file of training options")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --output-dir exactly where its last checkpoint stopped")
    parser.add_argument("--auto-resume", action="store_true",
                        help="continue the run in --output-dir if it holds a checkpoint, else start it (and replace "
                             "what a start killed before its first checkpoint left there): for a job that "
                             "torchrun --max-restarts restarts or a scheduler requeues with the same command line")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over: remove the run already in --output-dir (checkpoint, metrics, best/)")
    for spec in dataclasses.fields(TrainConfig):
        flags = [*ALIASES.get(spec.name, []), f"--{spec.name.replace('_', '-')}"]
        default = _default(spec)
        help_text = f"{spec.metadata['help']} (default: {'decided by the run' if default is None else repr(default)})"
        if spec.type in ("bool", "bool | None", bool):
            parser.add_argument(*flags, dest=spec.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        elif spec.type.startswith("list"):
            parser.add_argument(*flags, dest=spec.name, nargs="+", default=argparse.SUPPRESS,
                                metavar=spec.name.upper().removesuffix("S"), help=help_text)
        else:
            kind = {"int": int, "float": float, "str": str}[spec.type]
            parser.add_argument(*flags, dest=spec.name, type=kind, default=argparse.SUPPRESS,
                                metavar=spec.name.upper(), help=help_text)
    parser.set_defaults(func=run)


def _default(spec: dataclasses.Field) -> Any:
    return spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default


def config_from_args(args: argparse.Namespace) -> Any:
    """The TrainConfig of these arguments: --config (or the resumed run's file), then overrides."""
    from elmokit.commands.common import default_device
    from elmokit.jsonfiles import read_json
    from elmokit.training.loop import TRAIN_CONFIG_NAME, TrainConfig

    names = {spec.name for spec in dataclasses.fields(TrainConfig)}
    overrides = {name: value for name, value in vars(args).items() if name in names}
    base = args.config
    if base is None and resuming(args, overrides.get("output_dir")):
        if "output_dir" not in overrides:
            raise ValueError("--resume needs --output-dir (the directory of the run to continue)")
        base = Path(overrides["output_dir"]) / TRAIN_CONFIG_NAME
        if not base.is_file():
            raise FileNotFoundError(f"--resume: no {TRAIN_CONFIG_NAME} in {overrides['output_dir']}")
    base_values = read_json(base) if base is not None and Path(base).is_file() else {}  # errors name the file
    if "device" not in overrides and not (isinstance(base_values, dict) and "device" in base_values):
        overrides["device"] = default_device()  # the commands' one default (ELMOKIT_DEVICE, else auto)
    config = TrainConfig.load(base, **overrides) if base is not None else TrainConfig(**overrides)
    return config.with_absolute_paths()  # relative paths read from this folder, `~` expanded


def resuming(args: argparse.Namespace, output_dir: str | None) -> bool:
    """Whether this start continues a run: --resume, or --auto-resume where a checkpoint is."""
    from elmokit.training.checkpoint import CHECKPOINT_NAME

    if args.auto_resume and output_dir:
        return (Path(output_dir) / CHECKPOINT_NAME).is_file()
    return args.resume


def run_files(out_dir: Path) -> list[Path]:
    """What a run writes in its directory and that exists there."""
    from elmokit.training.checkpoint import CHECKPOINT_NAME
    from elmokit.training.loop import BEST_DIR, CURVES_NAME, METRICS_NAME, TRAIN_CONFIG_NAME
    from elmokit.model.weights import CONFIG_NAME

    names = (CHECKPOINT_NAME, TRAIN_CONFIG_NAME, CONFIG_NAME, METRICS_NAME, CURVES_NAME, BEST_DIR)
    return [out_dir / name for name in names if (out_dir / name).exists()]


def claim_run_dir(out_dir: Path, overwrite: bool) -> None:
    """Before a new run: a directory holding a run is an error, or with `overwrite` emptied of it."""
    existing = run_files(out_dir)
    if existing and not overwrite:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        hint = (f" (torchrun restarted this job, attempt {restarted + 1}: give elmo train --auto-resume so that a "
                "restart continues from the last checkpoint)" if restarted else "")
        raise FileExistsError(f"{out_dir} holds a run ({', '.join(path.name for path in existing)}): continue "
                              f"it with --resume, or pass --overwrite to replace it{hint}")
    for path in existing:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def run(args: argparse.Namespace) -> int:
    from elmokit.training.checkpoint import CHECKPOINT_NAME
    from elmokit.io import output_lock, removed_if_unfinished
    from elmokit.training.loop import train

    chosen = [flag for flag, given in (("--resume", args.resume), ("--auto-resume", args.auto_resume),
                                       ("--overwrite", args.overwrite)) if given]
    if len(chosen) > 1:
        raise ValueError(f"give one of --resume (continue the run), --auto-resume (continue it or start it) and "
                         f"--overwrite (replace it), not {' and '.join(chosen)}")
    config = config_from_args(args)
    config.check_paths()  # a bad corpus or vocabulary stops here, before --overwrite removes anything
    out_dir = Path(config.output_dir)
    main_process = int(os.environ.get("RANK", "0")) == 0
    lock = contextlib.nullcontext()
    if config.output_dir and main_process:  # torchrun: rank 0 holds it for the whole run
        lock = output_lock(out_dir / LOCK_NAME, f"run directory {out_dir}")
    with lock:
        if config.output_dir and main_process and not resuming(args, config.output_dir):
            claim_run_dir(out_dir, args.overwrite or args.auto_resume)  # auto: no checkpoint, nothing to resume
        with removed_if_unfinished(out_dir, keep_if=CHECKPOINT_NAME):  # no checkpoint: nothing to resume
            progress = train(config, resume="auto" if args.auto_resume else args.resume)
    summary = {"output_dir": config.output_dir, "steps": progress.step, "tokens": progress.tokens,
               "epochs": progress.epoch}
    if progress.best_ppl < float("inf"):
        summary["best_valid_ppl"] = round(progress.best_ppl, 3)
    print(json.dumps(summary))
    return 0
