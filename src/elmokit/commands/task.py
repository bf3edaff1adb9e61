"""`elmo task train|eval|predict|probe`: task models on any data (tagging, NER, classification)
with or without ELMo, scoring and predicting files with a trained run, and layer probes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from elmokit.commands.common import DEVICE_DEFAULT_SENTENCE, DEVICE_OPTION_HELP, default_device, device_or_advice
from elmokit.tasks.formats import CONLLU_COLUMNS, FORMATS
from elmokit.tasks.task_config import DEFAULT_DATA_DIR


MODEL_HELP = ("the run's biLM, where the run no longer finds it (moved, or another installation): a name "
              "(gutenberg-en) or a model directory; it must be the model the run was trained with (its "
              "fingerprint is checked). Default: the one the run records")


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "task", help="train, evaluate and use task models (tagger, NER, classifier) with ELMo",
        description="Train a tagger (POS and the like), an NER tagger (char CNN + CRF) or a sentence "
                    "classifier on your own files or a bundled data set, with or without ELMo; score a "
                    "trained one on any file, predict labels for new text, or probe each biLM layer.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    _register_train(actions)
    _register_eval(actions)
    _register_predict(actions)
    _register_probe(actions)


def _register_train(actions: argparse._SubParsersAction) -> None:
    from elmokit.tasks.options import REQUIRED, config_fields, default_value, flag

    parser = actions.add_parser(
        "train", help="train a task model (early stopping on dev)",
        description="Train on --train with early stopping on --dev, then score dev and --test; without "
                    "files, --task ner/pos/sst5/sst2 read their bundled data set under --data-dir. Files "
                    f"may be {', '.join(FORMATS[:-1])} (detected, or named with --format); entity tags "
                    "in IOB1, BIO or BIOES are read as BIO. Writes OUT/metrics.jsonl (one line an epoch), "
                    "OUT/results.json, OUT/README.md (the model card) and the self-contained model: "
                    "OUT/task_config.json and OUT/task_model.safetensors; prints a table of the scores "
                    "(--json: the results as one JSON object). Every option is also a keyword of "
                    "elmokit.tasks.train() in Python (--max-epochs 5: max_epochs=5).")
    for spec in config_fields():  # every field of TaskConfig is an option (elmokit.tasks.options)
        meta, default = spec.metadata, default_value(spec)
        shown = "" if spec.name in REQUIRED or default is None else f" (default {default})"
        if spec.name == "device":  # the commands' one default, read when the command runs (run_train)
            default, shown = None, f" ({DEVICE_DEFAULT_SENTENCE})"
        kind = {"int": int, "float": float}.get(spec.type.split(" ")[0], str)
        if spec.type.startswith("bool"):
            parser.add_argument(flag(spec), dest=spec.name, action=argparse.BooleanOptionalAction, default=default,
                                help=meta["help"] + shown)
        else:
            metavar = None if meta["choices"] else flag(spec)[2:].upper().replace("-", "_")
            parser.add_argument(flag(spec), dest=spec.name, type=kind, choices=meta["choices"], metavar=metavar,
                                required=spec.name in REQUIRED, default=None if spec.name in REQUIRED else default,
                                help=meta["help"] + shown)
    parser.add_argument("--overwrite", action="store_true", help="replace what OUT already holds (an earlier run)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in OUT that was interrupted (Ctrl-C, a killed job) after its last "
                             "finished epoch, with the same options: the epochs that follow are those of an "
                             "uninterrupted run")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object instead of a table")
    parser.set_defaults(func=run_train)


def _register_eval(actions: argparse._SubParsersAction) -> None:
    parser = actions.add_parser("eval", help="score a trained task model on a labelled file",
                                description="Load a run directory written by `elmo task train` and score "
                                            "it on FILE (any format it trains on), or on a split of the data "
                                            "it was trained with: span precision, recall and F1 (overall and "
                                            "per entity type) for NER, accuracy for tagging and classification.")
    parser.add_argument("run", type=Path, help="run directory")
    parser.add_argument("file", type=Path, nargs="?", help="labelled file to score (default: the run's --split)")
    parser.add_argument("--split", choices=("train", "dev", "test"), default="test", help="without FILE (default test)")
    parser.add_argument("--format", dest="data_format", choices=("auto", *FORMATS[:-1]), default="auto",
                        help="format of FILE (default: detected)")
    parser.add_argument("--column", choices=CONLLU_COLUMNS[1:], help="CoNLL-U: the label column (default: the run's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--data-dir", help="data folder (default: the one the run was trained with)")
    parser.add_argument("--max-sentences", type=int, help="score only a fixed subset of this many sentences")
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--device", help=DEVICE_OPTION_HELP)
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run_eval)


def _register_predict(actions: argparse._SubParsersAction) -> None:
    parser = actions.add_parser(
        "predict", help="label new text with a trained task model",
        description="Read INPUT (tokenized text one sentence a line, raw text with --tokenize, or any "
                    "format the run trains on) and write it back with the predicted labels in the same "
                    "format, or as JSON Lines with --jsonl; streamed, a chunk of batches at a time.")
    parser.add_argument("run", type=Path, help="run directory")
    parser.add_argument("input", type=Path, help="file to label (plain or .gz)")
    parser.add_argument("-o", "--output", type=Path, help="output file (default: stdout); written whole at the end")
    parser.add_argument("--overwrite", action="store_true", help="replace the --output file if it exists")
    parser.add_argument("--format", dest="data_format", choices=("auto", *FORMATS), default="auto",
                        help="format of INPUT (default: detected; text = one sentence a line)")
    parser.add_argument("--column", choices=CONLLU_COLUMNS[1:], help="CoNLL-U: the column to fill (default: the run's)")
    parser.add_argument("--tokenize", action="store_true", help="raw text: split it with the Moses tokenizer")
    parser.add_argument("--jsonl", action="store_true", help="write JSON Lines ({tokens, labels} or {tokens, label})")
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--device", help=DEVICE_OPTION_HELP)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_predict)


def _register_probe(actions: argparse._SubParsersAction) -> None:
    parser = actions.add_parser(
        "probe", help="per-layer POS probe and 1-NN word-sense probe",
        description="Probe each biLM layer: a linear UPOS probe on UD EWT and a 1-nearest-neighbour "
                    "word-sense classifier on SemCor (held-out documents). Writes OUT/probes.json "
                    "and OUT/probes.png.")
    parser.add_argument("--model", type=Path, help="biLM directory (default: the built-in model)")
    parser.add_argument("--out", required=True, type=Path, help="folder for probes.json and probes.png")
    parser.add_argument("--overwrite", action="store_true", help="replace probes.json and probes.png in OUT")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help=f"data folder (default {DEFAULT_DATA_DIR})")
    parser.add_argument("--probes", nargs="+", choices=("pos", "wsd"), default=["pos", "wsd"], help="which probes")
    parser.add_argument("--max-train-sentences", type=int, help="POS: subsample the training sentences")
    parser.add_argument("--max-eval-sentences", type=int, help="POS: subsample dev and test")
    parser.add_argument("--max-documents", type=int, help="WSD: read only the first SemCor documents")
    parser.add_argument("--wordnet-index-sense", type=Path,
                        help="WSD: WordNet index.sense, for the first-sense backoff of unseen lemmas")
    parser.add_argument("--cache-dir", help="keep the biLM layers here to share between runs")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run_probe)


def run_train(args: argparse.Namespace) -> int:
    from elmokit.tasks.api import train_into
    from elmokit.tasks.card import results_table
    from elmokit.tasks.options import config_fields, config_from_values

    if args.device is None:
        args.device = default_device()
    config = config_from_values({spec.name: getattr(args, spec.name) for spec in config_fields()})
    results = train_into(config, args.overwrite, args.resume)
    if args.json:
        print(json.dumps({name: value for name, value in results.items() if name != "config"}))
    else:
        print(results_table(results, config.out))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from elmokit.tasks.card import format_scores
    from elmokit.tasks.run import evaluate_run, load

    if args.file is None:
        scores = evaluate_run(args.run, args.split, args.data_dir, args.max_sentences, progress=not args.no_progress,
                              device=device_or_advice(args.device or default_device()), bilm=args.model)
        scored = {"run": str(args.run), "split": args.split, **scores}
    else:
        run = load(args.run, device_or_advice(args.device or default_device()), args.model)
        examples, info = run.read_file(args.file, args.data_format, args.column)
        scores = run.evaluate(examples, progress=not args.no_progress).scores
        scored = {"run": str(args.run), "file": str(args.file), "n": len(examples), **info, **scores}
    print(json.dumps(scored) if args.json else format_scores(scored))
    return 0


def run_predict(args: argparse.Namespace) -> int:
    import logging

    from elmokit.io import refuse_output_over_input, refuse_overwrite
    from elmokit.tasks.predict import predict_file
    from elmokit.tasks.run import load

    refuse_output_over_input([args.run, args.input, *([args.model] if args.model else [])],
                             [args.output] if args.output is not None else [])  # before anything is read
    refuse_overwrite([args.output] if args.output is not None else [], args.overwrite)
    run = load(args.run, device_or_advice(args.device or default_device()), args.model)
    done = predict_file(run, args.input, args.output, args.data_format, args.column, args.tokenize, args.jsonl,
                        progress=not args.no_progress)
    if args.output is not None:
        logging.getLogger(__name__).info(f"{args.output}: {done['examples']} examples labelled ({done['format']} in)")
    return 0


def run_probe(args: argparse.Namespace) -> int:
    from elmokit.extras import require
    from elmokit.io import atomic_write_text
    from elmokit.tasks.probes import pos_probe, wsd_probe
    from elmokit.tasks.report import plot_probes
    from elmokit.io import refuse_overwrite
    from elmokit.sources.loading import load_model

    refuse_overwrite([args.out / "probes.json", args.out / "probes.png"], args.overwrite)
    require("plot", "elmo task probe (probes.png)")  # before the probes run, not after
    bilm = load_model(args.model)
    results = {}
    if "pos" in args.probes:
        results["pos"] = pos_probe(bilm, args.data_dir, args.max_train_sentences, args.max_eval_sentences,
                                   cache_dir=args.cache_dir, progress=not args.no_progress)
    if "wsd" in args.probes:
        results["wsd"] = wsd_probe(bilm, Path(args.data_dir) / "wsd" / "semcor3.0.tsv.gz", args.max_documents,
                                   index_sense=args.wordnet_index_sense, progress=not args.no_progress)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "probes.json", json.dumps(results, indent=2) + "\n")
    plot_probes(results, args.out / "probes.png")
    print(json.dumps(results))
    return 0
