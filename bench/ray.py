"""Tokens/s of `elmo embed` into Parquet in one process against Ray Data with 1 and 2 actors on
this machine, Ray's overhead, and the peak memory of each actor.

    .venv/bin/python bench/ray.py                     # -> bench/results/ray.md
    .venv/bin/python bench/ray.py --tokens 10000 --repeats 1 --model DIR

Input: the first lines of the shared Gutenberg validation text holding `--tokens` tokens;
model: the built-in English model (or `--model`); `--top`, float32, one torch thread per process
or actor (each actor asks Ray for 1 CPU). Timed, each from its start to its last file written:

- one process: `python -m elmokit embed INPUT OUT.parquet --top --threads 1` (a subprocess:
  Python's start, the model's load, the embedding, the Parquet file);
- Ray, N actors: `elmokit.ray.embed_files(INPUT, OUT_DIR, workers=N)` on a local Ray instance
  started once before (its start is reported, not counted: a cluster is already up): the
  driver's read, each actor's start and model load, the embedding, the Parquet files.

The three run in turn `--repeats` times and the fastest of each is kept (on a shared machine the
slower runs are the ones something else slowed down). Overhead = Ray with 1 actor's seconds / one
process's - 1. Peak memory: the largest resident set sampled every 0.2 s of each actor's process
(and of the one process), the largest over the repeats.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# This file is bench/ray.py: its folder leaves the import path, so that `import ray` is Ray.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]
REPO = Path(__file__).resolve().parents[1]
GUTENBERG_VALID = REPO.parent / "shared" / "data" / "gutenberg-en" / "valid.txt.gz"
RESULTS = REPO / "bench" / "results" / "ray.md"
ACTOR_NAME = "MapBatches(SentenceEmbedder)"


def _bench_machine():
    """bench/machine.py, for the page's header and the busy processes (one definition of them)."""
    spec = importlib.util.spec_from_file_location("bench_machine", REPO / "bench" / "machine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_input(path: Path, n_tokens: int) -> tuple[int, int]:
    """The first lines of the Gutenberg text holding `n_tokens` whitespace tokens: (lines, tokens)."""
    lines = tokens = 0
    with gzip.open(GUTENBERG_VALID, "rt", encoding="utf-8") as source, open(path, "w", encoding="utf-8") as out:
        for line in source:
            words = line.split()
            out.write(" ".join(words) + "\n")
            lines, tokens = lines + 1, tokens + len(words)
            if tokens >= n_tokens:
                return lines, tokens
    raise SystemExit(f"{GUTENBERG_VALID} has fewer than {n_tokens} tokens")


class PeakMemory:
    """Samples, every 0.2 s in a thread, the resident memory of processes chosen by `pick`
    (psutil.Process -> bool); `peaks` maps each pid seen to its largest RSS in MB."""

    def __init__(self, pick):
        import psutil

        self.psutil, self.pick, self.peaks = psutil, pick, {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            for process in self.psutil.process_iter(["pid", "name", "cmdline"]):
                try:
                    if self.pick(process):
                        rss = process.memory_info().rss / 2**20
                        self.peaks[process.pid] = max(self.peaks.get(process.pid, 0.0), rss)
                except (self.psutil.Error, OSError):
                    continue
            self.stop.wait(0.2)

    def __enter__(self) -> PeakMemory:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def one_process(source: Path, out: Path, model: str | None) -> dict:
    command = [sys.executable, "-m", "elmokit", "embed", str(source), str(out), "--top", "--threads", "1",
               "--no-progress", "--device", "cpu", *(["--model", model] if model else [])]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    with PeakMemory(lambda p: p.pid == process.pid) as memory:
        _, err = process.communicate()
    seconds = time.perf_counter() - started
    if process.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{err[-2000:]}")
    return {"seconds": seconds, "peaks": list(memory.peaks.values())}


def on_ray(source: Path, out: Path, model, workers: int) -> dict:
    from elmokit.ray import embed_files

    started, epoch = time.perf_counter(), time.time()

    def actor(process) -> bool:  # this run's actors (an earlier run's may not have exited yet)
        named = ACTOR_NAME in (process.info["name"] or "") or any(ACTOR_NAME in part for part in
                                                                  process.info["cmdline"] or [])
        return named and process.create_time() >= epoch - 1

    with PeakMemory(actor) as memory:
        summary = embed_files([source], out, address="local", workers=workers, model=model, layers="top",
                              progress=False)
    return {"seconds": time.perf_counter() - started, "peaks": sorted(memory.peaks.values()), **summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=60_000, help="input size (default: 60000 tokens)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, the fastest kept (default: 2)")
    parser.add_argument("--model", help="a model directory or name (default: the built-in model)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    bench = _bench_machine()
    header, before = bench.page_header("cpu", 1), bench.busy_processes()
    import ray
    import torch

    from elmokit import load_model

    torch.set_num_threads(1)
    model = load_model(args.model)  # sent to the actors, as elmo embed --ray does
    names = ["one process (`elmo embed OUT.parquet`)", "Ray Data, 1 actor (`elmo embed --ray`)",
             "Ray Data, 2 actors (`elmo embed --ray`)"]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as folder:
        folder = Path(folder)
        lines, tokens = write_input(folder / "input.txt", args.tokens)
        started = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200_000_000, log_to_driver=False)
        ray_start = time.perf_counter() - started
        try:
            for repeat in range(args.repeats):
                runs[names[0]].append(one_process(folder / "input.txt", folder / f"one{repeat}.parquet", args.model))
                for workers in (1, 2):
                    result = on_ray(folder / "input.txt", folder / f"ray{workers}-{repeat}", model, workers)
                    if (result["rows"], result["tokens"]) != (lines, tokens):
                        raise SystemExit(f"Ray with {workers} actors wrote {result['rows']} rows and "
                                         f"{result['tokens']} tokens, expected {lines} and {tokens}")
                    runs[names[workers]].append(result)
        finally:
            ray.shutdown()
    rows = [(name, {**min(results, key=lambda r: r["seconds"]), "all": [r["seconds"] for r in results],
                    "peaks": max((r["peaks"] for r in results), key=lambda peaks: max(peaks, default=0))})
            for name, results in runs.items()]
    after = bench.busy_processes()
    page = render(args, header, before, after, lines, tokens, ray_start, rows)
    args.output.write_text(page, encoding="utf-8")
    print(page)


def render(args, header: str, before: str, after: str, lines: int, tokens: int, ray_start: float,
           rows: list[tuple[str, dict]]) -> str:
    base = rows[0][1]["seconds"]
    table = ["| run | seconds (each run) | tokens/s | tokens/s per worker | vs one process | peak RSS per process (MB) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, result in rows:
        workers = 2 if "2 actors" in name else 1
        rate = tokens / result["seconds"]
        change = "—" if result is rows[0][1] else f"{result['seconds'] / base - 1:+.0%} time"
        peaks = " / ".join(f"{peak:,.0f}" for peak in result["peaks"]) or "not sampled"
        each = ", ".join(f"{seconds:.1f}" for seconds in result["all"])
        table.append(f"| {name} | {result['seconds']:.1f} ({each}) | {rate:,.0f} | {rate / workers:,.0f} | {change} | {peaks} |")
    overhead = rows[1][1]["seconds"] / base - 1
    spread = max(max(result["all"]) / min(result["all"]) - 1 for _, result in rows)
    command = "`.venv/bin/python bench/ray.py" + (f" --tokens {args.tokens}" if args.tokens != 60_000 else "") + \
              (f" --repeats {args.repeats}" if args.repeats != 2 else "") + \
              (f" --model {args.model}" if args.model else "") + "`"
    return f"""# Embedding on Ray Data against one process (`bench/ray.py`)

{header}
What else ran (the times include any other load on the machine): before the run,
{before}; after it, {after}.
Model: {args.model or "the built-in model (gutenberg-en)"}, `--top`, float32, one torch thread
per process or actor. Input: the first {lines:,} lines ({tokens:,} tokens) of Gutenberg
valid.txt.gz. Each time runs from the command's start to its last Parquet file (Python's and the
actors' start and the model's load included); the local Ray instance's own start
({ray_start:.1f} s) is not counted, as a cluster is up before a job. The three ran in turn
{args.repeats} time(s); the fastest of each is the row, every run's seconds in brackets.

{chr(10).join(table)}

Ray's overhead with 1 actor: {overhead:+.1%} of the one process's time (target: at most +15 %).
Between repeats, one configuration's time changed by up to {spread:.0%} (the machine's other jobs):
differences smaller than that are noise here, not Ray's.

Command: {command} (writes this page).
"""


if __name__ == "__main__":
    main()
