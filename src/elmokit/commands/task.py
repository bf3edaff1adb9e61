"""`elmo task train|eval|predict|probe`: task models on any data (tagging, NER, classification)
with or without ELMo, scoring and predicting files with a trained run, and layer probes."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from elmokit.devices import DEVICE_HELP, DTYPES
from elmokit.tasks.formats import CONLLU_COLUMNS, FORMATS
from elmokit.tasks.task_config import DATA_DIR_VARIABLE, DEFAULT_DATA_DIR, TASKS, TaskConfig


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
    ("char_dim", int, "char CNN: character embedding size"),
    ("char_filters", int, "char CNN: filters (the size of its word vectors)"),
    ("char_width", int, "char CNN: convolution width in characters (odd)"),
]


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
    parser = actions.add_parser(
        "train", help="train a task model (early stopping on dev)",
        description="Train on --train with early stopping on --dev, then score dev and --test; without "
                    "files, --task ner/pos/sst5/sst2 read their bundled data set under --data-dir. Files "
                    f"may be {', '.join(FORMATS[:-1])} (detected, or named with --format); entity tags "
                    "in IOB1, BIO or BIOES are read as BIO. Writes OUT/metrics.jsonl (one line an epoch), "
                    "OUT/results.json, and the self-contained model: OUT/task_config.json and "
                    "OUT/task_model.safetensors.")
    defaults = TaskConfig()
    parser.add_argument("--task", required=True, choices=sorted(TASKS),
                        help="ner (span F1, char CNN + CRF), pos (any token tagging, accuracy), classify "
                             "(one label a sentence), or a bundled data set: sst5, sst2")
    parser.add_argument("--train", dest="train_file", type=Path, help="training file")
    parser.add_argument("--dev", dest="dev_file", type=Path, help="development file (picks the epoch to keep)")
    parser.add_argument("--test", dest="test_file", type=Path, help="test file, scored once at the end")
    parser.add_argument("--format", dest="data_format", choices=("auto", *FORMATS[:-1]), default="auto",
                        help="format of the files (default: detected from each file)")
    parser.add_argument("--column", choices=CONLLU_COLUMNS[1:], default=defaults.column,
                        help=f"CoNLL-U: the column to predict (default {defaults.column})")
    parser.add_argument("--model", default=None,
                        help="biLM directory for ELMo (default: the built-in model), or 'none' for the "
                             "model without ELMo")
    parser.add_argument("--out", required=True, type=Path, help="run directory to write (new or empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace what OUT already holds (an earlier run)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help=f"random seed (default {defaults.seed})")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR,
                        help=f"folder of the bundled data sets (default {DEFAULT_DATA_DIR}, or ${DATA_DIR_VARIABLE})")
    for name, kind, text in OPTIONS:
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=getattr(defaults, name),
                            help=f"{text} (default {getattr(defaults, name)})")
    parser.add_argument("--elmo-at-output", action="store_true", help="also concatenate a second mix to the BiLSTM output")
    parser.add_argument("--crf", action=argparse.BooleanOptionalAction, default=None,
                        help="CRF output layer for taggers (default: on for NER, off for POS)")
    parser.add_argument("--chars", action=argparse.BooleanOptionalAction, default=None,
                        help="char CNN word encoder in the tagger (default: on for NER, off for POS)")
    parser.add_argument("--pooling", choices=("max", "mean"), default="max", help="sentence pooling (default max)")
    parser.add_argument("--finetune", action="store_true", help="fine-tune the biLM (with --bilm-lr)")
    parser.add_argument("--cache-dir", help="keep the frozen biLM's layers here to share between runs")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 is best for small models)")
    parser.add_argument("--device", default=defaults.device,
                        help=f"where the biLM and the task model run: {DEVICE_HELP} (default {defaults.device})")
    parser.add_argument("--bilm-dtype", choices=sorted(DTYPES), default=defaults.bilm_dtype,
                        help="the frozen biLM's products in bfloat16 (faster on CPUs with AVX512-BF16 and on "
                             f"GPUs, not exact) or float32 (default {defaults.bilm_dtype})")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (epoch lines are still printed)")
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
    parser.add_argument("--device", help=f"where to run: {DEVICE_HELP} (default: cpu)")
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
    parser.add_argument("--device", help=f"where to run: {DEVICE_HELP} (default: cpu)")
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
    from elmokit.io import refuse_overwrite, removed_if_unfinished
    from elmokit.tasks.train import train_task

    if args.out.exists() and not args.out.is_dir():
        raise FileExistsError(f"--out {args.out} is a file; give the directory to write the run in")
    refuse_overwrite(sorted(args.out.iterdir()) if args.out.is_dir() else [], args.overwrite,
                     f"a run in --out {args.out}")
    names = {spec.name for spec in dataclasses.fields(TaskConfig)}
    values = {name: value for name, value in vars(args).items() if name in names}
    if args.model is None:
        from elmokit.model.builtin import builtin_model_dir

        model = str(builtin_model_dir())
    else:
        model = None if args.model.lower() == "none" else args.model
    values.update(model=model, out=str(args.out),
                  progress=not args.no_progress)
    with removed_if_unfinished(args.out, keep_if="results.json"):  # a failed run leaves nothing half-made
        results = train_task(TaskConfig(**values))
    print(json.dumps({name: value for name, value in results.items() if name != "config"}))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from elmokit.tasks.run import evaluate_run, load

    if args.file is None:
        scores = evaluate_run(args.run, args.split, args.data_dir, args.max_sentences, progress=not args.no_progress,
                              device=args.device)
        scored = {"run": str(args.run), "split": args.split, **scores}
    else:
        run = load(args.run, args.device)
        examples, info = run.read_file(args.file, args.data_format, args.column)
        scores = run.evaluate(examples, progress=not args.no_progress)[0]
        scored = {"run": str(args.run), "file": str(args.file), "n": len(examples), **info, **scores}
    print(json.dumps(scored) if args.json else format_scores(scored))
    return 0


def format_scores(scored: dict) -> str:
    """The scores as lines a person reads: overall, then a P/R/F1 table by entity type."""
    source = scored.get("file") or f"{scored['split']} split"
    if "accuracy" in scored:
        return f"{source}: accuracy {scored['accuracy']:.2f}%"
    lines = [f"{source}: span F1 {scored['f1']:.2f}, precision {scored['precision']:.2f}, "
             f"recall {scored['recall']:.2f}", f"{'type':<16} {'P':>7} {'R':>7} {'F1':>7} {'gold':>6} {'pred':>6}"]
    for name, s in scored["per_type"].items():
        lines.append(f"{name:<16} {s['precision']:7.2f} {s['recall']:7.2f} {s['f1']:7.2f} "
                     f"{s['n_gold']:6d} {s['n_predicted']:6d}")
    return "\n".join(lines)


def run_predict(args: argparse.Namespace) -> int:
    import sys

    from elmokit.io import refuse_overwrite
    from elmokit.tasks.predict import predict_file
    from elmokit.tasks.run import load

    refuse_overwrite([args.output] if args.output is not None else [], args.overwrite)
    run = load(args.run, args.device)
    done = predict_file(run, args.input, args.output, args.data_format, args.column, args.tokenize, args.jsonl,
                        progress=not args.no_progress)
    if args.output is not None:
        print(f"{args.output}: {done['examples']} examples labelled ({done['format']} in)", file=sys.stderr)
    return 0


def run_probe(args: argparse.Namespace) -> int:
    from elmokit.extras import require
    from elmokit.io import atomic_write_text
    from elmokit.tasks.probes import pos_probe, wsd_probe
    from elmokit.tasks.report import plot_probes
    from elmokit.io import refuse_overwrite
    from elmokit.model.weights import load_model

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
