"""Record what `elmo demo` prints with the built-in model, for the README's demo block.

    .venv/bin/python scripts/demo_page.py          # runs `elmo demo`, writes docs/results/demo.txt
    python3 scripts/sync_pages.py                   # copies it into the README, with its reading

The README's block (`<!-- demo: docs/results/demo.txt -->`) is written by scripts/sync_pages.py from
this record: the layer sections as `elmo demo` printed them, and a sentence that says, per layer,
which senses of "play" the nearest occurrences have (the senses of the demo's 24 lines are below).
tests/test_pages.py checks the README against the record, and the record against a fresh run.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "docs" / "results" / "demo.txt"
COMMAND = ["demo", "--top-k", "4"]

SENSES = {**{line: "sport or game" for line in range(1, 9)}, **{line: "theatre" for line in range(9, 17)},
          **{line: "music" for line in range(17, 22)}, **{line: "other" for line in range(22, 25)}}
"""The sense of "play" in each line of src/elmokit/demo/play.txt (1-based)."""

SECTION = re.compile(r"^layer (\d+) \(([^)]*)\): .*$")
HIT = re.compile(r"^\s+(\d+)\s+([0-9.]+)\s+line (\d+): (.*)$")


def run_demo() -> str:
    """`elmo demo`'s output with the built-in model, as printed (the timing line kept as it was)."""
    result = subprocess.run([sys.executable, "-m", "elmokit", *COMMAND], capture_output=True, text=True,
                            check=True, cwd=REPO)
    return result.stdout


def ranked(output: str) -> dict[int, list[tuple[int, float]]]:
    """layer -> [(line number, cosine)] in rank order, parsed from `elmo demo`'s output."""
    layers: dict[int, list[tuple[int, float]]] = {}
    current = None
    for line in output.splitlines():
        if section := SECTION.match(line):
            current = layers.setdefault(int(section.group(1)), [])
        elif (hit := HIT.match(line)) and current is not None:
            current.append((int(hit.group(3)), float(hit.group(2))))
    return layers


def reading(output: str) -> str:
    """One sentence per contextual layer: the senses of its nearest occurrences, in rank order."""
    parts = []
    for layer, hits in sorted(ranked(output).items()):
        if layer == 0:
            continue
        senses = [SENSES[line] for line, _ in hits]
        parts.append(f"at layer {layer} the {len(hits)} nearest are, in order, " + ", ".join(senses))
    sport_first = all(SENSES[hits[0][0]] == "sport or game" for layer, hits in ranked(output).items() if layer)
    lead = ("the nearest occurrence is a sport sense at every contextual layer" if sport_first
            else "the nearest occurrence is not always a sport sense")
    return f"At layer 0 every \"play\" is the same vector; {lead}: " + "; ".join(parts) + "."


def block(output: str) -> str:
    """The README's demo block: the reading, then the layer sections of the output."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if SECTION.match(line) and not line.startswith("layer 0"))
    return reading(output) + "\n\n```\n$ elmo demo\n...\n" + "\n".join(lines[start:]).rstrip() + "\n```\n"


def main() -> int:
    output = run_demo()
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(output, encoding="utf-8")
    print(f"wrote {RECORD.relative_to(REPO)}; now run python3 scripts/sync_pages.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
