"""ONNX export speed (issue 35): onnxruntime (CPU, 2 threads) against elmokit and against plain
PyTorch eager on the same batches in the same run, for the built-in model and the `original`
shape (random weights made by elmokit), with the graph's size, export time and load time, and
onnxruntime's largest difference from elmokit on every batch it ran.

    .venv/bin/python bench/onnx.py                       # -> bench/results/onnx.md (and onnx.json)
    .venv/bin/python bench/onnx.py --shapes builtin --limit 64 --output /tmp/o.md
    .venv/bin/python bench/onnx.py --from-json bench/results/onnx.json    # the page again from the record

Engines, each on the same batches of consecutive sentences of UD English EWT dev:
    onnxruntime       the exported graph (`elmo convert --to-onnx`), `onnx_session(threads=N)`
                      (spinning off: its threads sleep between operators, as a shared machine wants)
    onnxruntime, length-sorted batches
                      the same sentences, sorted by length before they are cut into batches: what
                      padding costs the graph (every row runs for the longest row's steps)
    elmokit           `ElmoEmbedder.batch_to_embeddings` (stream engine, oneDNN, token cache on)
    elmokit, no cache the same with `cache_tokens=False`
    PyTorch eager     the module that is exported (`ExportableBiLM`), run by torch eagerly with the
                      plain products (ELMOKIT_KERNELS=torch): the same computation as the graph
Every engine runs every batch size at each of --threads (default 1 and 2: torch's threads, or
onnxruntime's intra-op threads), --repeats times, the engines interleaved, the fastest kept. Both
counts because on this 2-core machine shared with other jobs torch's OpenMP threads wait for each
other when a core is taken (its 2-thread figures can fall below its 1-thread ones); the target
compares onnxruntime at 2 threads with elmokit at its faster count. The load average and the other
busy processes are recorded before and after.
Run it under `flock /tmp/bench.lock` when others benchmark on the same machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# `python bench/onnx.py` puts bench/ first on sys.path, where this file would pass for the onnx package
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
SORTED = "onnxruntime, length-sorted batches"  # the same sentences grouped by length: what padding costs the graph
ENGINES = ("onnxruntime", "elmokit", "elmokit, no cache", "PyTorch eager", SORTED)
TARGET = 0.8  # onnxruntime's tokens/s at batch 32 over elmokit's (issue 35)


def _bench_module(name: str, as_name: str):
    """bench/NAME.py as a module (bench/ is off sys.path here), registered as `as_name`."""
    if as_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(as_name, REPO / "bench" / f"{name}.py")
        sys.modules[as_name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[as_name])
    return sys.modules[as_name]


def _embed_bench():
    """bench/embed.py as a module (its UD reader), bench/machine.py first: embed.py imports it, and
    its machine header and busy-process line are the page's."""
    _bench_module("machine", "machine")
    return _bench_module("embed", "bench_embed")


def make_model(shape: str):
    from elmokit import BiLM, ElmoConfig, load_model

    if shape == "builtin":
        return load_model(None)
    torch.manual_seed(0)
    return BiLM(ElmoConfig.from_name(shape)).eval()


def engines(bilm, path: Path, thread_counts: list[int]) -> dict:
    """name -> (function(batch of token lists) -> (layers (B, L+1, T, 2P), mask) as numpy, a function
    run before each timed pass: the token cache emptied, as each pass starts cold)."""
    import copy

    from elmokit import ElmoEmbedder, batch_to_ids
    from elmokit.inference.onnx_export import ExportableBiLM, onnx_session

    sessions = {threads: onnx_session(path, threads=threads) for threads in thread_counts}
    cached, uncached = ElmoEmbedder(module=copy.deepcopy(bilm)), ElmoEmbedder(module=copy.deepcopy(bilm), cache_tokens=False)
    eager = ExportableBiLM(copy.deepcopy(bilm).eval().requires_grad_(False)).eval()

    def run_eager(batch):
        previous = os.environ.get("ELMOKIT_KERNELS")
        os.environ["ELMOKIT_KERNELS"] = "torch"
        try:
            with torch.no_grad():
                layers, mask = eager(batch_to_ids(batch))
        finally:
            os.environ.pop("ELMOKIT_KERNELS") if previous is None else os.environ.__setitem__("ELMOKIT_KERNELS", previous)
        return layers.numpy(), mask.numpy()

    def run_embedder(embedder):
        def run(batch):
            layers, mask = embedder.batch_to_embeddings(batch)
            return layers.numpy(), mask.numpy()
        return run

    nothing = lambda: None  # noqa: E731
    def run_onnx(batch):
        return tuple(sessions[torch.get_num_threads()].run(None, {"char_ids": batch_to_ids(batch).numpy()}))

    return {"onnxruntime": (run_onnx, nothing), SORTED: (run_onnx, nothing),
            "elmokit": (run_embedder(cached), cached.cache.clear), "elmokit, no cache": (run_embedder(uncached), nothing),
            "PyTorch eager": (run_eager, nothing)}


def time_engine(run, reset, batches) -> dict:
    reset()
    start, start_cpu = time.perf_counter(), time.process_time()
    outputs = [run(batch) for batch in batches]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    tokens = sum(map(len, (s for batch in batches for s in batch)))
    return {"tokens_per_s": tokens / seconds, "tokens_per_cpu_s": tokens / cpu_seconds, "outputs": outputs}


def bench_shape(shape: str, sentences: list, batch_sizes: list[int], limit_batch1: int, thread_counts: list[int],
                repeats: int, directory: Path) -> dict:
    from elmokit.inference.onnx_export import export_onnx, onnx_session

    bilm = make_model(shape)
    path = directory / f"{shape}.onnx"
    start = time.perf_counter()
    checked = export_onnx(bilm, path)
    export_seconds = time.perf_counter() - start
    loads = []
    for _ in range(3):
        start = time.perf_counter()
        onnx_session(path, threads=max(thread_counts))
        loads.append(time.perf_counter() - start)
    runs = engines(bilm, path, thread_counts)
    rows, differences, padding, padding_sorted = {}, {}, {}, {}
    for batch_size in batch_sizes:
        chosen = sentences[:limit_batch1] if batch_size == 1 else sentences
        batches = [chosen[i:i + batch_size] for i in range(0, len(chosen), batch_size)]
        by_length = sorted(chosen, key=len)
        sorted_batches = [by_length[i:i + batch_size] for i in range(0, len(by_length), batch_size)]
        positions = sum(len(batch) * (max(map(len, batch)) + 2) for batch in batches)
        padding[batch_size] = positions / sum(len(s) + 2 for s in chosen)  # graph positions / real positions
        padding_sorted[batch_size] = (sum(len(batch) * (max(map(len, batch)) + 2) for batch in sorted_batches)
                                      / sum(len(s) + 2 for s in chosen))
        for threads in thread_counts:  # warm up: kernels, packed weights, first-run allocations
            torch.set_num_threads(threads)
            for name in ENGINES:
                runs[name][0](batches[0])
        for _ in range(repeats):
            for threads in thread_counts:
                torch.set_num_threads(threads)
                for name in ENGINES:
                    result = time_engine(*runs[name], sorted_batches if name == SORTED else batches)
                    outputs = result.pop("outputs")
                    if name == "elmokit" and "reference" not in differences.get(batch_size, {}):
                        differences.setdefault(batch_size, {})["reference"] = outputs
                    if name == "onnxruntime":
                        differences.setdefault(batch_size, {})["onnx"] = outputs
                    best = rows.get((batch_size, name, threads))
                    if best is None or result["tokens_per_s"] > best["tokens_per_s"]:
                        rows[(batch_size, name, threads)] = result
                    print(f"{shape:9s} batch {batch_size:3d} {name:18s} {threads} threads "
                          f"{result['tokens_per_s']:9.1f} tokens/s", flush=True)
    worst = {}
    for batch_size, pair in differences.items():
        worst[batch_size] = max(float(np.abs(a[0] - b[0]).max()) if a[0].size else 0.0
                                for a, b in zip(pair["onnx"], pair["reference"]))
        assert all(np.array_equal(a[1], b[1]) for a, b in zip(pair["onnx"], pair["reference"])), "masks differ"
    return {"shape": shape, "config": bilm.config.to_dict(), "bytes": path.stat().st_size,
            "sentences": len(sentences), "tokens": sum(map(len, sentences)), "limit_batch1": limit_batch1,
            "export_seconds": export_seconds, "check_max_abs_diff": checked["max_abs_diff"],
            "load_seconds": min(loads), "padding": padding, "padding_sorted": padding_sorted,
            "max_abs_diff": worst,
            "rows": [{"batch_size": b, "engine": name, "threads": t, **row} for (b, name, t), row in rows.items()]}


def _rows(shape: dict) -> dict:
    return {(row["batch_size"], row["engine"], row["threads"]): row for row in shape["rows"]}


def best_elmokit(shape: dict, batch_size: int, threads: list[int]) -> dict:
    """elmokit's (token cache on) fastest row at this batch over the thread counts."""
    rows = _rows(shape)
    return max((rows[(batch_size, "elmokit", t)] | {"threads": t} for t in threads), key=lambda row: row["tokens_per_s"])


def summary_rows(record: dict) -> list[str]:
    """One row a shape and batch: onnxruntime at the larger thread count against the others' best."""
    threads, lines = record["threads"], []
    for shape in record["shapes"]:
        rows = _rows(shape)
        for batch_size in record["batch_sizes"]:
            onnx = rows[(batch_size, "onnxruntime", max(threads))]["tokens_per_s"]
            by_length = rows[(batch_size, SORTED, max(threads))]["tokens_per_s"]
            elmokit = best_elmokit(shape, batch_size, threads)["tokens_per_s"]
            eager = max(rows[(batch_size, "PyTorch eager", t)]["tokens_per_s"] for t in threads)
            lines.append(f"| {shape['shape']} | {batch_size} | {onnx:,.0f} | {elmokit:,.0f} | {onnx / elmokit:.2f} | "
                         f"{by_length / elmokit:.2f} | {onnx / eager:.2f} | {shape['max_abs_diff'][str(batch_size)]:.1e} |")
    return lines


def write_report(output: Path, record: dict) -> None:
    threads = record["threads"]
    lines = [
        "# ONNX export benchmark (`bench/onnx.py`)", "",
        record.get("header") or f"Machine: {record['machine']}.",  # a record older than bench/machine.py: no rooflines
        f"Run of {record['started']}; torch's threads and onnxruntime's intra-op threads "
        f"{' and '.join(map(str, record['threads']))} (the table's column); onnxruntime {record['onnxruntime']} "
        "(CPU execution provider, spinning off). "
        f"Data: UD English EWT dev, the first sentences in order, in consecutive batches: "
        + "; ".join(f"`{shape['shape']}` {shape['sentences']} sentences ({shape['tokens']:,} tokens), at batch 1 the "
                    f"first {shape['limit_batch1']}" for shape in record["shapes"])
        + "; random weights for "
        f"`original` (seed 0); {record['repeats']} run(s) of each engine and thread count, interleaved, the fastest kept.",
        "",
        f"Machine load: before, {record['load_before']}. After, {record['load_after']}.",
        "",
        "Engines: `onnxruntime` runs the graph that `elmo convert --to-onnx` writes; `elmokit` is "
        "`ElmoEmbedder.batch_to_embeddings` (token cache on, the default), `elmokit, no cache` the same with "
        "`cache_tokens=False`; `PyTorch eager` is the module that is exported, run by torch (plain products); "
        "`onnxruntime, length-sorted batches` runs the same sentences sorted by length before batching (other "
        "batches: what padding costs the graph). "
        "'x elmokit' is the row's tokens/s over elmokit's fastest (cache on, the better of its thread counts) on "
        "the same batches; 'tokens / CPU s' divides by the process's CPU time (on a shared machine the steadier figure).",
        "",
        "In short: onnxruntime at the larger thread count against elmokit's fastest (token cache on, the better "
        "of its thread counts) and PyTorch eager's fastest, in the data's order and with the sentences sorted "
        "by length before batching; the largest |onnxruntime - elmokit| of the timed batches.",
        "",
        f"| shape | batch | onnxruntime ({max(threads)} threads) tokens/s | elmokit tokens/s | x elmokit | "
        "x elmokit, length-sorted batches "
        "| x PyTorch eager | max abs diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *summary_rows(record),
        "",
        "Every engine and thread count:",
        "",
        "| shape | batch | engine | threads | tokens/s | x elmokit | tokens / CPU s |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for shape in record["shapes"]:
        rows = _rows(shape)
        for batch_size in record["batch_sizes"]:
            base = best_elmokit(shape, batch_size, threads)["tokens_per_s"]
            for name in ENGINES:
                for count in threads:
                    row = rows[(batch_size, name, count)]
                    lines.append(f"| {shape['shape']} | {batch_size} | {name} | {count} | {row['tokens_per_s']:,.0f} | "
                                 f"{row['tokens_per_s'] / base:.2f} | {row['tokens_per_cpu_s']:,.0f} |")
    lines += [
        "", "The graph, and onnxruntime against elmokit: the largest |difference| of any value of `layers` over "
        "every batch of the timed runs (the masks are equal), and of the check on writing.", "",
        "| shape | graph size (MB) | export and check (s) | session load (s) | max abs diff, check on writing | "
        + " | ".join(f"max abs diff, batch {b}" for b in record["batch_sizes"]) + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(record["batch_sizes"]),
    ]
    for shape in record["shapes"]:
        lines.append(f"| {shape['shape']} | {shape['bytes'] / 1e6:.1f} | {shape['export_seconds']:.1f} | "
                     f"{shape['load_seconds']:.2f} | {shape['check_max_abs_diff']:.1e} | "
                     + " | ".join(f"{shape['max_abs_diff'][str(b)]:.1e}" for b in record["batch_sizes"]) + " |")
    lines += ["", "## Reading (written by the script from the figures above)", ""]
    onnx_threads = max(threads)
    for shape in record["shapes"]:
        rows = _rows(shape)
        for batch_size in record["batch_sizes"]:
            onnx = rows[(batch_size, "onnxruntime", onnx_threads)]["tokens_per_s"]
            elmokit = best_elmokit(shape, batch_size, threads)
            eager = max(rows[(batch_size, "PyTorch eager", t)]["tokens_per_s"] for t in threads)
            padding = shape["padding"][str(batch_size)]
            by_length = rows[(batch_size, SORTED, onnx_threads)]["tokens_per_s"]
            line = (f"* `{shape['shape']}`, batch {batch_size}: onnxruntime at {onnx_threads} threads runs "
                    f"{onnx / elmokit['tokens_per_s']:.2f}x elmokit's tokens/s (elmokit at its faster count, "
                    f"{elmokit['threads']}) and {onnx / eager:.2f}x PyTorch eager's; the graph runs every row for the "
                    f"longest sentence's steps, {padding:.2f} positions for each real one (elmokit's stream engine "
                    "runs only the real ones, and its token cache encodes each word once).")
            if batch_size > 1:
                line += (f" With the same sentences sorted by length before batching, onnxruntime runs "
                         f"{by_length / elmokit['tokens_per_s']:.2f}x elmokit's tokens/s "
                         f"({shape['padding_sorted'][str(batch_size)]:.2f} positions for each real one).")
            if batch_size == 32:
                met = "met" if onnx >= TARGET * elmokit["tokens_per_s"] else "not met"
                line += f" Target (>= {TARGET}x elmokit at batch 32): {met}."
            lines.append(line)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["builtin", "original"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[32, 1])
    parser.add_argument("--limit", type=int, default=192, help="sentences of UD EWT dev (default 192)")
    parser.add_argument("--limit-batch1", type=int, default=32, help="sentences run at batch 1 (default 32)")
    parser.add_argument("--original-fraction", type=float, default=0.34,
                        help="the share of --limit and --limit-batch1 the `original` shape runs (default 0.34: "
                             "~10x the work a token)")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "onnx.md")
    parser.add_argument("--from-json", type=Path, help="write the page from a recorded run (its onnx.json), running nothing")
    args = parser.parse_args()
    if args.from_json:
        write_report(args.output, json.loads(args.from_json.read_text(encoding="utf-8")))
        print(f"wrote {args.output}")
        return
    import onnxruntime

    embed_bench = _embed_bench()
    sentences = embed_bench.read_conllu_forms(embed_bench.UD_DEV)[:args.limit]
    record = {"started": time.strftime("%Y-%m-%d %H:%M"), "header": embed_bench.page_header("cpu", max(args.threads)),
              "onnxruntime": onnxruntime.__version__, "threads": args.threads, "sentences": len(sentences),
              "tokens": sum(map(len, sentences)), "limit_batch1": args.limit_batch1, "repeats": args.repeats,
              "batch_sizes": args.batch_sizes, "load_before": embed_bench.busy_processes()}
    with tempfile.TemporaryDirectory() as directory:
        record["shapes"] = []
        for shape in args.shapes:
            share = args.original_fraction if shape == "original" else 1.0
            chosen = sentences[:max(1, round(share * len(sentences)))]
            record["shapes"].append(bench_shape(shape, chosen, args.batch_sizes, max(1, round(share * args.limit_batch1)),
                                                args.threads, args.repeats, Path(directory)))
    record["load_after"] = embed_bench.busy_processes()
    record = json.loads(json.dumps(record))  # the batch sizes as the JSON record has them (str keys)
    args.output.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    write_report(args.output, record)
    print(f"wrote {args.output} and {args.output.with_suffix('.json')}")


if __name__ == "__main__":
    main()
