"""Embedding speed, memory and reduced-precision error: tokens/s, peak memory and the fraction of
this machine's matmul roofline and of each dtype's own ceiling (the LSTM step's products alone, at
the batch's rows), for the `small` and `original` shapes (random weights made by elmokit) on the
2,001 sentences of UD English EWT dev, at batch 32 and batch 1, in float32, bfloat16
(`ElmoEmbedder(dtype=torch.bfloat16)`) and int8 (`dtype="int8"`, where the CPU has VNNI or AMX);
and the error of bfloat16's and int8's vectors against float32's, per layer, for those shapes and
for the built-in (trained) model.

    .venv/bin/python bench/embed.py                     # full table -> bench/results/embed.md
    .venv/bin/python bench/embed.py --shapes small --batch-sizes 32 --limit 500 --output /tmp/e.md
    .venv/bin/python bench/embed.py --device cuda       # on a GPU -> bench/results/embed-cuda.md

On a GPU (`--device cuda`) the defaults change: the `original` shape at 256, 1,024 and 4,096 rows,
token cache on (ElmoEmbedder's default), the sentences repeated until there are 16 a row of the
most rows (`--sentences-per-row`: a stream long enough to keep every row busy), and each call of
`embed_many` given 64 positions a row (`--positions-per-row`; ElmoEmbedder's POSITION_BUDGET,
16,384 positions, would otherwise cap a call at ~1,200 sentences whatever the rows). Without a
CUDA GPU, `--device cuda` stops with a message before anything runs.

Each configuration runs in its own process so that its peak memory is its own; with --repeats N
every configuration runs N times, float32 and bfloat16 interleaved, and the fastest of each is
kept (on a shared machine the slower runs are the ones something else slowed down). The load
average and the other busy processes are recorded before and after. FLOPs per biLM position
follow spec §12 (multiply-add = 2 FLOPs); positions = tokens + 2 per sentence. "Batch B" is
`ElmoEmbedder.embed_sentences(sentences, batch_size=B)`: B sentences in the recurrence at a time,
each new sentence taking the row the last one freed (`embed_many`).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from machine import _best_gflops, busy_processes, cpu_fields, cpu_flags, matmul_gflops, page_header, rooflines
from machine import machine  # noqa: F401  (bench/machine.py's; kept importable from here for older callers)

REPO = Path(__file__).resolve().parents[1]
UD_DEV = Path(os.environ.get("UD_DEV", REPO.parent / "shared" / "data" / "ud-english-ewt" / "en_ewt-ud-dev.conllu"))
DTYPES = ("float32", "bfloat16", "int8")


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


def recurrent_product_gflops(shape: str, rows: int, threads: int, dtype: str, device: str,
                             repeats: int = 20, trials: int = 5) -> float:
    """The ceiling of the LSTM step: GFLOP/s of its two products at `rows` rows alone, (R, P) x
    (P, 4C) and (R, C) x (C, P) for both directions, through the kernels the model uses
    (`elmokit.kernels`) in `dtype`: for int8 the recurrent product in int8 and the projection in
    bfloat16 (or float32), as `kernels.stream_linear` builds them, timed with each int8 kernel and
    the faster kept (`ELMOKIT_INT8_KERNEL=auto` chooses by one timing a process, which a busy
    moment can get wrong; the ceiling is the faster kernel's). The recurrent part of every
    position (5PC of the LSTM's 9PC multiply-adds) can run no faster than this."""
    from elmokit import ElmoConfig
    from elmokit.model.int8 import KERNEL_VARIABLE, int8_kernel, stream_linear

    if dtype == "int8" and int8_kernel() == "auto":
        measured, previous = [], os.environ.get(KERNEL_VARIABLE)
        try:
            for kernel in ("onednn", "int_mm"):
                os.environ[KERNEL_VARIABLE] = kernel
                measured.append(recurrent_product_gflops(shape, rows, threads, dtype, device, repeats, trials))
        finally:
            if previous is None:
                os.environ.pop(KERNEL_VARIABLE, None)
            else:
                os.environ[KERNEL_VARIABLE] = previous
        return max(measured)

    torch.set_num_threads(threads)
    lstm = ElmoConfig.from_name(shape).lstm
    int8 = dtype == "int8"
    kind = torch.float32 if int8 else getattr(torch, dtype)
    recurrent_weight = torch.randn(2, 4 * lstm.cell_dim, lstm.projection_dim, device=device).to(kind)
    projection = torch.randn(2, lstm.projection_dim, lstm.cell_dim, device=device).to(kind)
    hidden = torch.randn(2, rows, lstm.projection_dim, device=device).to(kind)
    cell = torch.randn(2, rows, lstm.cell_dim, device=device).to(kind)
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with torch.no_grad():
        products = [(stream_linear(recurrent_weight[d], rows, int8=int8),
                     stream_linear(projection[d], rows, int8=int8, projection=True)) for d in range(2)]

        def step() -> None:
            for d, (recurrent, project) in enumerate(products):
                recurrent(hidden[d])
                project(cell[d])

        return _best_gflops(step, 2 * 2 * rows * 5 * lstm.projection_dim * lstm.cell_dim, repeats, trials, synchronize)


def _model(shape: str):
    """Random weights of a preset (seed 0), or the built-in trained model ("builtin")."""
    from elmokit import BiLM, ElmoConfig, load_model

    if shape == "builtin":
        return load_model(None)
    torch.manual_seed(0)
    return BiLM(ElmoConfig.from_name(shape))


def bench_sentences(limit: int | None, count: int = 0) -> list[list[str]]:
    """UD English EWT dev (its first `limit`), repeated until there are at least `count`; where the
    shared data is absent, synthetic sentences (random lowercase words, 5 to 40 a sentence)."""
    if UD_DEV.is_file():
        sentences = read_conllu_forms(UD_DEV)[:limit]
    else:
        rng = np.random.default_rng(0)
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        words = ["".join(rng.choice(letters, rng.integers(1, 12))) for _ in range(5000)]
        sentences = [[words[i] for i in rng.integers(0, len(words), rng.integers(5, 40))] for _ in range(limit or 2001)]
    repeats = -(-count // len(sentences)) if count else 1
    return (sentences * repeats)[:max(count, len(sentences))]


def run_one(shape: str, batch_size: int, cache: bool, limit: int | None, threads: int, dtype: str,
            device: str, count: int = 0, positions_per_row: int = 0) -> dict:
    """One configuration, in this process: returns its measurements."""
    from elmokit import ElmoEmbedder

    torch.set_num_threads(threads)
    embedder = ElmoEmbedder(module=_model(shape), cache_tokens=cache, device=device, dtype=dtype,
                            threads=threads if device == "cpu" else None)  # the page says how many: no default lowers it
    if positions_per_row:  # an instance attribute: this embedder's calls only
        embedder.POSITION_BUDGET = max(embedder.POSITION_BUDGET, positions_per_row * batch_size)
    config = embedder.bilm.config
    sentences = bench_sentences(limit, count)
    list(embedder.embed_sentences(sentences[:batch_size], batch_size))  # warm up: kernels, packed weights (not the cache)
    if embedder.cache is not None:
        embedder.cache.clear()
    n_tokens = sum(map(len, sentences))
    n_positions = n_tokens + 2 * len(sentences)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    start, start_cpu = time.perf_counter(), time.process_time()
    for _ in embedder.embed_sentences(sentences, batch_size=batch_size):
        pass
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    flops = flops_per_position(config)
    encoded = len(embedder.cache.index) if embedder.cache is not None else n_positions
    executed = flops["lstm"] * n_positions + flops["encoder"] * encoded
    engine = engine_tokens_per_s(embedder, sentences, batch_size) if device.startswith("cuda") else None
    from elmokit.model import int8

    return {
        "engine_tokens_per_s": engine,
        "int8_kernels": [[*key, kernel] for key, kernel in int8._CHOICES.items()],  # this process's choices
        "shape": shape, "batch_size": batch_size, "cache": cache, "dtype": dtype, "sentences": len(sentences),
        "tokens": n_tokens, "seconds": seconds, "tokens_per_s": n_tokens / seconds,
        "tokens_per_cpu_s": n_tokens / cpu_seconds,
        "model_gflops": (flops["lstm"] + flops["encoder"]) * n_positions / seconds / 1e9,
        "executed_gflops": executed / seconds / 1e9,
        "peak_mb": (torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda")
                    else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def engine_tokens_per_s(embedder, sentences: list[list[str]], rows: int) -> float:
    """The recurrence alone on the GPU: `contextualize_sentences` over the same sentences in the
    same calls as `embed_many` (POSITION_BUDGET positions a call, `rows` rows), on token vectors
    already on the device, without copying the layers to the host: tokens over the synchronized
    time. What the streamed engine does, apart from the host's share of the embedder's work."""
    from elmokit.inference.engine import contextualize_sentences

    sizes = np.array([len(sentence) + 2 for sentence in sentences], np.int64)
    dim = embedder.bilm.config.lstm.projection_dim
    groups, start = [], 0
    while start < len(sizes):
        end = max(start + 1, int(np.searchsorted(np.cumsum(sizes[start:]), embedder.POSITION_BUDGET, "right")) + start)
        groups.append(sizes[start:end])
        start = end
    generator = torch.Generator(device=embedder.device).manual_seed(0)
    tokens = [torch.randn(int(group.sum()), dim, device=embedder.device, generator=generator) for group in groups]
    with torch.no_grad():
        contextualize_sentences(embedder.bilm, tokens[0], groups[0], rows)  # warm: graphs for these rows
        torch.cuda.synchronize()
        start_time = time.perf_counter()
        for group, vectors in zip(groups, tokens):
            contextualize_sentences(embedder.bilm, vectors, group, rows)
        torch.cuda.synchronize()
    return float(sum(sizes - 2)) / (time.perf_counter() - start_time)


ERROR_BUDGET, COSINE_BUDGET = 0.05, 0.999  # issue 41's budget of a reduced precision (tests/test_int8.py asserts it)


def sentence_errors(exact: list[np.ndarray], approximate: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Each sentence's worst layer error (the largest |approximate - exact| of a layer as a
    fraction of that layer's largest |exact|) and worst layer mean token cosine: (n,), (n,), from
    layers (L+1, n_i, 2P) each. Sentences without tokens are left out."""
    errors, cosines = [], []
    for layers, layers_q in zip(exact, approximate, strict=True):
        if layers.shape[1] == 0:
            continue
        largest = np.abs(layers).max(axis=(1, 2))  # (L+1,)
        errors.append(float((np.abs(layers - layers_q).max(axis=(1, 2)) / largest).max()))
        dots = (layers * layers_q).sum(-1) / np.linalg.norm(layers, axis=-1) / np.linalg.norm(layers_q, axis=-1)
        cosines.append(float(dots.mean(axis=1).min()))
    return np.array(errors), np.array(cosines)


def precision_errors(shape: str, limit: int | None, threads: int, device: str, dtype: str = "bfloat16") -> dict:
    """`dtype`'s vectors against float32's, the same weights and sentences (batch 32, token cache
    on): per layer, the max and mean |low - fp32| over every element, the mean |fp32|, and the
    issue's budget: the largest error of a sentence's layer as a fraction of that layer's largest
    float32 value, and the smallest mean token cosine of a sentence's layer."""
    from elmokit import ElmoEmbedder

    torch.set_num_threads(threads)
    model = _model(shape)
    sentences = bench_sentences(limit)
    outputs = {}
    for kind in ("float32", dtype):
        embedder = ElmoEmbedder(module=copy.deepcopy(model), device=device, dtype=kind)
        outputs[kind] = list(embedder.embed_sentences(sentences, batch_size=32))  # (L+1, n, 2P) each
    errors, cosines = sentence_errors(outputs["float32"], outputs[dtype])
    worst_fraction, worst_cosine = float(errors.max(initial=0.0)), float(cosines.min(initial=1.0))
    exact, low = (np.concatenate(outputs[kind], axis=1) for kind in ("float32", dtype))  # (L+1, N, 2P)
    difference = np.abs(low - exact)
    return {"shape": shape, "dtype": dtype, "tokens": int(difference.shape[1]),
            "worst_fraction": worst_fraction, "worst_cosine": worst_cosine,
            "layers": [{"max": float(d.max()), "mean": float(d.mean()), "scale": float(np.abs(f).mean())}
                       for d, f in zip(difference, exact)]}


def _subprocess(kind: str, spec: dict, cell: str = "fused") -> dict:
    """One measurement in a process of its own; `cell` "eager" turns the compiled cell off there
    (`ELMOKIT_FUSED_CELL=0`, elmokit.model.fused_cell)."""
    environment = os.environ | ({"ELMOKIT_FUSED_CELL": "0"} if cell == "eager" else {})
    result = subprocess.run([sys.executable, __file__, f"--{kind}", json.dumps(spec)], capture_output=True,
                            text=True, env=environment)
    if result.returncode != 0:
        sys.exit(f"{kind} {spec} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=None, help="default: small original (original on a GPU)")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=None,
                        help="rows of the recurrence; default: 32 1 (256 1024 4096 on a GPU)")
    parser.add_argument("--caches", nargs="+", choices=("off", "on"), default=None,
                        help="token cache settings measured; default: off on (on, ElmoEmbedder's default, on a GPU)")
    parser.add_argument("--sentences-per-row", type=int, default=None,
                        help="repeat the sentences until there are this many a row of the most rows "
                             "(default: 0 = once through; 16 on a GPU)")
    parser.add_argument("--positions-per-row", type=int, default=None,
                        help="positions an embed_many call is given a row, when more than ElmoEmbedder's "
                             "POSITION_BUDGET (default: 0 = its budget; 64 on a GPU)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=None,
                        help="default: float32 bfloat16, and int8 on a CPU with VNNI or AMX")
    parser.add_argument("--error-models", nargs="*", default=None,
                        help="models whose bfloat16 error is measured (default: the shapes and 'builtin')")
    parser.add_argument("--cells", nargs="+", choices=("fused", "eager"), default=["fused"],
                        help="the LSTM cell's elementwise work: one compiled pass (fused, the default) or eager "
                             "torch (eager: ELMOKIT_FUSED_CELL=0), each measured")
    parser.add_argument("--limit", type=int, default=None, help="first N sentences only (default: all 2,001)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration; the fastest is kept")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--output", type=Path, help="default: bench/results/embed.md (embed-cuda.md on a GPU)")
    parser.add_argument("--note", default="", help="what else ran, for the page")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: JSON of one configuration
    parser.add_argument("--errors", help=argparse.SUPPRESS)  # internal: JSON of one error measurement
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(**json.loads(args.one))))
        return
    if args.errors:
        print(json.dumps(precision_errors(**json.loads(args.errors))))
        return
    gpu = args.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        sys.exit(f"--device {args.device}: torch sees no CUDA GPU here (torch {torch.__version__}, built with "
                 f"CUDA {torch.version.cuda}); run on a machine with one, or leave --device out")
    from elmokit.model.int8 import int8_native

    args.dtypes = args.dtypes or [dtype for dtype in DTYPES if dtype != "int8" or (not gpu and int8_native())]
    args.shapes = args.shapes or (["original"] if gpu else ["small", "original"])
    args.batch_sizes = args.batch_sizes or ([256, 1024, 4096] if gpu else [32, 1])
    caches = [cache == "on" for cache in (args.caches or (["on"] if gpu else ["off", "on"]))]
    per_row = args.sentences_per_row if args.sentences_per_row is not None else (16 if gpu else 0)
    count = per_row * max(args.batch_sizes)
    positions_per_row = args.positions_per_row if args.positions_per_row is not None else (64 if gpu else 0)
    if not UD_DEV.is_file() and not gpu:
        sys.exit(f"needs {UD_DEV} (the shared data folder beside the repo)")
    output = args.output or REPO / "bench" / "results" / ("embed-cuda.md" if gpu else "embed.md")
    error_models = args.error_models if args.error_models is not None else [*args.shapes, "builtin"]

    started = time.strftime("%Y-%m-%d %H:%M")
    before = busy_processes()
    print(f"before: {before}", flush=True)
    kernels = matmul_gflops(args.threads, args.device)
    print("matmul GFLOP/s (2048x2048): " + ", ".join(f"{k} {v:.1f}" for k, v in kernels.items()), flush=True)
    ceilings = {(shape, batch_size, dtype): recurrent_product_gflops(shape, batch_size, args.threads, dtype, args.device)
                for shape in args.shapes for batch_size in args.batch_sizes for dtype in args.dtypes}
    for (shape, batch_size, dtype), gflops in ceilings.items():
        print(f"{shape:9s} batch {batch_size:3d} {dtype:8s} recurrent products alone: {gflops:6.1f} GFLOP/s", flush=True)

    best: dict[tuple, dict] = {}
    for shape in args.shapes:
        for batch_size in args.batch_sizes:
            for cache in caches:
                for _, cell, dtype in itertools.product(range(args.repeats), args.cells, args.dtypes):
                    # interleaved: every dtype and cell sees the same machine
                    spec = {"shape": shape, "batch_size": batch_size, "cache": cache, "limit": args.limit,
                            "threads": args.threads, "dtype": dtype, "device": args.device, "count": count,
                            "positions_per_row": positions_per_row}
                    row = _subprocess("one", spec, cell) | {"cell": cell}
                    key = (shape, batch_size, cache, dtype, cell)
                    if key not in best or row["tokens_per_s"] > best[key]["tokens_per_s"]:
                        best[key] = row | {"peak_mb": max(row["peak_mb"], best.get(key, row)["peak_mb"])}
                    print(f"{shape:9s} batch {batch_size:3d} cache {str(cache):5s} {cell:5s} {dtype:8s} "
                          f"{row['tokens_per_s']:9.0f} tokens/s  {row['executed_gflops']:6.1f} GFLOP/s executed  "
                          f"peak {row['peak_mb']:.0f} MB", flush=True)
    errors = []
    for model, dtype in itertools.product(error_models, [dtype for dtype in args.dtypes if dtype != "float32"]):
        errors.append(_subprocess("errors", {"shape": model, "limit": args.limit, "threads": args.threads,
                                             "device": args.device, "dtype": dtype}))
        print(f"{model}: {dtype} - float32 per layer: " + ", ".join(
            f"max {layer['max']:.2e} mean {layer['mean']:.2e} (mean abs fp32 {layer['scale']:.2e})"
            for layer in errors[-1]["layers"]), flush=True)
    for name, gflops in matmul_gflops(args.threads, args.device).items():  # again: the best sustained figure
        kernels[name] = max(kernels[name], gflops)
    for key in ceilings:  # the ceilings too: a first measurement in a cold process can read low
        ceilings[key] = max(ceilings[key], recurrent_product_gflops(*key[:2], args.threads, key[2], args.device))
    after = busy_processes()
    print(f"after: {after}", flush=True)
    args.data_note = (f"{'UD English EWT dev' if UD_DEV.is_file() else 'synthetic sentences (UD absent)'}"
                      + (f", repeated to {count:,} sentences ({per_row} a row of {max(args.batch_sizes):,} rows)"
                         if count else "")
                      + (f"; each embed_many call given {positions_per_row} positions a row" if positions_per_row else ""))
    write_report(output, args, kernels, ceilings, best, errors, started, before, after)
    print(f"\nwrote {output}")


def write_report(output: Path, args, kernels: dict, ceilings: dict, best: dict, errors: list, started: str,
                 before: str, after: str) -> None:
    roof = rooflines(kernels)
    rows = list(best.values())
    memory = "peak GPU memory allocated" if args.device.startswith("cuda") else "peak RSS"
    gpu = args.device.startswith("cuda")
    lines = [
        "# Embedding benchmark (`bench/embed.py`)",
        "",
        page_header(args.device, args.threads, kernels),
        f"Run of {started}; device {args.device}; {args.repeats} run(s) of each configuration, the fastest kept, "
        f"the dtypes ({', '.join(args.dtypes)}) interleaved. {getattr(args, 'note', '')}".rstrip(),
        f"Data: {getattr(args, 'data_note', 'UD English EWT dev')}, {rows[0]['sentences']:,} sentences, "
        f"{rows[0]['tokens']:,} tokens; random weights.",
        "'executed' counts the FLOPs actually run (multiply-add = 2 FLOPs per position; with the cache, the "
        "token encoder runs once per distinct word); 'model' counts the full model per position; 'of roofline' "
        "is of the row's own dtype's 2048x2048 roofline; 'of ceiling' is of its own dtype's ceiling at the "
        "row's batch (the LSTM step's products alone, the table after this one). 'tokens / CPU s' divides by "
        "the CPU time of the process (all its threads) instead of the wall time: on a machine shared with "
        "other jobs it is the steadier figure (time spent waiting for a core is not counted).",
        "",
        f"Machine load: before, {before}. After, {after}.",
        "",
    ]
    engine_head, engine_rule = (" engine tokens/s |", "---:|") if gpu else ("", "")
    lines += [f"| shape | batch | token cache | cell | dtype | tokens/s |{engine_head} x float32 | tokens / CPU s | "
              f"x float32 (CPU s) | executed GFLOP/s | of roofline | of ceiling | model GFLOP/s | {memory} (MB) |",
              f"|---|---:|---|---|---|---:|{engine_rule}---:|---:|---:|---:|---:|---:|---:|---:|"]
    if gpu:
        lines[-4:-4] = ["'engine tokens/s': the streamed recurrence alone, on token vectors already on the GPU, the "
                        "layers left there (`engine_tokens_per_s`); 'tokens/s' is `ElmoEmbedder.embed_sentences` end "
                        "to end, the vectors copied to the host as NumPy arrays.", ""]
    for (shape, batch_size, cache, dtype, cell), row in best.items():
        base = best.get((shape, batch_size, cache, "float32", cell))
        compare = base is not None and dtype != "float32"
        ratio = f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x" if compare else ""
        cpu_ratio = f"{row['tokens_per_cpu_s'] / base['tokens_per_cpu_s']:.2f}x" if compare else ""
        engine = f" {row['engine_tokens_per_s']:,.0f} |" if gpu else ""
        ceiling = ceilings.get((shape, batch_size, dtype))
        of_ceiling = f"{row['executed_gflops'] / ceiling:.1%}" if ceiling else ""
        lines.append(f"| {shape} | {batch_size} | {'on' if cache else 'off'} | {cell} | {dtype} | {row['tokens_per_s']:,.0f} |"
                     f"{engine} {ratio} | {row['tokens_per_cpu_s']:,.0f} | {cpu_ratio} | {row['executed_gflops']:.1f} | "
                     f"{row['executed_gflops'] / roof[dtype]:.1%} | {of_ceiling} | "
                     f"{row['model_gflops']:.1f} | {row['peak_mb']:,.0f} |")
    lines += [
        "",
        "The ceiling: the LSTM step's two products alone (`(R, P) x (P, 4C)` and `(R, C) x (C, P)`, both "
        "directions, R = batch rows, the kernels the model uses: for int8 the first in int8 and the projection "
        "in bfloat16, as `kernels.stream_linear` builds them), measured in the same run, before and after the "
        "rows, the better kept. The recurrent 5PC of the LSTM's 9PC multiply-adds per position cannot run "
        "faster than this; the rest (the input products of a block of steps at once, the token encoder) "
        "runs at more rows, so a row's fraction of it can pass 100%.",
        "",
        "| shape | batch (rows) | dtype | step products GFLOP/s | of roofline |",
        "|---|---:|---|---:|---:|",
    ]
    lines += [f"| {shape} | {batch_size} | {dtype} | {gflops:.1f} | {gflops / roof[dtype]:.1%} |"
              for (shape, batch_size, dtype), gflops in ceilings.items()]
    lines += int8_kernel_lines([choice for row in best.values() for choice in row.get("int8_kernels", [])])
    if "fused" in args.cells and not gpu:
        lines += fused_cell_cost_lines()
    lines += [
        "",
        "## Reduced precision against float32",
        "",
        "`ElmoEmbedder(dtype=torch.bfloat16)`: the weights and every product in bfloat16; `dtype=\"int8\"`: "
        "the LSTM's input and recurrent products in int8 (weights per output channel, inputs per row, int32 "
        "sums), its projection and the token encoder's char CNN, highway and projection in bfloat16; in both the activations, the LSTM's cell and recurrent state "
        "and the outputs in float32. The error of their vectors against float32's (the same weights and "
        "sentences, batch 32), per layer, over every element of every token; 'mean abs fp32' is the typical "
        "size of a float32 value of that layer. 'worst / sentence max' is the largest error of any sentence's "
        "layer as a fraction of that layer's largest float32 value, 'worst cosine' the smallest mean token "
        "cosine of any sentence's layer (the int8 budget: <= 0.05 and >= 0.999).",
        "",
        "| model | dtype | tokens | layer | max abs error | mean abs error | mean abs error / mean abs fp32 | "
        "mean abs fp32 | worst / sentence max | worst cosine |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in errors:
        name = "built-in (trained)" if entry["shape"] == "builtin" else f"{entry['shape']} (random weights)"
        for index, layer in enumerate(entry["layers"]):
            budget = (f"{entry['worst_fraction']:.4f} | {entry['worst_cosine']:.5f}" if index == 0 else " | ")
            lines.append(f"| {name} | {entry['dtype']} | {entry['tokens']:,} | {index} | {layer['max']:.2e} | "
                         f"{layer['mean']:.2e} | {layer['mean'] / layer['scale']:.2%} | {layer['scale']:.2e} | "
                         f"{budget} |")
    lines += reading_lines(best, ceilings, errors, kernels)
    if gpu:
        lines += gpu_target_lines(best)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join(lines) + "\n", encoding="utf-8")


def int8_kernel_lines(choices: list[list]) -> list[str]:
    """Which kernel each int8 product of this run took (`elmokit.model.int8.choose_kernel`'s timings
    in the processes that embedded, and in this one for the ceilings): (rows, in, out, scaled later,
    kernel) lists."""
    from elmokit.model import int8

    names = {"onednn": "oneDNN quantized linear", "int_mm": "torch._int_mm"}
    chosen: dict[tuple, set[str]] = {}
    for *key, kernel in [*choices, *([*key, kernel] for key, kernel in int8._CHOICES.items())]:
        chosen.setdefault(tuple(key), set()).add(kernel)
    if not chosen:
        return []
    listed = "; ".join(f"{rows} x {dim} -> {out}{' (a block of steps, scaled later)' if later else ''}: "
                       + (" in some processes, ".join(names[kernel] for kernel in sorted(kernels))
                          + " in others" if len(kernels) > 1 else names[next(iter(kernels))])
                       for (rows, dim, out, later), kernels in sorted(chosen.items()))
    return ["", f"int8 kernels ({int8.KERNEL_VARIABLE}={int8.int8_kernel()}: the faster of oneDNN's quantized linear "
            f"and torch._int_mm, timed once a process at each product's shape; a block of steps' input products "
            f"timed as the engine uses them, before their scales, which the cell applies a step at a time): {listed}."]


BUILD_PROBE = ("import time; start = time.perf_counter(); from elmokit.model import fused_cell; "
               "runs, why = fused_cell.status(); print(runs, time.perf_counter() - start, why)")


def fused_cell_cost_lines() -> list[str]:
    """What the compiled cell costs a process: its first build (an empty cache folder) and a later
    process's load, each the time to import it and get its status (the self-check included)."""
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        environment = os.environ | {"ELMOKIT_CACHE": cache}
        runs = [subprocess.run([sys.executable, "-c", BUILD_PROBE], capture_output=True, text=True, env=environment,
                               check=True).stdout.split(maxsplit=2) for _ in range(2)]
    if runs[0][0] != "True":
        return ["", f"The fused cell does not run on this machine: {runs[0][2].strip()}."]
    return ["", f"The fused cell's cost to a process (`elmokit.model.fused_cell.status()` from a fresh interpreter, "
                f"torch's import included): {float(runs[0][1]):.2f} s the first time (built into an empty cache "
                f"folder), {float(runs[1][1]):.2f} s in a later process (loaded from it)."]


def reading_lines(best: dict, ceilings: dict, errors: list, kernels: dict) -> list[str]:
    """What the figures say against the issues' targets, written from them."""
    lines = ["", "## Reading (written by the script from the figures above)", ""]
    for key, row in best.items():
        base = best.get((*key[:3], "float32", key[4]))
        if key[3] == "float32" or base is None:
            continue
        shape, batch_size, cache, dtype, cell = key
        lines.append(f"* `{shape}`, batch {batch_size}, token cache {'on' if cache else 'off'}, {cell} cell: {dtype} runs "
                     f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x the float32 tokens/s of the same run "
                     f"({row['tokens_per_cpu_s'] / base['tokens_per_cpu_s']:.2f}x in tokens per CPU second).")
    for (shape, batch_size, cache, dtype, cell), row in best.items():  # issue 56, point 3: the fused cell
        floor = CEILING_TARGETS.get(batch_size)
        if shape != "original" or cache or cell != "fused" or floor is None or (shape, batch_size, dtype) not in ceilings:
            continue
        fraction = row["executed_gflops"] / ceilings[(shape, batch_size, dtype)]
        lines.append(f"* Target (`original`, batch {batch_size}, token cache off, {dtype} >= {floor:.0%} of its step "
                     f"ceiling): **{'met' if fraction >= floor else 'NOT met'}** ({fraction:.1%}).")
    flags = cpu_flags(cpu_fields().get("flags", ""))
    for batch_size in sorted({key[1] for key in best if key[0] == "original" and key[1] > 1}):
        speed = {key[3]: row["tokens_per_s"] for key, row in best.items()
                 if key[0] == "original" and key[1] == batch_size and not key[2] and key[4] == "fused"}
        for dtype, base, ratio, needs, lacks in SPEED_TARGETS:
            if dtype not in speed or base not in speed:
                continue
            measured = speed[dtype] / speed[base]
            applies = all(flags.get(flag) for flag in needs) and not any(flags.get(flag) for flag in lacks)
            cpu = " and ".join(needs) + "".join(f" and no {flag}" for flag in lacks)
            lines.append(f"* Target ({dtype} >= {ratio}x {base} at `original`, batch {batch_size}, token cache off, "
                         f"on a CPU with {cpu}): "
                         + (f"**{'met' if measured >= ratio else 'NOT met'}** ({measured:.2f}x)" if applies
                            else f"not applicable on this CPU ({measured:.2f}x measured)") + ".")
    lines += rows_lines(best)
    for entry in errors:
        if entry["dtype"] == "int8":
            met = entry["worst_fraction"] <= ERROR_BUDGET and entry["worst_cosine"] >= COSINE_BUDGET
            lines.append(f"* int8 error budget on {entry['shape']}: worst {entry['worst_fraction']:.4f} of a "
                         f"sentence's layer maximum (<= 0.05), worst mean cosine {entry['worst_cosine']:.5f} "
                         f"(>= 0.999): **{'met' if met else 'NOT met'}**.")
    return lines


def rows_lines(best: dict) -> list[str]:
    """Where several row counts were measured: each configuration's tokens/s at each, and the
    rows the engine runs when none is given (`streams.default_rows` at ElmoEmbedder's budget)
    against the others."""
    from elmokit import ElmoConfig, ElmoEmbedder
    from elmokit.inference.streams import default_rows

    lines = []
    for shape, cache, dtype, cell in sorted({(key[0], key[2], key[3], key[4]) for key in best}):
        speeds = {key[1]: row["tokens_per_s"] for key, row in sorted(best.items())
                  if (key[0], key[2], key[3], key[4]) == (shape, cache, dtype, cell)}
        if len(speeds) < 2 or shape == "builtin":
            continue
        chosen = default_rows(ElmoConfig.from_name(shape).lstm.cell_dim, ElmoEmbedder.POSITION_BUDGET)
        others = ", ".join(f"{rows} rows {speed:,.0f}" for rows, speed in speeds.items())
        against = (", ".join(f"{speeds[chosen] / speed:.2f}x {rows} rows" for rows, speed in speeds.items()
                             if rows != chosen) if chosen in speeds else "not measured")
        lines.append(f"* `{shape}`, {dtype}, token cache {'on' if cache else 'off'}, {cell} cell: tokens/s at {others}; the "
                     f"engine's rows when none are given ({chosen}): {against}.")
    return lines


CEILING_TARGETS = {32: 0.80, 128: 0.70}  # issue 56 point 3: of each dtype's step ceiling, by rows
SPEED_TARGETS = [("bfloat16", "float32", 3.0, ("AMX-BF16",), ()), ("int8", "bfloat16", 1.5, ("AMX-INT8",), ()),
                 ("bfloat16", "float32", 1.8, ("AVX512-BF16",), ("AMX-BF16",))]
# (dtype, against, ratio, the flags the CPU has, the flags it lacks): issue 56 point 3
GPU_TARGETS = {"float32": 150_000, "bfloat16": 300_000}  # tokens/s, `original`, >= 1,024 rows (issue 34)


def gpu_target_lines(best: dict) -> list[str]:
    """The issue's GPU targets against the rows measured: the `original` shape's tokens/s at 1,024
    rows or more, and whether the rate ever falls as the rows grow."""
    lines = ["", "## Against the issue's GPU targets (written by the script from the rows above)", ""]
    caches = sorted({key[2] for key in best})
    measures = (("tokens_per_s", "end to end"), ("engine_tokens_per_s", "the engine alone"))
    for (dtype, target), cache, (measure, how) in itertools.product(GPU_TARGETS.items(), caches, measures):
        rows = sorted((key[1], row[measure]) for key, row in best.items()
                      if key[0] == "original" and key[3] == dtype and key[2] == cache and row.get(measure))
        what = f"`original`, {dtype}, token cache {'on' if cache else 'off'}, {how}"
        large = [speed for batch_size, speed in rows if batch_size >= 1024]
        if large:
            lines.append(f"* {what}, >= 1,024 rows: {max(large):,.0f} tokens/s, target >= {target:,}: "
                         f"**{'met' if max(large) >= target else 'NOT met'}**.")
        falls = [f"{a:,} -> {b:,} rows" for (a, speed_a), (b, speed_b) in zip(rows, rows[1:]) if speed_b < speed_a]
        if len(rows) > 1:
            lines.append(f"* {what}: never slower with more rows: **{'met' if not falls else 'NOT met'}**"
                         + (f" (slower at {', '.join(falls)})" if falls else "") + ".")
    return lines


if __name__ == "__main__":
    main()
