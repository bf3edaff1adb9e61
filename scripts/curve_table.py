"""Print a run's validation records (metrics.jsonl) as a Markdown table.

    .venv/bin/python scripts/curve_table.py runs/ptb [--tokens-per-epoch 929589]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="training run directory (with metrics.jsonl)")
    parser.add_argument("--tokens-per-epoch", type=int, help="to show the epoch as a fraction")
    args = parser.parse_args()
    records = [json.loads(line) for line in (args.run / "metrics.jsonl").read_text().splitlines()]
    print("| step | training tokens | epoch | run time | valid forward ppl | valid backward ppl | valid average ppl |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for record in records:
        if "valid_ppl" not in record:
            continue
        epoch = f"{record['tokens'] / args.tokens_per_epoch:.2f}" if args.tokens_per_epoch else str(record["epoch"])
        elapsed = record.get("elapsed_s")
        clock = f"{int(elapsed // 3600)}:{int(elapsed % 3600 // 60):02d}" if elapsed is not None else "-"
        print(f"| {record['step']:,} | {record['tokens']:,} | {epoch} | {clock} | {record['valid_forward_ppl']:.1f} | "
              f"{record['valid_backward_ppl']:.1f} | {record['valid_ppl']:.1f} |")


if __name__ == "__main__":
    main()
