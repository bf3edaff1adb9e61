"""Copy the tables that programs write (bench/results/*.md, docs/results.md) into the README, so the
README shows no figure typed by hand. A block

    <!-- table: bench/results/train.md 1 -->
    ...
    <!-- /table -->

is replaced by the 1st markdown table of that file (a run of lines starting with "|"), and a block
`<!-- model: src/elmokit/models/NAME -->` ... `<!-- /model -->` by the model's row, written from its
config.json, safetensors file and provenance.json (what scripts/build_builtin.sh records).

    python3 scripts/sync_pages.py [--check]     (--check: exit 1 if the README is not in sync)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- table: (\S+) (\d+) -->\n)(.*?)(<!-- /table -->)", re.S)


def nth_table(path: Path, number: int) -> str:
    tables, current = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    if not 1 <= number <= len(tables):
        raise SystemExit(f"{path}: no table {number} (it has {len(tables)})")
    return "\n".join(tables[number - 1]) + "\n"


MODEL_BLOCK = re.compile(r"(<!-- model: (\S+) -->\n)(.*?)(<!-- /model -->)", re.S)


def model_row(directory: Path) -> str:
    """The built-in model's table: shape, size, what it read and its perplexities."""
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    card = json.loads((directory / "provenance.json").read_text(encoding="utf-8"))
    lstm, cnn = config["lstm"], config["char_cnn"]
    n_filters = sum(count for _, count in cnn["filters"])
    widths = [width for width, _ in cnn["filters"]]
    ppl = {split: card[f"{split}_first_5000_sentences"] for split in ("valid", "test")}
    vocab_size = sum(1 for _ in (directory / "vocab.txt").open(encoding="utf-8"))
    size_mb = sum(path.stat().st_size for path in directory.iterdir()) / 1e6
    cells = (f"{lstm['n_layers']} x {lstm['cell_dim']} cells -> {lstm['projection_dim']}, {n_filters} char filters "
             f"(widths {min(widths)}-{max(widths)}), {cnn['n_highway']} highway; {2 * lstm['projection_dim']}-dim vectors")
    read = f"{card['tokens'] / 1e6:.2f}M tokens ({card['steps']:,} steps), {vocab_size:,}-word softmax"
    scores = [" / ".join(f"{ppl[split][key]:.1f}" for key in ("forward_ppl", "backward_ppl")) +
              f" / **{ppl[split]['ppl']:.1f}**" for split in ("valid", "test")]
    return ("| model | shape | trained on | valid ppl (fwd / bwd / avg) | test ppl (fwd / bwd / avg) | size |\n"
            "|---|---|---|---|---|---:|\n"
            f"| `{directory.name}` | {cells} | {read} | {scores[0]} | {scores[1]} | {size_mb:.1f} MB |\n")


def synced(text: str) -> str:
    text = BLOCK.sub(lambda m: m.group(1) + nth_table(REPO / m.group(2), int(m.group(3))) + m.group(5), text)
    return MODEL_BLOCK.sub(lambda m: m.group(1) + model_row(REPO / m.group(2)) + m.group(4), text)


def main() -> int:
    readme = REPO / "README.md"
    text = readme.read_text(encoding="utf-8")
    new = synced(text)
    if "--check" in sys.argv[1:]:
        if new != text:
            print("README.md is not in sync with the tables it quotes: run python3 scripts/sync_pages.py")
            return 1
        return 0
    readme.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
