"""Where an embedding run's time goes, per operation: what bounds a dtype below its ceiling.

`bench/embed.py` gives each dtype's tokens/s and its fraction of the ceiling (the LSTM step's
products alone at the batch's rows); this program says what the rest of the time is. It embeds
the first `--limit` UD English EWT dev sentences with the `original` shape (random weights), batch
32, token cache off, once to warm up and once under torch.profiler, for each `--dtypes`, each in
its own process, and writes one page: the wall time; the main thread's time by kind of operation
(the products, the char CNN's convolution, the elementwise passes and casts, the rest); the
Python and dispatch time between operations (wall time minus the operations' own time); and
the operations that took the most, with their input shapes.

    .venv/bin/python bench/profile_embed.py [--dtypes float32 bfloat16 int8] [--limit 300]
        [--threads 2] [--output bench/results/profile-embed.md] [--note "what else ran"]

An operation's time is its own (self) time on the thread that called it, in which oneDNN's and
ATen's parallel regions run to their end, so the kinds add up to the time the operations held the
main thread. The profiler adds a few microseconds an operation: the wall time under it is longer
than bench/embed.py's, by about (operations) x that; the page gives both.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from embed import DTYPES, REPO, _model, bench_sentences  # bench/embed.py
from machine import busy_processes, page_header, replace_page

PRODUCTS = ("addmm", "mm", "bmm", "baddbmm", "_int_mm", "_linear_pointwise", "qlinear_pointwise", "linear",
            "matmul", "_addmm_activation", "mkldnn_linear")
CONVOLUTIONS = ("convolution", "_convolution", "mkldnn_convolution", "conv1d", "conv2d", "_convolution_pointwise")
ELEMENTWISE = ("sigmoid", "sigmoid_", "tanh", "tanh_", "mul", "mul_", "add", "add_", "sub", "sub_", "addcmul_",
               "addcmul", "clamp", "clamp_", "clamp_min", "copy_", "to", "_to_copy", "abs", "amax", "div", "div_",
               "round", "round_", "relu", "relu_", "max", "index", "index_put_", "cat", "stack", "fill_", "zero_",
               "where", "lerp_")


def kind_of(name: str) -> str:
    """The kind of a profiled operation by its name ("aten::addmm", "onednn::qlinear_pointwise")."""
    short = name.split("::")[-1]
    if short in PRODUCTS:
        return "products"
    if short in CONVOLUTIONS:
        return "char CNN convolution"
    if short in ELEMENTWISE:
        return "elementwise and casts"
    return "other operations"


def profile_one(dtype: str, limit: int, threads: int, batch_size: int) -> dict:
    """One dtype in this process: the warm-up run, then the profiled one."""
    from elmokit import ElmoEmbedder

    torch.set_num_threads(threads)
    embedder = ElmoEmbedder(module=_model("original"), cache_tokens=False, dtype=None if dtype == "float32" else dtype,
                            threads=threads)  # the page says how many: no default lowers it
    sentences = bench_sentences(limit)
    list(embedder.embed_sentences(sentences, batch_size))  # warm: packed weights, kernels, int8's kernel choice
    start = time.perf_counter()
    list(embedder.embed_sentences(sentences, batch_size))
    unprofiled = time.perf_counter() - start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
        start = time.perf_counter()
        list(embedder.embed_sentences(sentences, batch_size))
        wall = time.perf_counter() - start
    events = profile.key_averages(group_by_input_shape=True)
    kinds: dict[str, float] = {}
    ops = []
    calls = 0
    for event in events:
        if event.key.startswith(("ProfilerStep", "[memory]")) or event.self_cpu_time_total <= 0:
            continue
        calls += event.count
        seconds = event.self_cpu_time_total / 1e6
        kinds[kind_of(event.key)] = kinds.get(kind_of(event.key), 0.0) + seconds
        ops.append({"name": event.key, "shapes": str(event.input_shapes)[:90], "calls": event.count,
                    "seconds": seconds})
    ops.sort(key=lambda op: -op["seconds"])
    return {"dtype": dtype, "wall": wall, "unprofiled": unprofiled, "kinds": kinds, "ops": ops[:25],
            "calls": calls, "tokens": sum(map(len, sentences)),
            "sentences": len(sentences)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--limit", type=int, default=300, help="first N UD dev sentences (default 300)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "profile-embed.md")
    parser.add_argument("--note", default="", help="what else ran, for the page")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: JSON of one dtype's run
    args = parser.parse_args()
    if args.one:
        print(json.dumps(profile_one(**json.loads(args.one))))
        return
    started, before = time.strftime("%Y-%m-%d %H:%M"), busy_processes()
    header = page_header("cpu", args.threads)
    results = []
    for dtype in args.dtypes:
        spec = {"dtype": dtype, "limit": args.limit, "threads": args.threads, "batch_size": args.batch_size}
        run = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"{dtype} failed:\n{run.stderr[-3000:]}")
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(f"{dtype}: {results[-1]['wall']:.2f} s profiled, {results[-1]['unprofiled']:.2f} s not", flush=True)
    write_page(args, header, started, before, busy_processes(), results)
    print(f"wrote {args.output}")


def write_page(args, header: str, started: str, before: str, after: str, results: list[dict]) -> None:
    first = results[0]
    kinds = ["products", "char CNN convolution", "elementwise and casts", "other operations"]
    lines = ["# Where the embedding time goes (`bench/profile_embed.py`)", "", header,
             f"Run of {started}; `original` shape (random weights), batch {args.batch_size}, token cache off, the "
             f"first {first['sentences']:,} UD English EWT dev sentences ({first['tokens']:,} tokens), each dtype in "
             f"its own process, warmed up by one run first." + (f" {args.note}" if args.note else ""), "",
             f"Machine load: before, {before}. After, {after}.", "",
             "Each operation's own time on the main thread (parallel regions included), by kind; 'between "
             "operations' is the wall time under the profiler minus the operations' own time (Python, dispatch, "
             "the profiler's own cost); 'wall, no profiler' is the same run without it.", "",
             "| dtype | wall, no profiler (s) | wall, profiled (s) | operations | "
             + " | ".join(kinds) + " | between operations |",
             "|---|---:|---:|---:|" + "---:|" * (len(kinds) + 1)]
    for result in results:
        wall = result["wall"]
        seconds = [result["kinds"].get(kind, 0.0) for kind in kinds]
        cells = [f"{value:.2f} ({value / wall:.0%})" for value in seconds]
        between = wall - sum(result["kinds"].values())
        lines.append(f"| {result['dtype']} | {result['unprofiled']:.2f} | {wall:.2f} | {result['calls']:,} | "
                     + " | ".join(cells) + f" | {between:.2f} ({between / wall:.0%}) |")
    for result in results:
        lines += ["", f"## {result['dtype']}: the operations that took the most", "",
                  "| operation | input shapes | calls | own time (s) | of wall |", "|---|---|---:|---:|---:|"]
        lines += [f"| {op['name']} | `{op['shapes']}` | {op['calls']:,} | {op['seconds']:.3f} | "
                  f"{op['seconds'] / result['wall']:.1%} |" for op in result["ops"]]
    replace_page(args.output, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
