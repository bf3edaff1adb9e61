"""`elmo task train|eval|probe`: ELMo in downstream tasks (POS, NER, SST) and layer probes."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from elmokit.tasks.train import DEFAULT_DATA_DIR, TASKS, TaskConfig


OPTIONS = [  # (TaskConfig field, type, help)
    ("max_epochs", int, "stop after this many epochs"),
    ("patience", int, "stop after this many epochs without a better dev score"),
    ("batch_size", int, "sentences a batch"),
    ("word_dim", int, "size of the task's own (randomly initialised) word vectors"),
    ("hidden_dim", int, "BiLSTM hidden size a direction"),
    ("min_word_count", int, "task vocabulary: words seen at least this often in train"),
    ("max_train_sentences", int, "train on a fixed random subset of this many sentences"),
    ("max_eval_sentences", int, "score dev and test on fixed subsets of this many sentences"),
    ("lr", float, "Adam learning rate of the task model"),
    ("dropout", float, "dropout on the BiLSTM input and output"),
    ("elmo_dropout", float, "dropout on the ELMo representation"),
    ("elmo_l2", float, "lambda of the L2 penalty on the scalar-mix weights (Peters et al. 2018)"),
    ("bilm_lr", float, "learning rate of the biLM with --finetune"),
]


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "task", help="train, evaluate and probe task models that use ELMo",
        description="Train a POS tagger, NER tagger (CRF) or sentiment classifier with or without "
                    "ELMo, score a trained one, or probe each biLM layer (POS, word sense).")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    _register_train(actions)
    _register_eval(actions)
    _register_probe(actions)


def _register_train(actions: argparse._SubParsersAction) -> None:
    parser = actions.add_parser(
        "train", help="train a task model (early stopping on dev)",
        description="Train on the task's train split with early stopping on dev, then score dev and "
                    "test. Writes OUT/metrics.jsonl (one line an epoch), OUT/results.json, "
                    "OUT/task_config.json and OUT/task_model.safetensors.")
    defaults = TaskConfig()
    parser.add_argument("--task", required=True, choices=sorted(TASKS), help="which task")
    parser.add_argument("--model", default=None,
                        help="biLM directory for ELMo (default: the built-in model), or 'none' for the "
                             "model without ELMo")
    parser.add_argument("--out", required=True, type=Path, help="run directory to write")
    parser.add_argument("--seed", type=int, default=defaults.seed, help=f"random seed (default {defaults.seed})")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR,
                        help=f"folder of the data sets (default {DEFAULT_DATA_DIR}, or $ELMOKIT_DATA_DIR)")
    for name, kind, text in OPTIONS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=getattr(defaults, name),
                            help=f"{text} (default {getattr(defaults, name)})")
    parser.add_argument("--elmo-at-output", action="store_true", help="also concatenate a second mix to the BiLSTM output")
    parser.add_argument("--crf", action=argparse.BooleanOptionalAction, default=None,
                        help="CRF output layer for taggers (default: on for NER, off for POS)")
    parser.add_argument("--pooling", choices=("max", "mean"), default="max", help="sentence pooling (default max)")
    parser.add_argument("--finetune", action="store_true", help="fine-tune the biLM (with --bilm-lr)")
    parser.add_argument("--cache-dir", help="keep the frozen biLM's layers here to share between runs")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 is best for small models)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run_train)


def _register_eval(actions: argparse._SubParsersAction) -> None:
    parser = actions.add_parser("eval", help="score a trained task model on one split",
                                description="Load a run directory written by `elmo task train` and "
                                            "print its scores on a split as JSON.")
    parser.add_argument("run", type=Path, help="run directory")
    parser.add_argument("--split", choices=("train", "dev", "test"), default="test", help="(default test)")
    parser.add_argument("--data-dir", help="data folder (default: the one the run was trained with)")
    parser.add_argument("--max-sentences", type=int, help="score only a fixed subset of this many sentences")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run_eval)


def _register_probe(actions: argparse._SubParsersAction) -> None:
    parser = actions.add_parser(
        "probe", help="per-layer POS probe and 1-NN word-sense probe",
        description="Probe each biLM layer: a linear UPOS probe on UD EWT and a 1-nearest-neighbour "
                    "word-sense classifier on SemCor (held-out documents). Writes OUT/probes.json "
                    "and OUT/probes.png.")
    parser.add_argument("--model", type=Path, help="biLM directory (default: the built-in model)")
    parser.add_argument("--out", required=True, type=Path, help="folder for probes.json and probes.png")
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
    from elmokit.tasks.train import train_task

    names = {spec.name for spec in dataclasses.fields(TaskConfig)}
    values = {name: value for name, value in vars(args).items() if name in names}
    if args.model is None:
        from elmokit.builtin import builtin_model_dir

        model = str(builtin_model_dir())
    else:
        model = None if args.model.lower() == "none" else args.model
    values.update(model=model, out=str(args.out),
                  progress=not args.no_progress)
    results = train_task(TaskConfig(**values))
    print(json.dumps(results))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from elmokit.tasks.train import evaluate_run

    scores = evaluate_run(args.run, args.split, args.data_dir, args.max_sentences, progress=not args.no_progress)
    print(json.dumps({"run": str(args.run), "split": args.split, **scores}))
    return 0


def run_probe(args: argparse.Namespace) -> int:
    from elmokit.io import atomic_write_text
    from elmokit.tasks.probes import pos_probe, wsd_probe
    from elmokit.tasks.report import plot_probes
    from elmokit.weights import load_model

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
