"""Copy the tables that programs write (bench/results/*.md, docs/results.md) into the README, so the
README shows no figure typed by hand. A block

    <!-- table: bench/results/train.md 1 -->
    ...
    <!-- /table -->

is replaced by the 1st markdown table of that file (a run of lines starting with "|").

    python3 scripts/sync_pages.py [--check]     (--check: exit 1 if the README is not in sync)
"""

from __future__ import annotations

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


def synced(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + nth_table(REPO / m.group(2), int(m.group(3))) + m.group(5), text)


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
