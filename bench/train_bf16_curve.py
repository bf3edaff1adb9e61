"""`elmo train --lstm-bf16` (or `--flags`: `--softmax-bf16`, both) against float32 over a real
training budget: is the loss curve within float32's own run-to-run noise? (issue 41, point 3)

Three `elmo train` runs of the gutenberg-cpu shape on PTB (full softmax over its 10k words, Adagrad
0.2, batch 32 x 20, dropout 0.1, `--max-tokens` 2M training tokens, validation on ptb.valid every
`--eval-every` steps):

    float32, seed 0      the reference
    float32, seed 1      another float32 run: other initial weights, dropout and data order
    FLAGS, seed 0        the reference's seed, with `--flags` (default --lstm-bf16: the LSTM's
                         products in bfloat16)

The noise band is what separates the two float32 runs. bfloat16 passes where, over every whole window
of `--window` training tokens after the first (the first holds the steep start, where a few steps'
shift reads as a large gap; a last part-window of a few steps is left out), its mean training loss differs from the reference's by no more than
the float32 runs' largest difference, and its validation perplexity at each evaluation likewise.

Each run goes to WORK/<name> with `--auto-resume`, so this script, killed or stopped, continues
where its runs' checkpoints are: rerun the same command. The page is written from the runs'
metrics.jsonl files once all three have finished (or now, with `--report`, from what they hold).

    nohup .venv/bin/python bench/train_bf16_curve.py --work runs/bf16-curve --threads 1 --jobs 3 > runs/bf16-curve.log 2>&1 &
    .venv/bin/python bench/train_bf16_curve.py --work runs/bf16-curve --report     # the page only
    nohup .venv/bin/python bench/train_bf16_curve.py --work runs/bf16-both-curve --threads 1 --jobs 3 \
        --flags="--lstm-bf16 --softmax-bf16" --output bench/results/train-bf16-both-curve.md > runs/bf16-both-curve.log 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from machine import page_header  # noqa: E402  bench/machine.py: the machine and its rooflines

PTB = Path(os.environ.get("PTB_DATA", REPO.parent / "shared" / "data" / "ptb"))
REFERENCE, OTHER = "float32, seed 0", "float32, seed 1"
FLOAT32 = ["--no-lstm-bf16", "--no-softmax-bf16"]  # float32 products (bfloat16 are the default on some CPUs)
RUNS = {REFERENCE: ("f32-seed0", 0, FLOAT32), OTHER: ("f32-seed1", 1, FLOAT32)}  # name: (folder, seed, flags);
# main adds BF16
BF16 = ""  # the bfloat16 run's name: "<flags>, seed 0"


def train(work: Path, folder: str, seed: int, flags: list[str], args) -> None:
    elmo = Path(sys.executable).with_name("elmo")
    command = [str(elmo), "train", "--auto-resume", "--output-dir", str(work / folder),
               "--train", str(PTB / "ptb.train.txt.gz"), "--valid", str(PTB / "ptb.valid.txt"),
               "--vocab", str(work / "vocab.txt"), "--model", str(REPO / "scripts" / "gutenberg-cpu.json"),
               "--softmax", "full", "--optimizer", "adagrad", "--lr", "0.2", "--batch-size", "32",
               "--unroll-steps", "20", "--dropout", "0.1", "--max-tokens", str(args.max_tokens),
               "--eval-every", str(args.eval_every), "--log-every", "10", "--checkpoint-every", "250",
               "--threads", str(args.threads), "--seed", str(seed), "--no-progress", *flags]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True)


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(training lines, validation lines) of a run's metrics.jsonl."""
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [line for line in lines if "loss" in line], [line for line in lines if "valid_ppl" in line]


def windows(lines: list[dict], width: int) -> dict[int, float]:
    """Mean training loss of each window of `width` tokens (keyed by its index), from the log lines."""
    sums: dict[int, list[float]] = {}
    for line in lines:
        sums.setdefault((line["tokens"] - 1) // width, []).append(line["loss"])
    return {index: sum(losses) / len(losses) for index, losses in sorted(sums.items())}


def report(work: Path, args) -> list[str]:
    metrics = {name: read_metrics(work / folder / "metrics.jsonl") for name, (folder, _, _) in RUNS.items()
               if (work / folder / "metrics.jsonl").is_file()}
    if len(metrics) < len(RUNS):
        raise SystemExit(f"{work}: runs without metrics.jsonl yet: {sorted(set(RUNS) - set(metrics))}")
    curves = {name: windows(train_lines, args.window) for name, (train_lines, _) in metrics.items()}
    read = min(lines[-1]["tokens"] for lines, _ in metrics.values())  # whole windows only: a last part-window
    shared = [i for i in sorted(set.intersection(*(set(curve) for curve in curves.values())))  # holds a step or two
              if (i + 1) * args.window <= read]
    compared = shared[1:]  # the first window is the steep start
    noise = max(abs(curves[OTHER][i] - curves[REFERENCE][i]) for i in compared)
    gap = max(abs(curves[BF16][i] - curves[REFERENCE][i]) for i in compared)
    evals = {name: {line["step"]: line["valid_ppl"] for line in valid} for name, (_, valid) in metrics.items()}
    eval_steps = sorted(set.intersection(*(set(e) for e in evals.values())))
    ppl_noise = max((abs(evals[OTHER][s] - evals[REFERENCE][s]) for s in eval_steps), default=float("nan"))
    ppl_gap = max((abs(evals[BF16][s] - evals[REFERENCE][s]) for s in eval_steps), default=float("nan"))
    speed = {name: sum(line["tokens_per_s"] for line in lines[1:]) / max(len(lines) - 1, 1)
             for name, (lines, _) in metrics.items()}
    tokens = {name: lines[-1]["tokens"] for name, (lines, _) in metrics.items()}
    holds = gap <= noise and ppl_gap <= ppl_noise
    out = [f"# `{args.flags}` against float32 over 2M training tokens (bench/train_bf16_curve.py)", ""]
    out += [page_header("cpu", args.threads)]
    out += ["", f"gutenberg-cpu shape on PTB (ptb.train, full softmax over its {vocab_size(work):,} words), Adagrad 0.2, "
            f"batch 32 x 20, dropout 0.1, {args.threads} thread(s) a run, {args.jobs} run(s) at a time; validation "
            f"on ptb.valid (full softmax) every {args.eval_every} steps. Training tokens read: "
            + "; ".join(f"{name}: {count:,}" for name, count in tokens.items()) + ". Other work shared the machine "
            "during the runs (the speeds below are not benchmarks: bench/results/train-lstm-bf16.md is).", "",
            f"The bfloat16 run: `elmo train {args.flags}`.", "",
            f"Mean training loss by window of {args.window:,} tokens:", "",
            "| tokens | " + " | ".join(RUNS) + " | float32 seed 1 - seed 0 | bf16 - float32 seed 0 |",
            "|---:|" + "---:|" * (len(RUNS) + 2)]
    for i in shared:
        out.append(f"| {(i + 1) * args.window:,} | " + " | ".join(f"{curves[name][i]:.4f}" for name in RUNS)
                   + f" | {curves[OTHER][i] - curves[REFERENCE][i]:+.4f} | {curves[BF16][i] - curves[REFERENCE][i]:+.4f} |")
    out += ["", "Validation perplexity (ptb.valid, forward and backward averaged):", "",
            "| step | " + " | ".join(RUNS) + " |", "|---:|" + "---:|" * len(RUNS)]
    out += [f"| {s:,} | " + " | ".join(f"{evals[name][s]:.2f}" for name in RUNS) + " |" for s in eval_steps]
    out += ["", f"**Run-to-run noise of float32** (largest |seed 1 - seed 0| over the windows after the first): "
            f"{noise:.4f} nats of training loss, {ppl_noise:.2f} of validation perplexity. **bfloat16's distance "
            f"from float32 seed 0**: {gap:.4f} nats, {ppl_gap:.2f} of perplexity: "
            + ("within the noise." if holds else "**outside the noise**."), "",
            "Mean tokens/s a run (log lines after the first; shared machine, see above): "
            + "; ".join(f"{name}: {value:,.0f}" for name, value in speed.items()) + ".", "",
            f"    .venv/bin/python bench/train_bf16_curve.py --work {args.work} --threads {args.threads} --jobs {args.jobs}"
            + ("" if args.flags == "--lstm-bf16" else f' --flags="{args.flags}" --output {shown_path(args.output)}')]
    return out


def shown_path(path: Path) -> Path:
    """`path` relative to the repository where it is inside it (as a page shows a command)."""
    path = path.resolve()
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


def vocab_size(work: Path) -> int:
    return sum(1 for line in (work / "vocab.txt").read_text(encoding="utf-8").splitlines() if line.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "bf16-curve")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=2_000_000)
    parser.add_argument("--eval-every", type=int, default=625)
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each its own process)")
    parser.add_argument("--window", type=int, default=200_000)
    parser.add_argument("--report", action="store_true", help="only write the page from the runs as they are")
    parser.add_argument("--output", type=Path, default=None,
                        help="the page (default with --flags=--lstm-bf16: bench/results/train-lstm-bf16-curve.md; "
                             "required with other flags)")
    parser.add_argument("--flags", default="--lstm-bf16",
                        help='the bfloat16 run\'s elmo train flags (quoted: --flags="--lstm-bf16 --softmax-bf16"): '
                             "--lstm-bf16 and/or --softmax-bf16")
    args = parser.parse_args()
    flags = args.flags.split()
    if not flags or not set(flags) <= {"--lstm-bf16", "--softmax-bf16"} or len(set(flags)) != len(flags):
        parser.error(f"--flags must hold --lstm-bf16 and/or --softmax-bf16 once each, got {args.flags!r}")
    args.flags = " ".join(flag for flag in ("--lstm-bf16", "--softmax-bf16") if flag in flags)  # one order
    if args.output is None:
        if args.flags != "--lstm-bf16":
            parser.error("--output is required with --flags other than --lstm-bf16 (the default page is that run's)")
        args.output = REPO / "bench" / "results" / "train-lstm-bf16-curve.md"
    global BF16
    BF16 = f"{args.flags}, seed 0"
    folder = "bf16-seed0" if args.flags == "--lstm-bf16" else "bf16-" + "-".join(
        flag.removeprefix("--").removesuffix("-bf16") for flag in args.flags.split()) + "-seed0"
    RUNS[BF16] = (folder, 0, [flag if flag in flags else flag.replace("--", "--no-", 1)  # the other one float32
                              for flag in ("--lstm-bf16", "--softmax-bf16")])
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.report:
        if not (args.work / "vocab.txt").is_file():
            elmo = Path(sys.executable).with_name("elmo")
            subprocess.run([str(elmo), "vocab", str(PTB / "ptb.train.txt.gz"), "-o", str(args.work / "vocab.txt")],
                           check=True)
        with ThreadPoolExecutor(args.jobs) as pool:  # each run its own `elmo train` process
            for done in [pool.submit(train, args.work, *run, args) for run in RUNS.values()]:
                done.result()
    page = "\n".join(report(args.work, args)) + "\n"
    temporary = args.output.with_name(args.output.name + ".tmp")
    temporary.write_text(page, encoding="utf-8")
    temporary.replace(args.output)
    print(page)


if __name__ == "__main__":
    main()
