"""Copy the tables that programs write (bench/results/*.md, docs/results.md) into the README, so the
README shows no figure typed by hand. A block

    <!-- table: bench/results/train.md 1 -->
    ...
    <!-- /table -->

is replaced by the 1st markdown table of that file (a run of lines starting with "|"), and a block
`<!-- model: src/elmokit/models/NAME [docs/models/OLD.json ...] -->` ... `<!-- /model -->` by a table
of those models, a row each: a model directory's row is written from its config.json, vocab.txt,
files and provenance.json (what scripts/build_builtin.sh records); a JSON record keeps the row of
a model that is no longer shipped (written by --record from its directory before it was replaced).
A block `<!-- demo: docs/results/demo.txt -->` ... `<!-- /demo -->` is replaced by the layer sections of
`elmo demo`'s recorded output (scripts/demo_page.py writes the record) and a sentence that says which
senses of "play" come nearest at each layer.
Under a table quoted from a benchmark page (bench/results/*.md written by a bench/*.py), the block
also carries the page's machine line (bench/machine.py's header: the CPU, its flags, the rooflines
of that run), so that figures of different machines are never read as one; a page written before
that header existed is quoted with a note that says so.
A block `<!-- results-bilm -->` ... `<!-- /results-bilm -->` (in the README and docs/results.md) is
replaced by a line that says which built-in model made docs/results.json, and whether it is the one
that ships now (a new version keeps the directory's path, so an old table would pass for the new one).

    python3 scripts/sync_pages.py [--check]     (--check: exit 1 if the README, docs/results.md, docs/integrations.md or docs/scale.md is not in sync)
    python3 scripts/sync_pages.py --record MODEL_DIR OUT.json LABEL
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


def _bench_machine():
    """bench/machine.py as a module (it imports torch only when it measures)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_machine", REPO / "bench" / "machine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def machine_note(source: str) -> str:
    """What follows a quoted table of `source`: for a benchmark page, the machine it was measured on
    (its page_header line, "Measured on: ..."); nothing for other sources."""
    lines = (REPO / source).read_text(encoding="utf-8").splitlines()
    if not (source.startswith("bench/results/") and lines and re.search(r"bench/\w+\.py", lines[0])):
        return ""
    machine = _bench_machine()
    header = next((line for line in lines if machine.is_header(line)), None)
    if header is not None:
        return f"\nMeasured on: {header.removeprefix(machine.HEADER_PREFIX)} (`{source}`)\n"
    old = next((line for line in lines[1:] if line.startswith(("Machine: ", "Run of "))), "")
    said = f' Its own line: "{old.split(". ")[0].rstrip(".")}."' if old else ""
    return (f"\n`{source}` predates bench/machine.py's header (the CPU's flags, the rooflines of its run): "
            f"its figures may be of another machine than the tables beside it.{said}\n")


MODEL_BLOCK = re.compile(r"(<!-- model: ([^>\n]+?) -->\n)(.*?)(<!-- /model -->)", re.S)
MODEL_HEADER = ("| model | shape | trained on | valid ppl (fwd / bwd / avg) | test ppl (fwd / bwd / avg) | size |\n"
                "|---|---|---|---|---|---:|\n")


def model_facts(directory: Path, label: str | None = None) -> dict:
    """What a model's row shows, read from its directory: config.json, vocab.txt, provenance.json
    and the files' sizes. `label` (default: the directory name, and the card's `version`)."""
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    card = json.loads((directory / "provenance.json").read_text(encoding="utf-8"))
    version = f" {card['version']}" if "version" in card else ""
    return {"label": label or f"`{directory.name}`{version}",
            "lstm": config["lstm"], "char_cnn": config["char_cnn"],
            "vocab_size": sum(1 for _ in (directory / "vocab.txt").open(encoding="utf-8")),
            "size_bytes": sum(path.stat().st_size for path in directory.rglob("*") if path.is_file()),
            "tokens": card["tokens"], "steps": card["steps"],
            **{f"{split}_ppl": card[f"{split}_first_5000_sentences"] for split in ("valid", "test")}}


def model_row(facts: dict) -> str:
    """One model's row: shape, what it read, its perplexities on the first 5,000 sentences, size."""
    lstm, cnn = facts["lstm"], facts["char_cnn"]
    n_filters = sum(count for _, count in cnn["filters"])
    widths = [width for width, _ in cnn["filters"]]
    cells = (f"{lstm['n_layers']} x {lstm['cell_dim']} cells -> {lstm['projection_dim']}, {n_filters} char filters "
             f"(widths {min(widths)}-{max(widths)}), {cnn['n_highway']} highway; {2 * lstm['projection_dim']}-dim vectors")
    read = f"{facts['tokens'] / 1e6:.2f}M tokens ({facts['steps']:,} steps), {facts['vocab_size']:,}-word softmax"
    scores = [" / ".join(f"{facts[split + '_ppl'][key]:.1f}" for key in ("forward_ppl", "backward_ppl")) +
              f" / **{facts[split + '_ppl']['ppl']:.1f}**" for split in ("valid", "test")]
    return f"| {facts['label']} | {cells} | {read} | {scores[0]} | {scores[1]} | {facts['size_bytes'] / 1e6:.1f} MB |\n"


def model_table(sources: str) -> str:
    """The rows of `<!-- model: SOURCE ... -->`: each SOURCE a model directory (read now) or the
    JSON record of a model no longer shipped (`--record`)."""
    rows = []
    for source in sources.split():
        path = REPO / source
        facts = json.loads(path.read_text(encoding="utf-8")) if path.suffix == ".json" else model_facts(path)
        rows.append(model_row(facts))
    return MODEL_HEADER + "".join(rows)


REMAKE = "(`.venv/bin/python scripts/task_results.py --probes` remakes them)."
RESULTS_BILM_BLOCK = re.compile(r"(<!-- results-bilm -->\n)(.*?)(<!-- /results-bilm -->)", re.S)


def results_bilm_line() -> str:
    """Which biLM made docs/results.json (its `bilm` record; results made before the record existed
    were all made with v1 of the built-in model) against the built-in model's card that ships."""
    record = json.loads((REPO / "docs" / "results.json").read_text(encoding="utf-8")).get("bilm")
    record = record or {"builtin": True, "version": "v1", "fingerprint": None}
    card = json.loads((REPO / "src" / "elmokit" / "models" / "gutenberg-en" / "provenance.json").read_text(encoding="utf-8"))
    shipped = card.get("version", "v1")
    if not record["builtin"]:
        return (f"These results were made with the biLM in `{record['model']}` (weights fingerprint "
                f"`{record['fingerprint']}`), not with the built-in model.\n")
    if record["version"] == shipped and record["fingerprint"] != card.get("fingerprint", record["fingerprint"]):
        return (f"**These results were made with other weights (fingerprint `{record['fingerprint']}`) than the "
                f"built-in model's that ships (`gutenberg-en` {shipped}, `{card['fingerprint']}`)** {REMAKE}\n")
    if record["version"] == shipped:
        return f"These results were made with the built-in model that ships (`gutenberg-en` {shipped}).\n"
    return (f"**These results were made with `gutenberg-en` {record['version']}, the built-in model before "
            f"{shipped} replaced it; they have not been remade with {shipped} yet** {REMAKE}\n")


DEMO_BLOCK = re.compile(r"(<!-- demo: (\S+) -->\n)(.*?)(<!-- /demo -->)", re.S)


def demo_block(record: str) -> str:
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo_page", REPO / "scripts" / "demo_page.py")
    demo_page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo_page)
    return demo_page.block((REPO / record).read_text(encoding="utf-8"))


def synced(text: str) -> str:
    text = BLOCK.sub(lambda m: m.group(1) + nth_table(REPO / m.group(2), int(m.group(3))) + machine_note(m.group(2))
                     + m.group(5), text)
    text = DEMO_BLOCK.sub(lambda m: m.group(1) + demo_block(m.group(2)) + m.group(4), text)
    text = RESULTS_BILM_BLOCK.sub(lambda m: m.group(1) + results_bilm_line() + m.group(3), text)
    return MODEL_BLOCK.sub(lambda m: m.group(1) + model_table(m.group(2)) + m.group(4), text)


def main() -> int:
    if sys.argv[1:2] == ["--record"]:  # --record MODEL_DIR OUT.json LABEL: keep a model's row before it is replaced
        if len(sys.argv) != 5:
            print("usage: sync_pages.py --record MODEL_DIR OUT.json LABEL", file=sys.stderr)
            return 2
        directory, out, label = sys.argv[2:5]
        facts = model_facts(Path(directory), label)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(facts, indent=2) + "\n", encoding="utf-8")
        return 0
    stale = []
    for page in (REPO / "README.md", REPO / "docs" / "results.md", REPO / "docs" / "integrations.md",
                 REPO / "docs" / "scale.md"):
        text = page.read_text(encoding="utf-8")
        new = synced(text)
        if new == text:
            continue
        stale.append(page.name)
        if "--check" not in sys.argv[1:]:
            page.write_text(new, encoding="utf-8")
    if stale and "--check" in sys.argv[1:]:
        print(f"{', '.join(stale)} not in sync with what they quote: run python3 scripts/sync_pages.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
