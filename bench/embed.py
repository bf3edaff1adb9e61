"""Embedding speed and memory: tokens/s, peak RSS and the fraction of this machine's fp32 matmul
roofline, for the `small` and `original` shapes (random weights made by elmokit) on the 2,001
sentences of UD English EWT dev, at batch 32 and batch 1.

    .venv/bin/python bench/embed.py                     # full table -> bench/results/embed.md
    .venv/bin/python bench/embed.py --shapes small --batch-sizes 32 --limit 500

Each configuration runs in its own process so that its peak RSS is its own. FLOPs per biLM
position follow spec §12 (multiply-add = 2 FLOPs); positions = tokens + 2 per sentence.
"Batch B" is `ElmoEmbedder.embed_sentences(sentences, batch_size=B)`: B sentences in the
recurrence at a time, each new sentence taking the row the last one freed (`embed_many`).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
UD_DEV = REPO.parent / "shared" / "data" / "ud-english-ewt" / "en_ewt-ud-dev.conllu"


def read_conllu_forms(path: Path) -> list[list[str]]:
    """Word forms of each sentence (multiword-token ranges and empty nodes skipped)."""
    sentences, current = [], []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.rstrip("\n")
            if not line:
                if current:
                    sentences.append(current)
                current = []
            elif not line.startswith("#"):
                columns = line.split("\t")
                if columns[0].isdigit():
                    current.append(columns[1])
    if current:
        sentences.append(current)
    return sentences


def flops_per_position(config) -> dict[str, float]:
    """Spec §12: FLOPs of each part for one biLM position."""
    cnn, lstm = config.char_cnn, config.lstm
    conv = sum((50 - width + 1) * width * cnn.embedding_dim * count for width, count in cnn.filters)
    highway = cnn.n_highway * 2 * cnn.n_filters ** 2
    projection = cnn.n_filters * lstm.projection_dim
    recurrent = 2 * lstm.n_layers * 9 * lstm.projection_dim * lstm.cell_dim
    return {"encoder": 2.0 * (conv + highway + projection), "lstm": 2.0 * recurrent}


def matmul_gflops(threads: int, size: int = 2048, repeats: int = 10, trials: int = 8) -> dict[str, float]:
    """The machine's sustained fp32 matmul throughput through each of torch's CPU kernels: MKL
    (`torch.mm`, what a plain product runs) and oneDNN (what `elmokit.kernels` runs without
    gradients); the best of `trials` timings of `repeats` (size x size) products, after the first
    trials have warmed the cores up. The roofline is the larger of the two."""
    from elmokit.kernels import ONEDNN, linear

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    kernels = {"mkl": lambda: a @ b}
    if ONEDNN:
        kernels["onednn"] = lambda: linear(a, b)  # no gradients here: oneDNN's kernel
    results = {}
    for name, product in kernels.items():
        best = 0.0
        for _ in range(trials):
            start = time.perf_counter()
            for _ in range(repeats):
                product()
            best = max(best, 2 * size ** 3 * repeats / (time.perf_counter() - start) / 1e9)
        results[name] = best
    return results


def recurrent_product_gflops(shape: str, rows: int, threads: int, repeats: int = 20, trials: int = 5) -> float:
    """The ceiling of the LSTM step: GFLOP/s of its two products at `rows` rows alone, (R, P) x
    (P, 4C) and (R, C) x (C, P) for both directions, through the kernels the model uses
    (`elmokit.kernels`). The recurrent part of every position (5PC of the LSTM's 9PC
    multiply-adds) can run no faster than this."""
    from elmokit import ElmoConfig
    from elmokit.kernels import PackedLinear

    torch.set_num_threads(threads)
    lstm = ElmoConfig.from_name(shape).lstm
    recurrent_weight = torch.randn(2, 4 * lstm.cell_dim, lstm.projection_dim)
    projection = torch.randn(2, lstm.projection_dim, lstm.cell_dim)
    hidden, cell = torch.randn(2, rows, lstm.projection_dim), torch.randn(2, rows, lstm.cell_dim)
    gate_inputs = torch.randn(2, rows, 4 * lstm.cell_dim)
    with torch.no_grad():
        products = [(PackedLinear(recurrent_weight[d], rows), PackedLinear(projection[d], rows)) for d in range(2)]
        best = 0.0
        for _ in range(trials):
            start = time.perf_counter()
            for _ in range(repeats):
                for d, (recurrent, project) in enumerate(products):
                    recurrent.add(gate_inputs[d], hidden[d])
                    project(cell[d])
            seconds = time.perf_counter() - start
            best = max(best, repeats * 2 * 2 * rows * 5 * lstm.projection_dim * lstm.cell_dim / seconds / 1e9)
    return best


def run_one(shape: str, batch_size: int, cache: bool, limit: int | None, threads: int) -> dict:
    """One configuration, in this process: returns its measurements."""
    from elmokit import BiLM, ElmoConfig, ElmoEmbedder

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = ElmoConfig.from_name(shape)
    embedder = ElmoEmbedder(module=BiLM(config), cache_tokens=cache)
    sentences = read_conllu_forms(UD_DEV)[:limit]
    list(embedder.embed_sentences(sentences[:batch_size], batch_size))  # warm up: kernels, packed weights (not the cache)
    if embedder.cache is not None:
        embedder.cache.clear()
    n_tokens = sum(map(len, sentences))
    n_positions = n_tokens + 2 * len(sentences)
    start = time.perf_counter()
    for _ in embedder.embed_sentences(sentences, batch_size=batch_size):
        pass
    seconds = time.perf_counter() - start
    flops = flops_per_position(config)
    encoded = len(embedder.cache.index) if embedder.cache is not None else n_positions
    executed = flops["lstm"] * n_positions + flops["encoder"] * encoded
    return {
        "shape": shape, "batch_size": batch_size, "cache": cache, "sentences": len(sentences),
        "tokens": n_tokens, "seconds": seconds, "tokens_per_s": n_tokens / seconds,
        "model_gflops": (flops["lstm"] + flops["encoder"]) * n_positions / seconds / 1e9,
        "executed_gflops": executed / seconds / 1e9,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["small", "original"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[32, 1])
    parser.add_argument("--limit", type=int, default=None, help="first N sentences only (default: all 2,001)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "embed.md")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: JSON of one configuration
    args = parser.parse_args()
    if args.one:
        spec = json.loads(args.one)
        print(json.dumps(run_one(**spec)))
        return
    if not UD_DEV.is_file():
        sys.exit(f"needs {UD_DEV} (the shared data folder beside the repo)")

    kernels = matmul_gflops(args.threads)
    roofline = max(kernels.values())
    print(f"fp32 matmul roofline: {roofline:.1f} GFLOP/s (best of 8 timings, 2048x2048, {args.threads} threads; "
          + ", ".join(f"{name} {gflops:.1f}" for name, gflops in kernels.items()) + ")", flush=True)
    ceilings = {(shape, batch_size): recurrent_product_gflops(shape, batch_size, args.threads)
                for shape in args.shapes for batch_size in args.batch_sizes}
    for (shape, batch_size), gflops in ceilings.items():
        print(f"{shape:9s} batch {batch_size:3d} recurrent products alone: {gflops:6.1f} GFLOP/s "
              f"({gflops / roofline:5.1%} of roofline)", flush=True)
    rows = []
    for shape in args.shapes:
        for batch_size in args.batch_sizes:
            for cache in (False, True):
                spec = {"shape": shape, "batch_size": batch_size, "cache": cache,
                        "limit": args.limit, "threads": args.threads}
                result = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)],
                                        capture_output=True, text=True, check=True)
                row = json.loads(result.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"{shape:9s} batch {batch_size:3d} cache {str(cache):5s} "
                      f"{row['tokens_per_s']:9.0f} tokens/s  {row['executed_gflops']:6.1f} GFLOP/s executed "
                      f"({row['executed_gflops'] / roofline:5.1%} of roofline)  peak RSS {row['peak_rss_mb']:.0f} MB",
                      flush=True)

    for name, gflops in matmul_gflops(args.threads).items():  # again at the end: the best sustained figure
        kernels[name] = max(kernels[name], gflops)
    roofline = max(kernels.values())
    lines = [
        "# Embedding benchmark (`bench/embed.py`)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}. "
        f"fp32 matmul roofline measured in the same run (2048x2048, the best of torch's CPU kernels: "
        + ", ".join(f"{name} {gflops:.1f}" for name, gflops in kernels.items()) + f"): **{roofline:.1f} GFLOP/s**.",
        f"Data: UD English EWT dev, {rows[0]['sentences']} sentences, {rows[0]['tokens']} tokens; random weights.",
        "'executed' counts the FLOPs actually run (spec §12 per position; with the cache, the token encoder "
        "runs once per distinct word); 'model' counts the full model per position.",
        "",
        "| shape | batch | token cache | tokens/s | executed GFLOP/s | of roofline | model GFLOP/s | peak RSS (MB) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row['shape']} | {row['batch_size']} | {'on' if row['cache'] else 'off'} | "
                     f"{row['tokens_per_s']:,.0f} | {row['executed_gflops']:.1f} | "
                     f"{row['executed_gflops'] / roofline:.1%} | {row['model_gflops']:.1f} | {row['peak_rss_mb']:,.0f} |")
    lines += [
        "",
        "The ceiling: the LSTM step's two products alone (`(R, P) x (P, 4C)` and `(R, C) x (C, P)`, both "
        "directions, R = batch rows, the kernels the model uses), measured in the same run. The recurrent "
        "5PC of the LSTM's 9PC multiply-adds per position cannot run faster than this.",
        "",
        "| shape | batch (rows) | recurrent products GFLOP/s | of roofline |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {shape} | {batch_size} | {gflops:.1f} | {gflops / roofline:.1%} |"
              for (shape, batch_size), gflops in ceilings.items()]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
