"""Peak memory of `elmo embed` against the input size: it streams, so the peak should not grow
with the number of tokens.

    .venv/bin/python bench/embed_memory.py                       # 100k and 1M tokens -> bench/results/embed_memory.md
    .venv/bin/python bench/embed_memory.py --tokens 20000 100000 --format all

Inputs: the first lines of the shared Gutenberg validation text (whitespace tokens) up to each
size; model: the built-in English model (`--model small` for the `small` preset with random
weights, saved with save_pretrained to a temporary directory, or any model directory).
Each run is its own `python -m elmokit embed` process, started by a small wrapper process whose
RUSAGE_CHILDREN peak RSS is therefore that run's alone.
"""

from __future__ import annotations

import argparse
import gzip
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GUTENBERG_VALID = REPO.parent / "shared" / "data" / "gutenberg-en" / "valid.txt.gz"
WRAPPER = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def write_input(path: Path, n_tokens: int) -> tuple[int, int]:
    """The first lines of the Gutenberg text holding `n_tokens` tokens (whitespace-normalised).
    Returns (sentences, tokens)."""
    sentences = tokens = 0
    with gzip.open(GUTENBERG_VALID, "rt", encoding="utf-8") as source, open(path, "w", encoding="utf-8") as out:
        while tokens < n_tokens:
            line = source.readline()
            if not line:
                raise SystemExit(f"{GUTENBERG_VALID} has fewer than {n_tokens} tokens")
            words = line.split()
            out.write(" ".join(words) + "\n")
            sentences, tokens = sentences + 1, tokens + len(words)
    return sentences, tokens


def resident_mb(pid: int) -> float | None:
    """The resident memory of process `pid` now (Linux /proc), None once it has gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def the_child(pid: int) -> int | None:
    """The one child process of `pid` (the wrapper's `elmo embed`), once it has started."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def measure(model_dir: Path, source: Path, output: Path, layers: str, threads: int
            ) -> tuple[float, float, list[float]]:
    """(peak RSS in MB, seconds, the largest RSS sampled in each quarter of the run) of one
    `elmo embed` run: flat quarters are memory that does not creep while streaming."""
    command = [sys.executable, "-m", "elmokit", "embed", str(source), str(output), f"--{layers}",
               "--model", str(model_dir), "--quiet", "--threads", str(threads), "--overwrite"]
    start = time.perf_counter()
    wrapper = subprocess.Popen([sys.executable, "-c", WRAPPER, *command], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    samples: list[tuple[float, float]] = []  # (seconds since start, RSS MB) of the embed process
    child = None
    while wrapper.poll() is None:
        child = child or the_child(wrapper.pid)
        rss = resident_mb(child) if child else None
        if rss is not None:
            samples.append((time.perf_counter() - start, rss))
        time.sleep(0.5)
    out, err = wrapper.communicate()
    seconds = time.perf_counter() - start
    if wrapper.returncode != 0:
        raise SystemExit(err)
    quarters = [max((rss for at, rss in samples if q * seconds / 4 <= at < (q + 1) * seconds / 4), default=0.0)
                for q in range(4)]
    return int(out.strip().splitlines()[-1]) / 1024, seconds, quarters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[100_000, 1_000_000], help="input sizes")
    parser.add_argument("--format", choices=["all", "top", "average"], default="top",
                        help="what to store (default: top; --all writes 3x the bytes)")
    parser.add_argument("--model", default="builtin",
                        help="builtin (default), a preset name with random weights, or a model directory")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the embed process")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "embed_memory.md")
    args = parser.parse_args()
    if not GUTENBERG_VALID.is_file():
        sys.exit(f"needs {GUTENBERG_VALID} (the shared data folder beside the repo)")
    from elmokit import BiLM, ElmoConfig, save_pretrained
    from elmokit.model.builtin import builtin_model_dir
    from machine import page_header  # bench/machine.py: the CPU, its flags, the rooflines

    header, load_before = page_header("cpu", args.threads), os.getloadavg()[0]  # before the runs

    rows = []
    with tempfile.TemporaryDirectory(prefix="embed-memory-") as tmp:
        work = Path(tmp)
        if args.model == "builtin":
            model_dir, model_name = builtin_model_dir(), "the built-in model (gutenberg-en)"
        elif Path(args.model).is_dir():
            model_dir, model_name = Path(args.model), f"`{args.model}`"
        else:
            torch.manual_seed(0)
            model_dir, model_name = work / "model", f"`{args.model}` preset, random weights"
            save_pretrained(BiLM(ElmoConfig.from_name(args.model)), model_dir)
        for n_tokens in args.tokens:
            source = work / f"in-{n_tokens}.txt"
            sentences, tokens = write_input(source, n_tokens)
            output = work / f"out-{n_tokens}.h5"
            peak_mb, seconds, quarters = measure(model_dir, source, output, args.format, args.threads)
            size_mb = output.stat().st_size / 2 ** 20
            rows.append((sentences, tokens, source.stat().st_size / 2 ** 20, size_mb, peak_mb, seconds, quarters))
            print(f"{tokens:>10,} tokens {sentences:>7,} sentences: peak RSS {peak_mb:7.0f} MB "
                  f"(by quarter: {' / '.join(f'{q:.0f}' for q in quarters)}), "
                  f"output {size_mb:7.0f} MB, {seconds:6.0f} s ({tokens / seconds:,.0f} tokens/s)", flush=True)
            output.unlink()

    lines = [
        "# Peak memory of `elmo embed` (`bench/embed_memory.py`)",
        "",
        header,
        f"Model: {model_name}. Input: the first lines "
        f"of Gutenberg valid.txt.gz (whitespace tokens), `--{args.format}`, HDF5, default batch 64, "
        "max-length 256. Peak RSS is that of the `elmo embed` process (RUSAGE_CHILDREN of a wrapper); "
        "by quarter: the largest RSS sampled (every 0.5 s) in each quarter of the run's time, so a creep "
        f"while streaming shows as a rising row. Load average at the start (what else ran): {load_before:.2f}.",
        "",
        "| sentences | tokens | input (MB) | output (MB) | peak RSS (MB) | RSS by quarter (MB) | seconds | tokens/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for sentences, tokens, input_mb, output_mb, peak_mb, seconds, quarters in rows:
        lines.append(f"| {sentences:,} | {tokens:,} | {input_mb:.1f} | {output_mb:,.0f} | {peak_mb:,.0f} | "
                     f"{' / '.join(f'{q:,.0f}' for q in quarters)} | {seconds:,.0f} | {tokens / seconds:,.0f} |")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
