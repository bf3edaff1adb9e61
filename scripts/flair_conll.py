"""Train Flair's SequenceTagger on CoNLL-2003 English NER with elmokit's ELMo and write its F1.

    python scripts/flair_conll.py [--model gutenberg-en] [--epochs 10] [--work /tmp/flair_conll]
    python scripts/flair_conll.py --report /tmp/flair_conll    (the table of a run so far, finished or not)

The recipe of Flair's ELMo tutorial (a BiLSTM-CRF, hidden size 256, SGD at 0.1 with Flair's
annealing, mini-batches of 32) with `elmokit.integrations.flair.ELMoEmbeddings` as the only
embeddings, read through Flair's own column reader as Flair's CONLL_03 reads the same files
(IOB1 tags, `-DOCSTART-` lines kept as one-token sentences); the model is chosen on eng.testa and
scored on eng.testb with Flair's span-level micro F1 (what conlleval computes). The test set is
also scored after every epoch (`monitor_test`), so a run stopped early still has its figures:
Flair writes them to WORK/loss.tsv as each epoch ends, and `--report WORK` turns that into the
table (marked partial until the run's final test score is in WORK/final.json).

Writes bench/results/flair_conll.md (and .json). One torch thread by default (a shared machine).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "conll2003"
RESULTS = REPO / "bench" / "results" / "flair_conll"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA, help="folder with eng.train, eng.testa, eng.testb")
    parser.add_argument("--model", default="gutenberg-en", help="anything elmokit.load_model takes")
    parser.add_argument("--embedding-mode", default="all", choices=("all", "top", "average"))
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--mini-batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads")
    parser.add_argument("--limit", type=int, default=None, help="the first N sentences of each file (a smoke run)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/flair_conll"), help="Flair's base_path: logs, models")
    parser.add_argument("--out", type=Path, default=RESULTS, help="writes OUT.md and OUT.json")
    parser.add_argument("--report", type=Path, default=None, metavar="WORK",
                        help="only write the table of the run in WORK (finished or not)")
    return parser.parse_args(argv)


def read_corpus(data: Path, limit: int | None):
    """CoNLL-2003 through Flair's column reader, as Flair's CONLL_03 reads it."""
    from flair.datasets import ColumnCorpus

    for name in ("eng.train", "eng.testa", "eng.testb"):
        if not (data / name).is_file():
            raise SystemExit(f"{data / name}: missing (--data: the folder with eng.train, eng.testa, eng.testb)")
    corpus = ColumnCorpus(data, {0: "text", 3: "ner"}, train_file="eng.train", dev_file="eng.testa",
                          test_file="eng.testb", document_separator_token="-DOCSTART-", in_memory=True)
    if limit is not None:
        from flair.data import Corpus
        from torch.utils.data import Subset

        corpus = Corpus(*(Subset(split, range(min(limit, len(split))))
                          for split in (corpus.train, corpus.dev, corpus.test)), sample_missing_splits=False)
    return corpus


def train(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from flair.models import SequenceTagger
    from flair.trainers import ModelTrainer

    from elmokit.integrations.flair import ELMoEmbeddings

    corpus = read_corpus(args.data, args.limit)
    tag_dictionary = corpus.make_label_dictionary("ner", add_unk=False)
    embeddings = ELMoEmbeddings(args.model, embedding_mode=args.embedding_mode)
    tagger = SequenceTagger(hidden_size=args.hidden_size, embeddings=embeddings, tag_dictionary=tag_dictionary,
                            tag_type="ner", use_crf=True)
    args.work.mkdir(parents=True, exist_ok=True)
    setup = {"model": args.model, "embedding_mode": args.embedding_mode, "embedding_length": embeddings.embedding_length,
             "epochs": args.epochs, "hidden_size": args.hidden_size, "learning_rate": args.learning_rate,
             "mini_batch_size": args.mini_batch_size, "threads": args.threads, "limit": args.limit,
             "sentences": {split: len(getattr(corpus, split)) for split in ("train", "dev", "test")},
             "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv)}
    write_json(args.work / "setup.json", setup)
    start = time.perf_counter()
    result = ModelTrainer(tagger, corpus).train(
        args.work, learning_rate=args.learning_rate, mini_batch_size=args.mini_batch_size, max_epochs=args.epochs,
        embeddings_storage_mode="cpu", monitor_test=True)  # the frozen biLM runs once per sentence
    write_json(args.work / "final.json", {"test_f1": result["test_score"], "seconds": time.perf_counter() - start})
    report(args.work, args.out)


def write_json(path: Path, record: dict) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def read_epochs(work: Path) -> list[dict]:
    """Flair's loss.tsv: one row per finished epoch (dev and, with monitor_test, test scores)."""
    path = work / "loss.tsv"
    if not path.is_file():
        return []
    with path.open(encoding="utf-8") as file:
        return list(csv.DictReader(file, delimiter="\t"))


def report(work: Path, out: Path) -> None:
    """Write OUT.md / OUT.json from the run in `work` (partial until WORK/final.json exists)."""
    import flair
    import torch

    setup = json.loads((work / "setup.json").read_text(encoding="utf-8"))
    final_path = work / "final.json"
    final = json.loads(final_path.read_text(encoding="utf-8")) if final_path.is_file() else None
    epochs = read_epochs(work)
    rows = [{"epoch": int(row["EPOCH"]), "learning_rate": float(row["LEARNING_RATE"]),
             "train_loss": float(row["TRAIN_LOSS"]), "dev_f1": float(row["DEV_F1"]),
             "test_f1": float(row["TEST_F1"]) if "TEST_F1" in row else None} for row in epochs]
    status = (f"finished: {len(rows)} epochs in {final['seconds'] / 3600:.2f} h" if final else
              f"PARTIAL: {len(rows)} of {setup['epochs']} epochs finished when this table was written "
              f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); the run goes on or was stopped")
    best = max(rows, key=lambda row: row["dev_f1"]) if rows else None
    record = {"setup": setup, "status": status, "epochs": rows, "final_test_f1": final and final["test_f1"],
              "best_dev_epoch": best, "flair": flair.__version__, "torch": torch.__version__,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"}
    lines = [
        "# Flair SequenceTagger with elmokit's ELMo on CoNLL-2003 English NER (`scripts/flair_conll.py`)",
        "",
        f"Run started {setup['started']}: `{setup['command']}`. Flair {flair.__version__}, torch {torch.__version__}, "
        f"{setup['threads']} torch thread(s) on {record['machine']} (shared with other jobs).",
        "",
        f"Embeddings: `ELMoEmbeddings({setup['model']!r}, embedding_mode={setup['embedding_mode']!r})` "
        f"({setup['embedding_length']} dims per token), elmokit's stateless biLM (every sentence from a fresh "
        "state), not the stateful AllenNLP path of Flair's own ELMoEmbeddings. Tagger: BiLSTM-CRF, hidden size "
        f"{setup['hidden_size']}, SGD at {setup['learning_rate']} with Flair's annealing, mini-batches of "
        f"{setup['mini_batch_size']}, at most {setup['epochs']} epochs; sentences train / dev / test: "
        f"{setup['sentences']['train']:,} / {setup['sentences']['dev']:,} / {setup['sentences']['test']:,} "
        f"({'the first ' + str(setup['limit']) + ' of each file' if setup['limit'] else 'the whole files'}, "
        "`-DOCSTART-` lines included as Flair's CONLL_03 reads them).",
        "",
        f"Status: {status}.",
        "",
        "| model | mode | epochs | dev F1 (eng.testa, best epoch) | test F1 (eng.testb, that epoch's model) |",
        "|---|---|---:|---:|---:|",
    ]
    if best:
        test = final["test_f1"] if final else best["test_f1"]
        epochs = f"{len(rows)} (finished)" if final else f"{len(rows)} of {setup['epochs']} (partial)"
        lines.append(f"| {setup['model']} | {setup['embedding_mode']} | {epochs} | {best['dev_f1']:.4f} "
                     f"(epoch {best['epoch']}) | {test:.4f} |")
    lines += ["", "Every epoch (Flair's loss.tsv; test scored after each epoch with `monitor_test`):", "",
              "| epoch | learning rate | train loss | dev F1 | test F1 |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {row['epoch']} | {row['learning_rate']:g} | {row['train_loss']:.4f} | {row['dev_f1']:.4f} | "
              f"{row['test_f1']:.4f} |" for row in rows]
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out.with_suffix(".json"), record)
    temporary = out.with_name(f".{out.name}.md.tmp")
    temporary.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(temporary, out.with_suffix(".md"))
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report is not None:
        report(args.report, args.out)
    else:
        train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
