"""The driver's peak memory of `elmo embed --ray` as the corpus grows past Ray's object store.

    .venv/bin/python bench/ray_memory.py                       # -> bench/results/ray-memory.md
    .venv/bin/python bench/ray_memory.py --sizes-mb 5 20 --label after
    .venv/bin/python bench/ray_memory.py --label before --src /tmp/before/src      # an older tree's elmokit
                                                                  # (a git worktree: its commit is named)

Each size runs in a process of its own (`--one MB`): it writes a text corpus of that many MB
(random words, lines of 3 to 12 tokens), starts a local Ray instance with a small object store
(`--object-store-mb`, default 100) and 2 CPUs, and calls `elmokit.ray.embed_files` with one actor
and a tiny random model (`--sentence-vectors`, so that the output stays small), while a thread
samples the driver's resident memory (psutil) every 0.1 s. The page gives, per size, the
driver's RSS before the run, its peak during it, the growth, and the seconds; a driver that
reads the corpus itself grows with it, one that leaves the reading to Ray's read tasks stays flat.
A label names the tree measured (`--label`); the rows of each label are kept in the page.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# This file is bench/ray_memory.py: its folder leaves the import path, so that `import ray` is Ray.
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]
REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "ray-memory.md"


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """Random lines of 3 to 12 words from a vocabulary of 2,000, `megabytes` of them: the lines written."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = np.array([f"w{i}" for i in range(2000)])
    target, written, lines = int(megabytes * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            chunk = "".join(" ".join(words[rng.integers(0, 2000, rng.integers(3, 13))]) + "\n" for _ in range(10_000))
            out.write(chunk)
            written, lines = written + len(chunk), lines + 10_000
    return lines


def tiny_model():
    """A random biLM of a few thousand parameters: the model's cost is not what is measured."""
    import torch

    from elmokit.model.bilm import BiLM
    from elmokit.model.config import CharCNNConfig, ElmoConfig, LSTMConfig

    torch.manual_seed(0)
    char_cnn = CharCNNConfig(embedding_dim=4, filters=((1, 4), (2, 4)), n_highway=1)
    return BiLM(ElmoConfig(char_cnn=char_cnn, lstm=LSTMConfig(cell_dim=8, projection_dim=6, n_layers=2))).eval()


class DriverPeak:
    """The largest RSS of this process, sampled every 0.1 s in a thread while in the block."""

    def __init__(self):
        import psutil

        self.process, self.peak = psutil.Process(), 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.1)

    def __enter__(self) -> DriverPeak:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def one(megabytes: float, object_store_mb: int) -> dict:
    """One size in this process: {"mb", "lines", "rss_before_mb", "peak_mb", "seconds", "rows"}."""
    import psutil
    import ray

    import elmokit.ray

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    with tempfile.TemporaryDirectory(prefix="ray-memory-") as folder:
        source = Path(folder) / "corpus.txt"
        lines = write_corpus(source, megabytes)
        model = tiny_model()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 object_store_memory=object_store_mb * 1_000_000)
        ray.data.DataContext.get_current().enable_progress_bars = False
        before = psutil.Process().memory_info().rss
        started = time.perf_counter()
        with DriverPeak() as peak:
            summary = elmokit.ray.embed_files([source], Path(folder) / "out", workers=1, model=model,
                                              layers="top", sentence_vectors=True, progress=False)
        seconds = time.perf_counter() - started
        ray.shutdown()
    return {"mb": megabytes, "lines": lines, "rss_before_mb": before / 1e6, "peak_mb": peak.peak / 1e6,
            "seconds": seconds, "rows": summary["rows"]}


def _bench_machine():
    spec = importlib.util.spec_from_file_location("bench_machine", REPO / "bench" / "machine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def render(runs: dict[str, dict], object_store_mb: int, header: str) -> str:
    """The page: a row per label and size; under the table, each label's run (the tree's commit, when,
    and what else ran)."""
    table = ["| tree | corpus (MB) | lines | driver RSS before (MB) | driver peak RSS (MB) | growth (MB) | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, run in runs.items():
        for row in run["rows"]:
            table.append(f"| {label} | {row['mb']:g} | {row['lines']:,} | {row['rss_before_mb']:,.0f} | "
                         f"{row['peak_mb']:,.0f} | {row['peak_mb'] - row['rss_before_mb']:+,.0f} | "
                         f"{row['seconds']:,.1f} |")
    return (f"# The driver's memory of `elmo embed --ray` as the corpus grows\n\n{header}\n\n"
            f"`bench/ray_memory.py`: each size in a fresh process, a local Ray instance of 2 CPUs with an "
            f"object store of {object_store_mb} MB, one actor, a tiny random model, `--top --sentence-vectors`; "
            f"the driver's RSS sampled every 0.1 s (psutil).\n\n" + "\n".join(table) +
            f"\n\n<!-- runs: {json.dumps(runs)} -->\n\n" +
            "".join(f"* '{label}': elmokit at {run['commit']}, run {run['when']}; what else ran: {run['busy']}\n"
                    for label, run in runs.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[20, 100, 400])
    parser.add_argument("--object-store-mb", type=int, default=100)
    parser.add_argument("--label", default="after", help="the tree measured, a row label (before, after)")
    parser.add_argument("--src", type=Path, help="the src/ folder of the elmokit tree to measure (default: this one)")
    parser.add_argument("--one", type=float, help=argparse.SUPPRESS)  # one size, in this process
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.object_store_mb)))
        return
    machine = _bench_machine()
    kept = {}
    if RESULTS.exists() and "<!-- runs: " in RESULTS.read_text():
        kept = json.loads(RESULTS.read_text().split("<!-- runs: ", 1)[1].split(" -->", 1)[0])
    tree = args.src.resolve().parent if args.src else REPO
    try:  # a tree with uncommitted changes is named as such ("-dirty")
        commit = subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True,
                                text=True, check=False).stdout.strip() or "a tree outside git"
    except OSError:
        commit = "a tree of unknown commit (no git)"
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    busy_before = machine.busy_processes(own="bench/ray_memory.py")
    rows = []
    for size in args.sizes_mb:
        env = dict(os.environ, PYTHONPATH=str(args.src.resolve())) if args.src else None  # only the measured process
        done = subprocess.run([sys.executable, __file__, "--one", str(size), "--object-store-mb",
                               str(args.object_store_mb)], capture_output=True, text=True, check=False, env=env)
        if done.returncode != 0:
            raise SystemExit(f"size {size} MB failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    busy = f"before, {busy_before}; after, {machine.busy_processes(own='bench/ray_memory.py')}"
    kept[args.label] = {"rows": rows, "commit": commit, "when": f"{started} to "
                        f"{time.strftime('%H:%M UTC', time.gmtime())}", "busy": busy}
    page = render(kept, args.object_store_mb, machine.page_header("cpu", 2))
    machine.replace_page(RESULTS, page)
    print(page)


if __name__ == "__main__":
    main()
