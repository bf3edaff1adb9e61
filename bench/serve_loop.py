"""The server's own loop without HTTP: where its time goes at a server's row counts, and what a
process working on the other core costs it. `elmo serve`'s model process drives
`elmokit.serve.recurrence.Recurrence`; here this process drives it the same way on the sentences
`bench/serve.py` sends (UD English EWT dev, the built-in model unless --model, warm token cache):
before each step the sentences waiting join the free rows (their token layers looked up, then
admitted), the busy rows are kept compact, the step runs, and the sentences that ended are read
(their sentence vectors, what /v1/embeddings answers), keeping --rows rows busy until the last,
in one recurrence built as the server builds it at its default limits (its rows, its rings).

    .venv/bin/python bench/serve_loop.py                  # -> bench/results/serve-loop.md
    .venv/bin/python bench/serve_loop.py --rows 27 --repeats 2 --output /tmp/loop.md

Each row count runs alone and beside a second process that does what the server's HTTP process
and bench/serve.py's load generator do on the other core (JSON: the requests' token lists
decoded and the answers' vectors encoded, in a loop), in turn, --repeats rounds, the fastest of
each kept; in-process `embed_sentences` at the same rows and at its own choice runs in the same
rounds (bench/serve.py's "in-process" and its bounds). Same torch threads as bench/serve.py
(--threads, default 1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed import UD_DEV, read_conllu_forms
from machine import busy_processes, page_header  # bench/machine.py: the CPU, its flags, the rooflines
from serve import InProcess  # bench/serve.py: the same in-process run

import torch

REPO = Path(__file__).resolve().parents[1]
PARTS = ("token layer", "admit", "compact", "step", "take")
JSON_WORK = """
import json, sys, time
import numpy as np
sentences = json.loads(sys.stdin.read())
bodies = [json.dumps({"input": sentences[i:i + 3]}) for i in range(0, len(sentences), 3)]
answer = {"data": [{"embedding": np.random.default_rng(0).random(256).tolist()} for _ in range(3)]}
print("ready", flush=True)
while True:
    for body in bodies:
        json.loads(body)
        json.dumps(answer)
    time.sleep(0.0005)
"""


def server_recurrence(embedder):
    """The recurrence `elmo serve` builds at its default limits (its rows and its rings' steps)."""
    from elmokit.serve.inputs import Limits
    from elmokit.serve.recurrence import Recurrence

    limits = Limits()
    return Recurrence(embedder.bilm, embedder.rows_at(limits.max_batch_tokens), limits.max_input_tokens + 2)


def drive(embedder, recurrence, sentences: list[list[str]], rows: int) -> dict:
    """The server's loop over `sentences` in `recurrence` (idle) with at most `rows` busy:
    tokens/s, the mean step (ms) and each part's share of the wall time."""
    from elmokit.serve.recurrence import token_layer

    waiting = list(reversed(sentences))
    seconds: Counter = Counter()
    steps = 0
    start = time.perf_counter()
    while waiting or recurrence.busy:
        mark = time.perf_counter()
        joining = [waiting.pop() for _ in range(min(len(waiting), rows - len(recurrence.busy)))]
        if joining:
            layers = token_layer(embedder, joining)
            seconds["token layer"] += (now := time.perf_counter()) - mark
            recurrence.admit(layers, [len(sentence) + 2 for sentence in joining])
            seconds["admit"] += (mark := time.perf_counter()) - now
        recurrence.compact()
        seconds["compact"] += (now := time.perf_counter()) - mark
        ended = recurrence.step()
        steps += 1
        seconds["step"] += (mark := time.perf_counter()) - now
        if ended:
            recurrence.take(ended, sentence_vectors=True)
            seconds["take"] += time.perf_counter() - mark
    wall = time.perf_counter() - start
    return {"speed": sum(map(len, sentences)) / wall, "step_ms": seconds["step"] / steps * 1e3,
            "shares": {part: seconds[part] / wall for part in PARTS}}


def step_costs(recurrence, embedder, span: int, repeats: int, steps: int = 40) -> dict:
    """One step of `recurrence` with rows 0 .. span-1 busy (long sentences, so that none ends),
    against the step's own products (each layer's gate and projection products of both
    directions, the weights the step uses) run in the step's order and each repeated on its own:
    the mean of `steps` calls, the fastest of `repeats` rounds, in seconds; and the products'
    FLOPs a row."""
    from elmokit.serve.recurrence import token_layer

    length = recurrence.horizon  # positions: the sentences outlast every step timed
    if 1 + repeats * steps > length - 2:
        raise ValueError(f"{repeats} x {steps} steps do not fit the recurrence's {length}-step rings")
    rows = recurrence.admit(token_layer(embedder, [["the"] * (length - 2)] * span), [length] * span)
    gate_state = torch.zeros(span, 2 * recurrence.outputs.shape[-1], dtype=recurrence.compute_dtype)
    cell_output = torch.zeros(span, recurrence.cell.shape[-1], dtype=recurrence.compute_dtype)
    calls = []  # the step's order: a layer's gate products, then its projections
    for gates, projections, bias in zip(recurrence.gate_products, recurrence.projections, recurrence.bias):
        calls += [(product, (gate_state, bias[d])) for d, product in enumerate(gates)]
        calls += [(product, (cell_output,)) for product in projections]

    def fastest(run) -> float:
        run()  # warm
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(steps):
                run()
            best = min(best, (time.perf_counter() - start) / steps)
        return best

    def in_order():
        for product, inputs in calls:
            product(*inputs)

    step = fastest(recurrence.step)
    ordered = fastest(in_order)
    alone = sum(fastest(lambda product=product, inputs=inputs: product(*inputs)) for product, inputs in calls)
    recurrence.drop(rows)
    dim, cell_dim = gate_state.shape[-1] // 2, cell_output.shape[-1]
    flops = 2 * len(recurrence.layers) * 2 * (4 * cell_dim * 2 * dim + cell_dim * dim)  # a row: L x D x (gates, projection)
    return {"step": step, "ordered": ordered, "alone": alone, "flops": flops}


def step_table(costs: dict[int, dict]) -> list[str]:
    """The page's second table: `step_costs` at each row count."""
    widest = costs[max(costs)]
    per_row = widest["step"] / max(costs)
    lines = ["## A step by the rows it computes", "",
             "`Recurrence.step` with rows 0 .. R-1 busy, alone in this process, against its own products (each "
             "layer's gate product [x | h] and projection, both directions): in the step's order, one after the "
             "other as the step runs them (every weight read once a step), and each product repeated on its own "
             "(its weight still in the caches from the call before). GFLOP/s count the products' multiply-adds "
             f"({widest['flops'] / 1e6:.2f} MFLOP a row). 'A row / at {max(costs)} rows' divides the step's time a row "
             f"at {max(costs)} rows by its time a row at R: the most a server keeping R rows busy can reach of one "
             f"keeping {max(costs)} busy, its HTTP, JSON and admissions costing nothing.", "",
             "| rows | step, ms | a row, us | a row / at " + f"{max(costs)} rows | products in the step's order, ms "
             "| GFLOP/s | each product alone, ms | GFLOP/s | the rest of the step, ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for span, cost in costs.items():
        flops = cost["flops"] * span
        lines.append(f"| {span} | {cost['step'] * 1e3:.2f} | {cost['step'] / span * 1e6:.1f} | "
                     f"{per_row / (cost['step'] / span):.2f}x | {cost['ordered'] * 1e3:.2f} | "
                     f"{flops / cost['ordered'] / 1e9:.1f} | {cost['alone'] * 1e3:.2f} | {flops / cost['alone'] / 1e9:.1f} | "
                     f"{(cost['step'] - cost['ordered']) * 1e3:.2f} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="the model (default: the built-in gutenberg-en)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1, as bench/serve.py)")
    parser.add_argument("--rows", type=int, nargs="+", default=[27, 56, 98],
                        help="rows kept busy (default: 27 56 98, bench/serve.py's rows busy at 16 x 1-4, 64 x 1 "
                             "and 64 x 1-4)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (default: 3)")
    parser.add_argument("--spans", type=int, nargs="+", default=[1, 8, 16, 27, 56, 98, 128],
                        help="busy rows of the step-by-rows table (default: 1 8 16 27 56 98 128)")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "serve-loop.md")
    args = parser.parse_args()
    if any(rows < 1 for rows in args.rows + args.spans) or args.repeats < 1:
        parser.error("--rows and --repeats take numbers of at least 1")

    sentences = read_conllu_forms(UD_DEV)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_before = busy_processes()
    local = InProcess(sentences, args.model, args.threads, None)  # warm: its token cache holds every word
    default = local.rows
    best: dict = {}

    def keep(key, result: dict) -> None:
        if result["speed"] > best.get(key, {"speed": 0.0})["speed"]:
            best[key] = result

    recurrence = server_recurrence(local.embedder)  # one for every pass, as the server keeps one
    if max(args.rows + args.spans) > recurrence.rows:
        parser.error(f"--rows, --spans: the server's recurrence has {recurrence.rows} rows")
    drive(local.embedder, recurrence, sentences, args.rows[0])  # warm: the loop's products and views
    for round_ in range(args.repeats):
        keep(("engine", None), {"speed": local.run()[0]})
        for rows in args.rows:
            keep(("engine", rows), {"speed": local.run(rows)[0]})
            keep(("alone", rows), drive(local.embedder, recurrence, sentences, rows))
            other = subprocess.Popen([sys.executable, "-c", JSON_WORK], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
            other.stdin.write(json.dumps(sentences))
            other.stdin.close()
            other.stdout.readline()  # "ready": its bodies are built
            try:
                keep(("beside", rows), drive(local.embedder, recurrence, sentences, rows))
            finally:
                other.kill()
                other.wait()
            print(f"round {round_ + 1}, {rows} rows: loop alone {best[('alone', rows)]['speed']:,.0f} tokens/s, "
                  f"beside JSON {best[('beside', rows)]['speed']:,.0f}, engine {best[('engine', rows)]['speed']:,.0f} "
                  f"(its {default} rows {best[('engine', None)]['speed']:,.0f})", flush=True)

    costs = {span: step_costs(recurrence, local.embedder, span, args.repeats) for span in args.spans}
    in_process = best[("engine", None)]["speed"]
    lines = ["# The server's loop without HTTP (`bench/serve_loop.py`)", "",
             page_header("cpu", args.threads),
             f"Run of {started}; {args.threads} torch thread(s); UD English EWT dev, {len(sentences):,} sentences, "
             f"{sum(map(len, sentences)):,} tokens; model: {args.model or 'gutenberg-en (built in)'}; warm token "
             f"cache; {args.repeats} rounds, the fastest of each kept.", "",
             f"Machine load: before, {load_before}. After, {busy_processes()}.", "",
             "The loop is `elmo serve`'s model process without its pipes (`drive`, in the recurrence the server "
             f"builds at its default limits: {recurrence.rows} rows, rings of {recurrence.horizon} steps): sentences "
             "join the free rows "
             "as rows free, every step computes the busy rows, the ended ones are read as sentence vectors. "
             "*Beside JSON*: the same loop while a second process decodes requests and encodes answers in JSON on "
             "the other core, as the server's HTTP process and the load generator do during bench/serve.py. "
             f"*In-process*: `embed_sentences` with as many rows, and with its own choice ({default} rows: "
             f"{in_process:,.0f} tokens/s), the figure bench/serve.py divides by.", "",
             "| rows busy | loop alone, tokens/s | / in-process | loop beside JSON, tokens/s | / in-process | "
             "step alone, ms | step beside JSON, ms | in-process at these rows / in-process | "
             + " | ".join(f"{part} (alone)" for part in PARTS) + " |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(PARTS)]
    for rows in args.rows:
        alone, beside = best[("alone", rows)], best[("beside", rows)]
        lines.append(f"| {rows} | {alone['speed']:,.0f} | {alone['speed'] / in_process:.2f}x | {beside['speed']:,.0f} | "
                     f"{beside['speed'] / in_process:.2f}x | {alone['step_ms']:.2f} | {beside['step_ms']:.2f} | "
                     f"{best[('engine', rows)]['speed'] / in_process:.2f}x | "
                     + " | ".join(f"{100 * alone['shares'][part]:.1f}%" for part in PARTS) + " |")
    lines += ["", "The parts are shares of the loop's wall time: the token layer (the token cache's lookup), "
              "`Recurrence.admit`, `compact`, `step` and `take`; what they leave is the loop's own Python.", ""]
    lines += step_table(costs)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
