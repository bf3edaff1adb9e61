"""What a closed loop of clients lets any server reach: in-process `embed_sentences` on the
sentences `bench/serve.py` sends (UD English EWT dev, the built-in model unless --model), at the
row counts a server's clients keep busy, against the engine's own choice of rows.

    .venv/bin/python bench/serve_rows.py                   # -> bench/results/serve-rows.md
    .venv/bin/python bench/serve_rows.py --rows 16 64 --repeats 2 --output /tmp/rows.md

A server computes the sentences in flight; clients that each wait for their answer keep fewer
rows busy than that (a request's shorter sentences end first, and its client waits for the
longest: bench/serve.py's "rows busy"). A server that computes as efficiently as the engine
reaches about the engine's figure at the rows it keeps busy (a step's time grows with its rows
from a fixed cost, so rows that vary about a mean give no more than the mean's figure). The passes at every row
count run in turn, --repeats rounds (the engine's choice of rows in each round too), and the
fastest pass of each is kept (on a shared machine the slower ones are those something else
slowed down). Same torch threads as bench/serve.py (--threads, default 1).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed import UD_DEV, read_conllu_forms
from machine import busy_processes, page_header  # bench/machine.py: the CPU, its flags, the rooflines
from serve import InProcess  # bench/serve.py: the same in-process run

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="the model (default: the built-in gutenberg-en)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1, as bench/serve.py)")
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 27, 32, 40, 56, 64, 98, 128],
                        help="row counts to run (default: 4 8 16 27 32 40 56 64 98 128: bench/serve.py's "
                             "rows busy and in flight)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the row counts (default: 3)")
    parser.add_argument("--limit", type=int, help="the first N sentences only")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "serve-rows.md")
    args = parser.parse_args()
    if any(rows < 1 for rows in args.rows) or args.repeats < 1:
        parser.error("--rows and --repeats take numbers of at least 1")

    sentences = read_conllu_forms(UD_DEV)[:args.limit]
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_before = busy_processes()
    local = InProcess(sentences, args.model, args.threads, None)
    default = local.rows  # the engine's choice for these sentences
    best: dict[int | None, float] = {}
    for round_ in range(args.repeats):
        for rows in [None, *args.rows]:  # None: the engine's choice, measured in every round too
            speed = local.run(rows)[0]
            best[rows] = max(best.get(rows, 0.0), speed)
            print(f"round {round_ + 1}: {rows or f'default ({default})'} rows {speed:,.0f} tokens/s", flush=True)

    lines = ["# In-process speed at a server's row counts (`bench/serve_rows.py`)", "",
             page_header("cpu", args.threads),
             f"Run of {started}: `ElmoEmbedder.embed_sentences(batch_size=rows)` on UD English EWT dev "
             f"({len(sentences):,} sentences, {sum(map(len, sentences)):,} tokens), model "
             f"{args.model or 'gutenberg-en (built in)'}, warm token cache, {args.threads} torch thread(s); "
             f"{args.repeats} rounds over the row counts, the fastest pass of each kept. Machine load: before, "
             f"{load_before}. After, {busy_processes()}.", "",
             "| rows | tokens/s | / the engine's choice |", "|---:|---:|---:|",
             f"| {default} (the engine's choice) | {best[None]:,.0f} | 1.00x |"]
    lines += [f"| {rows} | {best[rows]:,.0f} | {best[rows] / best[None]:.2f}x |" for rows in args.rows]
    lines += ["", "A server whose clients keep R rows busy on average reaches about the R row's figure "
              "(the last column) where it computes as efficiently as the engine; bench/results/serve.md has the "
              "rows busy of each load.", ""]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
