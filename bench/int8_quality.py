"""What int8 inference (`dtype="int8"`: the LSTM's input and recurrent products in int8, its
projection and the token encoder's char CNN, highway and projection in bfloat16) costs in quality on the built-in model (issue 41, point 1):

    perplexity   held-out perplexity of the built-in model, each sentence alone (stateless), its
                 top layer computed by the inference engine (`bilm_forward`) in float32 and in int8,
                 scored by the model's own softmax in float32 (`LanguageModel.target_nll`, the
                 definition `elmo perplexity --per-sentence` uses); target: int8 within 2 %
    ner          CoNLL-2003 NER (`elmo task train --task ner`) trained on float32 ELMo features,
                 then the SAME trained model scored on dev with its features computed in float32
                 and in int8 (`TaskRun.evaluate`); target: int8 loses at most 0.5 F1

    .venv/bin/python bench/int8_quality.py                          # both -> bench/results/int8_quality.md
    .venv/bin/python bench/int8_quality.py --sentences 200 --skip-ner --output /tmp/q.md

The sentences: the first `--sentences` of gutenberg-en's test split, split and Moses-tokenized as
`elmo prepare` does (`elmokit.training.corpus.tokenize_paragraphs`), so they are the first
sentences `elmo prepare test.txt.gz -o test/ && elmo perplexity 'test/*' --max-sentences N`
scores. `elmo perplexity` carries the LSTM state from window to window (the README's figure),
which int8 (stateless inference only) does not cover: here every sentence starts from a zero
state, so the figures are higher than the README's. The training recurrence's own stateless
scoring (`training.perplexity.sentence_scores`) is run too, as a check that the engine's float32
path gives the same perplexity.

The NER run is trained once (`--run-dir`; a finished run there is reused, an unfinished one
resumed) in its own process, on `--threads` threads.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import itertools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TEST_SPLIT = REPO.parent / "shared" / "data" / "gutenberg-en" / "test.txt.gz"
NER_DTYPES = ("float32", "int8")


# ---------------------------------------------------------------------------------------------
# Perplexity, each sentence alone, through the inference engine
# ---------------------------------------------------------------------------------------------
def first_sentences(path: Path, count: int) -> list[list[str]]:
    """The first `count` sentences of a raw text file, split and tokenized as `elmo prepare`."""
    from elmokit.training import corpus

    corpus._init_worker("en")
    sentences: list[list[str]] = []
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for chunk in iter(lambda: list(itertools.islice(lines, 200)), []):
            sentences += [sentence.split() for sentence in corpus.tokenize_paragraphs([line.strip() for line in chunk])]
            if len(sentences) >= count:
                break
    return sentences[:count]


def nll_sums(model, bilm, vocab, sentences: Sequence[Sequence[str]], batch_size: int = 32,
             score_rows: int = 512) -> tuple[float, float, int]:
    """Summed NLL of the forward and backward LMs over every sentence, each from a zero state, and
    the targets a direction (n + 1 a sentence of n tokens: forward w1 .. wn, </S>; backward
    wn .. w1, <S>, as `training.perplexity`).

    The top layer comes from `bilm_forward` on `bilm` (the engine; its dtype decides the products):
    with boundaries, position i of a sentence <S> w1 .. wn </S> predicts position i + 1 with its
    forward half and i - 1 with its backward half. The softmax is `model.target_nll` in float32,
    `score_rows` rows at a time (the (rows, V) logits of a 100k softmax: 200 MB at 512)."""
    from elmokit.inference.engine import bilm_forward
    from elmokit.model.chars import BOS_TOKEN, EOS_TOKEN

    totals, n_targets = [0.0, 0.0], 0
    for start in range(0, len(sentences), batch_size):
        group = sentences[start:start + batch_size]
        with torch.no_grad():
            output = bilm_forward(bilm, bilm.batch_ids(group))
        top = output.layers[-1].float()  # (B, S, 2P)
        dim = top.shape[-1] // 2
        predicting = output.mask[:, 1:]  # (B, S-1): positions 0 .. n of each sentence, each predicting a neighbour
        sequences = [[BOS_TOKEN, *sentence, EOS_TOKEN] for sentence in group]
        parts = ((top[:, :-1, :dim][predicting], [t for s in sequences for t in s[1:]]),  # forward: i -> i + 1
                 (top[:, 1:, dim:][predicting], [t for s in sequences for t in s[:-1]]))  # backward: i + 1 -> i
        for direction, (hidden, tokens) in enumerate(parts):  # hidden (N, P)
            targets = torch.from_numpy(vocab.encode(tokens))
            with torch.no_grad():
                totals[direction] += sum(float(model.target_nll(hidden[rows], targets[rows]).double().sum())
                                         for rows in map(slice, range(0, len(targets), score_rows),
                                                         range(score_rows, len(targets) + score_rows, score_rows)))
        n_targets += sum(len(sentence) + 1 for sentence in group)
    return totals[0], totals[1], n_targets


def perplexities(forward_nll: float, backward_nll: float, n_targets: int) -> dict[str, float]:
    """forward_ppl, backward_ppl and ppl (exp of the mean of both directions' mean NLL)."""
    return {"forward_ppl": math.exp(forward_nll / n_targets), "backward_ppl": math.exp(backward_nll / n_targets),
            "ppl": math.exp(0.5 * (forward_nll + backward_nll) / n_targets), "n_targets": n_targets}


def training_driver_sums(model, vocab, sentences: Sequence[Sequence[str]]) -> tuple[float, float, int]:
    """The same sums by the training recurrence's stateless scoring (`sentence_scores`)."""
    from elmokit.training.perplexity import sentence_scores

    scores = list(sentence_scores(model, vocab, sentences, batch_size=4))  # 4 rows: (~100, V) logits at once
    return (sum(s.forward_nll for s in scores), sum(s.backward_nll for s in scores),
            sum(s.n_targets for s in scores))


def measure_perplexity(count: int, threads: int) -> dict:
    """Rows float32 (engine), int8 (engine) and float32 (training driver) on the built-in model."""
    from elmokit.commands.perplexity import builtin_scoring_model
    from elmokit.inference.embedder import ElmoEmbedder
    from elmokit.training.checkpoint import load_model_dir
    from elmokit.training.vocab import Vocabulary

    torch.set_num_threads(threads)
    model, vocab_path = load_model_dir(builtin_scoring_model())
    vocab = Vocabulary.load(vocab_path)
    sentences = first_sentences(TEST_SPLIT, count)
    rows = {}
    for dtype in ("float32", "int8"):
        bilm = ElmoEmbedder(module=copy.deepcopy(model.bilm), device="cpu", dtype=dtype).bilm
        started = time.process_time()
        rows[f"{dtype}, inference engine"] = {**perplexities(*nll_sums(model, bilm, vocab, sentences)),
                                              "cpu_s": time.process_time() - started}
    started = time.process_time()
    rows["float32, training recurrence"] = {**perplexities(*training_driver_sums(model, vocab, sentences)),
                                            "cpu_s": time.process_time() - started}
    return {"sentences": len(sentences), "tokens": sum(map(len, sentences)), "rows": rows}


# ---------------------------------------------------------------------------------------------
# NER: trained on float32 features, scored with int8 features
# ---------------------------------------------------------------------------------------------
def ner_command(run_dir: Path, epochs: int, threads: int, seed: int) -> list[str]:
    return ["-m", "elmokit", "task", "train", "--task", "ner", "--out", str(run_dir), "--seed", str(seed),
            "--max-epochs", str(epochs), "--patience", str(epochs), "--threads", str(threads),
            "--bilm-dtype", "float32", "--no-progress"]


def train_ner(run_dir: Path, epochs: int, threads: int, seed: int) -> str:
    """Train (or resume, or reuse) the float32 NER run in its own process; its command line."""
    command = ner_command(run_dir, epochs, threads, seed)
    if not (run_dir / "results.json").is_file():
        resume = ["--resume"] if (run_dir / "task_config.json").is_file() or (run_dir / "metrics.jsonl").is_file() else []
        subprocess.run([sys.executable, *command, *resume], check=True, cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return " ".join(["elmo", *command[2:]])


def score_ner(run_dir: Path, threads: int) -> dict:
    """Dev span F1 of the trained run, its biLM's features computed in each of NER_DTYPES."""
    from elmokit import tasks
    from elmokit.tasks.data import read_split

    torch.set_num_threads(threads)
    run = tasks.load(run_dir)
    trained_with = run.config.bilm_dtype
    dev, _ = read_split(run.config, run.config.split_files()["dev"])
    scores = {}
    for dtype in NER_DTYPES:
        run.config = replace(run.config, bilm_dtype=dtype)  # the features' products; the task model is unchanged
        started = time.process_time()
        evaluation = run.evaluate(dev)
        scores[dtype] = {**{key: evaluation.scores[key] for key in ("precision", "recall", "f1")},
                         "sentences": evaluation.n, "cpu_s": time.process_time() - started}
    return {"trained_with": trained_with, "results": json.loads((run_dir / "results.json").read_text()),
            "scores": scores}


# ---------------------------------------------------------------------------------------------
# The page
# ---------------------------------------------------------------------------------------------
def write_page(output: Path, perplexity: dict | None, ner: dict | None, header: list[str]) -> None:
    lines = ["# int8 inference quality on the built-in model (`bench/int8_quality.py`)", "", *header, ""]
    if perplexity is not None:
        rows = perplexity["rows"]
        base = rows["float32, inference engine"]["ppl"]
        low = rows["int8, inference engine"]["ppl"]
        change = 100 * (low / base - 1)
        lines += [
            "## Held-out perplexity, each sentence alone",
            "",
            f"The first {perplexity['sentences']:,} sentences ({perplexity['tokens']:,} tokens, "
            f"{rows['float32, inference engine']['n_targets']:,} targets a direction) of gutenberg-en's test split, "
            "each from a zero state; the full softmax in float32.",
            "",
            "| top layer computed by | forward ppl | backward ppl | average ppl | vs float32 | CPU s |",
            "|---|---:|---:|---:|---:|---:|",
            *[f"| {name} | {row['forward_ppl']:.3f} | {row['backward_ppl']:.3f} | {row['ppl']:.3f} | "
              f"{100 * (row['ppl'] / base - 1):+.3f} % | {row['cpu_s']:.0f} |" for name, row in rows.items()],
            "",
            f"int8 against float32: {change:+.3f} % average perplexity; target within 2 %: "
            f"{'met' if abs(change) <= 2 else 'NOT met'}.",
            "",
        ]
    if ner is not None:
        scores = ner["scores"]
        loss = scores["float32"]["f1"] - scores["int8"]["f1"]
        recorded = ner["results"]["dev"]["f1"]
        lines += [
            "## CoNLL-2003 NER trained on float32 features, fed int8 features",
            "",
            f"One run of `elmo task train --task ner` on float32 features (recipe below; its best epoch "
            f"{ner['results'].get('best_epoch')}), then the same trained model scored on dev "
            f"({scores['float32']['sentences']:,} sentences) with the frozen biLM's layers computed in float32 "
            f"and in int8. The run's own dev F1 (results.json): {recorded:.2f}.",
            "",
            "| dev features | precision | recall | span F1 | CPU s |",
            "|---|---:|---:|---:|---:|",
            *[f"| {dtype} | {row['precision']:.2f} | {row['recall']:.2f} | {row['f1']:.2f} | {row['cpu_s']:.0f} |"
              for dtype, row in scores.items()],
            "",
            f"F1 lost with int8 features: {loss:+.2f} points; target at most 0.5: {'met' if loss <= 0.5 else 'NOT met'}.",
            "",
            "Training command:",
            "",
            f"    {ner['command']}",
            "",
        ]
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = output.with_name(output.name + ".tmp")
    temporary.write_text("\n".join(lines), encoding="utf-8")
    temporary.replace(output)
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=1000, help="test sentences scored (default 1000)")
    parser.add_argument("--skip-perplexity", action="store_true")
    parser.add_argument("--skip-ner", action="store_true")
    parser.add_argument("--ner-epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--run-dir", type=Path, default=REPO / "runs" / "int8-quality" / "ner-float32")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "int8_quality.md")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "bench"))
    from machine import busy_processes, page_header  # bench/machine.py: the CPU, its flags, the rooflines

    from elmokit.model.int8 import int8_native

    if not int8_native():
        sys.exit("int8_quality: this CPU has no VNNI or AMX-INT8, so dtype int8 is refused here")
    started, load_before = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), busy_processes()
    machine_header = page_header("cpu", args.threads)
    perplexity = None if args.skip_perplexity else measure_perplexity(args.sentences, args.threads)
    ner = None
    if not args.skip_ner:
        command = train_ner(args.run_dir, args.ner_epochs, args.threads, args.seed)
        ner = {**score_ner(args.run_dir, args.threads), "command": command}
    header = [machine_header, f"Run of {started}. Before: {load_before}. "
              f"After: {busy_processes()}. (Quality figures do not depend on the load; CPU seconds are "
              "this process's.)"]
    write_page(args.output, perplexity, ner, header)


if __name__ == "__main__":
    main()
