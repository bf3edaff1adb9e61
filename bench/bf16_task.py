"""A task trained on bfloat16 ELMo features against the same task on float32 features: the
built-in biLM, frozen, its layers computed once per sentence in float32 or in bfloat16
(`elmo task train --bilm-dtype`), everything else the same (seed, data, recipe).

    .venv/bin/python bench/bf16_task.py                       # POS (UD EWT) -> bench/results/bf16_task.md
    .venv/bin/python bench/bf16_task.py --task pos --seeds 1 2 --max-epochs 10

Each run is `elmo task train` in its own process (its command is written with the results);
the scores are read back from each run's results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="pos")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--max-epochs", type=int, default=10)
    parser.add_argument("--patience", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "bf16-task")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "bf16_task.md")
    args = parser.parse_args()

    from machine import page_header  # bench/machine.py: the CPU, its flags, the rooflines

    started, load_before = time.strftime("%Y-%m-%d %H:%M"), os.getloadavg()
    header = page_header("cpu", args.threads)
    results, commands = {}, []
    for seed in args.seeds:
        for dtype in DTYPES:
            out = args.runs_dir / f"{args.task}-seed{seed}-{dtype}"
            command = [sys.executable, "-m", "elmokit", "task", "train", "--task", args.task, "--out", str(out),
                       "--overwrite", "--seed", str(seed), "--max-epochs", str(args.max_epochs), "--patience",
                       str(args.patience), "--threads", str(args.threads), "--bilm-dtype", dtype, "--no-progress"]
            commands.append(" ".join(["elmo", *command[3:]]))
            print(commands[-1], flush=True)
            subprocess.run(command, check=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            results[seed, dtype] = json.loads((out / "results.json").read_text(encoding="utf-8"))
    load_after = os.getloadavg()

    metric = results[args.seeds[0], DTYPES[0]]["metric"]
    lines = [
        f"# {args.task}: bfloat16 against float32 ELMo features (`bench/bf16_task.py`)",
        "",
        header,
        f"Run of {started}: the built-in biLM, frozen; its layers computed in float32 or in bfloat16 "
        f"(`--bilm-dtype`), the task model otherwise identical (seed, data, recipe: at most {args.max_epochs} "
        f"epochs, patience {args.patience}). {len(args.seeds)} seed(s): {', '.join(map(str, args.seeds))}. "
        f"Load average before {', '.join(f'{v:.2f}' for v in load_before)}, after "
        f"{', '.join(f'{v:.2f}' for v in load_after)} (other jobs shared the machine; scores do not depend on it).",
        "",
        f"| seed | dev {metric} float32 | dev {metric} bfloat16 | test {metric} float32 | test {metric} bfloat16 | "
        "test difference (bf16 - fp32) | best epoch fp32 / bf16 |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    differences = []
    for seed in args.seeds:
        full, low = results[seed, "float32"], results[seed, "bfloat16"]
        difference = low["test"][metric] - full["test"][metric]
        differences.append(difference)
        lines.append(f"| {seed} | {full['dev'][metric]:.2f} | {low['dev'][metric]:.2f} | {full['test'][metric]:.2f} | "
                     f"{low['test'][metric]:.2f} | {difference:+.2f} | {full['best_epoch']} / {low['best_epoch']} |")
    worst = max(abs(d) for d in differences)
    lines += [
        "",
        f"Largest test difference: {worst:.2f} points; target within 0.2 points: {'met' if worst <= 0.2 else 'NOT met'}.",
        "",
        "Commands:",
        "",
        *[f"    {command}" for command in commands],
    ]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
