"""Arguments shared by several subcommands: which model to load, where and in what precision
to run it (`elmokit.devices`), and whether to show progress (`elmokit.progress`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from elmokit.devices import (  # noqa: F401 (default_device, DEFAULT_DEVICE: the commands' import them from here)
    DEFAULT_DEVICE,
    DEVICE_HELP,
    DEVICE_VARIABLE,
    DTYPES,
    default_device,
    resolve_device,
)
from elmokit.model.bilm import BiLM
from elmokit.sources.published import published_names
from elmokit.sources.loading import load_model


MODEL_HELP = ("a model directory (native, or an ELMoForManyLangs folder), 'gutenberg-en' (built in), a "
              f"published name ({', '.join(published_names())}) or a TF-Hub ELMo handle "
              "(https://tfhub.dev/google/elmo/3); published models are downloaded once into the cache "
              "(ELMOKIT_CACHE, ELMOKIT_MIRROR, ELMOKIT_OFFLINE: docs/loading.md)")


def add_model_arguments(parser: argparse.ArgumentParser, positional: bool = False) -> None:
    """--model (and with `positional`, an optional MODEL argument meaning the same), or the
    original --options-file with --weight-file (paths or URLs)."""
    group = parser.add_argument_group("model (default: the built-in English model, gutenberg-en)")
    if positional:
        group.add_argument("model_positional", nargs="?", metavar="MODEL", help=f"the model: {MODEL_HELP}")
    group.add_argument("--model", help=MODEL_HELP)
    group.add_argument("--options-file", help="original options JSON, a path or an http(s) URL (with --weight-file)")
    group.add_argument("--weight-file", help="original HDF5 weight file, a path or an http(s) URL (with --options-file)")


def model_reference(args: argparse.Namespace) -> str | None:
    """The model named by MODEL or --model (not both), None if neither."""
    positional = getattr(args, "model_positional", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise ValueError(f"give the model once: MODEL {positional!r} or --model {args.model!r}")
    return positional if positional is not None else args.model


def model_paths(args: argparse.Namespace) -> list[str]:
    """The files on this machine that the model arguments name (MODEL, --model, --options-file,
    --weight-file; a folder's files): the inputs an output must not replace
    (`refuse_output_over_input`); a published name or a URL is none."""
    named = (model_reference(args), getattr(args, "options_file", None), getattr(args, "weight_file", None))
    paths = []
    for path in (Path(name) for name in named if name and Path(name).exists()):
        # a model folder is its files: an output may sit beside them in the folder, not replace one
        paths.extend(sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path])
    return [str(path) for path in paths]


def model_from_args(args: argparse.Namespace) -> BiLM:
    model = model_reference(args)
    if model is not None and (args.options_file or args.weight_file):
        raise ValueError("give either --model or --options-file with --weight-file, not both")
    if (args.options_file is None) != (args.weight_file is None):
        raise ValueError("--options-file and --weight-file go together")
    if args.options_file is not None:
        return load_model(args.options_file, args.weight_file)
    return load_model(model)


DEVICE_DEFAULT_SENTENCE = f"default: auto, the GPU when torch sees one, else the CPU; {DEVICE_VARIABLE} changes it"
DEVICE_OPTION_HELP = f"where to run: {DEVICE_HELP} ({DEVICE_DEFAULT_SENTENCE})"


def add_progress_argument(parser: argparse.ArgumentParser) -> None:
    """--no-progress: no bar on a terminal, no progress lines in a log (`elmokit.progress`)."""
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (on a terminal) and no progress lines (in a log file or pipe)")


def add_device_arguments(parser: argparse.ArgumentParser, dtype: bool = False, cuda_device: bool = False) -> None:
    """--device (and with `cuda_device` AllenNLP's --cuda-device alias; with `dtype`, --dtype)."""
    group = parser.add_argument_group("device and precision")
    group.add_argument("--device", help=DEVICE_OPTION_HELP)
    if cuda_device:
        group.add_argument("--cuda-device", type=int,
                           help="AllenNLP's spelling of --device: -1 for the CPU, N for cuda:N")
    if dtype:
        group.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                           help="bfloat16: the biLM's weights and products in bfloat16, its state and "
                                "outputs in float32 (faster on CPUs with AVX512-BF16 and on GPUs, not "
                                "exact); int8: the LSTM's products in int8 (CPUs with VNNI or AMX only, "
                                "not exact); default: float32")


def device_from_args(args: argparse.Namespace) -> torch.device:
    """The device of --device (default `DEFAULT_DEVICE`) or --cuda-device; a GPU that is not there
    is an error that says how to run on the CPU."""
    cuda_device = getattr(args, "cuda_device", None)
    if cuda_device is not None and args.device is not None:
        raise ValueError(f"give --device or --cuda-device, not both (got {args.device} and {cuda_device})")
    return device_or_advice(args.device or default_device(), cuda_device)


def device_or_advice(device: str | None, cuda_device: int | None = None) -> torch.device:
    """`resolve_device`, its error about a missing GPU with the command line's way out."""
    try:
        return resolve_device(device if cuda_device is None else None, cuda_device)
    except ValueError as error:
        if "torch sees" in str(error):  # the library's advice is Python's (device='cpu'): say the flag
            raise ValueError(f"{str(error).split(';')[0]}; run on the CPU with --device cpu") from None
        raise
