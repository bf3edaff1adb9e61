"""Training speed on a CUDA GPU (`bench/train.py --device cuda`): elmokit against the same model on
`torch.nn.LSTM(proj_size)` (cuDNN), in one process, the models stepping in turn on the same windows.

    elmokit eager              the clipped cell (bilm-tf's clips, 3.0), both directions batched, eager
    elmokit + CUDA graph       the same, each LSTM layer's forward and backward replayed from a graph
    elmokit + graph + bf16     and the LSTM's products in bfloat16 (float32 state and sums)
    elmokit + graph + TF32     float32 products on TF32 tensor cores (only these steps; TF32 off again after)
    nn.LSTM baseline           cuDNN's fused LSTM with projections (no clipping, no residual), float32

A step is forward, backward, gradient clipping to norm 10 and an Adam update (torch's fused Adam
where the device has it), with the full softmax over the vocabulary; tokens/s is the batch's
positions over the median step time (torch.cuda.synchronize around each step). The data: PTB's
training text when `PTB_DATA` (or ../shared/data/ptb) has it, else a synthetic Zipfian corpus
written once (the page says which). Writes bench/results/train-cuda.md, with the device, the
torch, CUDA and cuDNN versions and what else ran on the GPU, and the issue's targets, met or not.

    .venv/bin/python bench/train.py --device cuda [--shapes original] [--batch-sizes 128 512] [--steps 10]
"""

from __future__ import annotations

import gzip
import os
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from machine import page_header  # bench/machine.py: the GPU (and the host's CPU), cuBLAS's rooflines

from elmokit.training.build import has_fused_kernel
from elmokit.training.data import LMBatcher
from elmokit.training.lm import LanguageModel
from elmokit.training.recurrence import RecurrenceOptions
from elmokit.training.vocab import Vocabulary, make_vocab

REPO = Path(__file__).resolve().parents[1]
TARGETS = {128: 1.5, 512: 1.2}  # float32 elmokit (best) / nn.LSTM at these rows (issue 34)
BF16_TARGET = 90_000  # tokens/s with bfloat16 products, the original shape


def refuse_without_cuda(device: str) -> None:
    """Exit with a message (status 1) unless torch sees a CUDA GPU."""
    if not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: torch sees no CUDA GPU here (torch {torch.__version__}, "
                         f"built with CUDA {torch.version.cuda}); run on a machine with one, or leave --device out")


def corpus(ptb: Path, n_lines: int = 40_000) -> tuple[Path, str]:
    """PTB's training file, or a synthetic one (10,000 word types, Zipfian, `n_lines` lines) written once."""
    if (ptb / "ptb.train.txt.gz").is_file():
        return ptb / "ptb.train.txt.gz", "PTB training text"
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"elmokit-bench-synthetic-{n_lines}.txt.gz"
    if not path.exists():
        rng = np.random.default_rng(0)
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        words = ["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(10_000)]
        probabilities = 1.0 / np.arange(1, len(words) + 1)
        probabilities /= probabilities.sum()
        lines = (" ".join(np.array(words)[rng.choice(len(words), rng.integers(5, 40), p=probabilities)])
                 for _ in range(n_lines))
        with gzip.open(path.with_suffix(".tmp"), "wt", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")
        path.with_suffix(".tmp").rename(path)
    return path, f"a synthetic corpus (PTB absent: 10,000 random word types, Zipfian, {n_lines:,} lines)"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CudaTrainer:
    """One model on the GPU, its Adam, its carried state and its step times."""

    def __init__(self, name: str, model: torch.nn.Module, device: torch.device, tf32: bool = False):
        self.name, self.model, self.device, self.tf32 = name, model.to(device).train(), device, tf32
        fused = has_fused_kernel("adam", device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-3, fused=fused)
        self.state, self.times = None, []

    def step(self, batch) -> None:
        torch.set_float32_matmul_precision("high" if self.tf32 else "highest")
        batch = batch.to(self.device)
        synchronize(self.device)
        start = time.perf_counter()
        if isinstance(self.model, LanguageModel):
            out = self.model(batch, self.state)
            loss, self.state = out.loss, out.state
        else:
            loss, self.state = self.model(batch, self.state)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 10.0)
        self.optimizer.step()
        synchronize(self.device)
        self.times.append(time.perf_counter() - start)
        torch.set_float32_matmul_precision("highest")


def trainers(config, vocab_size: int, device: torch.device, baseline_class) -> list[CudaTrainer]:
    def elmokit(options: RecurrenceOptions) -> LanguageModel:
        torch.manual_seed(0)
        model = LanguageModel(config, vocab_size, dropout=0.1)
        model.recurrence = options
        return model

    torch.manual_seed(0)
    return [CudaTrainer("elmokit eager", elmokit(RecurrenceOptions()), device),
            CudaTrainer("elmokit + CUDA graph", elmokit(RecurrenceOptions(cuda_graph=True)), device),
            CudaTrainer("elmokit + graph + bf16 products", elmokit(RecurrenceOptions(cuda_graph=True, lstm_bf16=True)),
                        device),
            CudaTrainer("elmokit + graph + TF32", elmokit(RecurrenceOptions(cuda_graph=True)), device, tf32=True),
            CudaTrainer("nn.LSTM baseline (cuDNN)", baseline_class(config, vocab_size, 0.1), device)]


def bench_rows(shape: str, config, vocab: Vocabulary, data: Path, rows: int, args, baseline_class) -> list[dict]:
    device = torch.device(args.device)
    models = trainers(config, len(vocab), device, baseline_class)
    batches = LMBatcher([data], vocab, rows, args.unroll_steps, seed=0)
    cuda = device.type == "cuda"  # (the CPU runs this too, in the tests)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup + args.steps):
        batch = next(batches)
        for trainer in models:
            trainer.step(batch)
    tokens = rows * args.unroll_steps
    speeds = {t.name: tokens / statistics.median(t.times[args.warmup:]) for t in models}
    baseline = speeds[models[-1].name]
    result = [{"shape": shape, "rows": rows, "model": name, "tokens_per_s": speed, "vs_baseline": speed / baseline}
              for name, speed in speeds.items()]
    for row in result:
        print(f"{shape:9s} {rows:5d} rows  {row['model']:34s} {row['tokens_per_s']:9.0f} tokens/s  "
              f"{row['vs_baseline']:5.2f}x", flush=True)
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if cuda else float("nan")
    del models
    if cuda:
        torch.cuda.empty_cache()
    return [row | {"peak_gb": peak} for row in result]


def gpu_neighbours() -> str:
    """What else used the GPU, as nvidia-smi sees it (or why it could not be asked)."""
    try:
        listing = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError) as error:
        return f"nvidia-smi unavailable ({type(error).__name__})"
    others = [line.strip() for line in listing.stdout.splitlines()
              if line.strip() and not line.strip().startswith(str(os.getpid()))]
    return "other GPU processes: " + ("; ".join(others) if others else "none")


def run(args, shapes: dict, baseline_class) -> None:
    """bench/train.py's --device cuda: every shape x rows, then the page."""
    refuse_without_cuda(args.device)
    data, data_name = corpus(Path(os.environ.get("PTB_DATA", REPO.parent / "shared" / "data" / "ptb")))
    vocab_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"elmokit-bench-{data.name}-vocab.txt"
    if not vocab_path.exists():
        make_vocab([data], vocab_path)
    vocab = Vocabulary.load(vocab_path)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = page_header(args.device, torch.get_num_threads())  # the rooflines measured before the steps
    before = f"load average {os.getloadavg()[0]:.1f}; {gpu_neighbours()}"
    rows = [row for shape in args.shapes for batch_rows in args.batch_sizes
            for row in bench_rows(shape, shapes[shape], vocab, data, batch_rows, args, baseline_class)]
    after = f"load average {os.getloadavg()[0]:.1f}; {gpu_neighbours()}"
    write_page(args.output, args, rows, header, data_name, len(vocab), started, before, after)


def write_page(output: Path, args, rows: list[dict], header: str, data_name: str, vocab_size: int,
               started: str, before: str, after: str) -> None:
    lines = ["# Training speed on a CUDA GPU (`bench/train.py --device cuda`)", "",
             header, f"Run of {started}. {args.note}".rstrip(),
             f"Data: {data_name}, vocabulary {vocab_size:,} (full softmax). {args.unroll_steps}-token windows, "
             f"Adam, clip norm 10, dropout 0.1; median of {args.steps} steps after {args.warmup} warm-up steps, "
             "the models stepping in turn on the same windows. elmokit runs the clipped cell (3.0, bilm-tf's); "
             "the baseline cannot clip. TF32 is off except in the TF32 row.",
             f"Before: {before}. After: {after}.", "",
             "| shape | rows | model | tokens/s | vs nn.LSTM | peak GPU memory of the row's five models (GiB) |",
             "|---|---:|---|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['rows']} | {r['model']} | {r['tokens_per_s']:,.0f} | {r['vs_baseline']:.2f}x | "
              f"{r['peak_gb']:.1f} |" for r in rows]
    lines += ["", "## Against the issue's targets (written by the script from the rows above)", ""]
    for shape in args.shapes:
        for batch_rows, target in TARGETS.items():
            mine = [r for r in rows if r["shape"] == shape and r["rows"] == batch_rows
                    and r["model"] in ("elmokit eager", "elmokit + CUDA graph")]
            if mine:
                best = max(mine, key=lambda r: r["vs_baseline"])
                verdict = "met" if best["vs_baseline"] >= target else "NOT met"
                lines.append(f"* `{shape}`, {batch_rows} rows, float32: {best['model']} at {best['vs_baseline']:.2f}x "
                             f"nn.LSTM, target >= {target}x: **{verdict}**.")
        low = [r for r in rows if r["shape"] == shape and "bf16" in r["model"]]
        if low:
            best = max(low, key=lambda r: r["tokens_per_s"])
            verdict = "met" if best["tokens_per_s"] >= BF16_TARGET else "NOT met"
            lines.append(f"* `{shape}`, bfloat16 products: {best['tokens_per_s']:,.0f} tokens/s at {best['rows']} "
                         f"rows, target >= {BF16_TARGET:,}: **{verdict}**.")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"\nwrote {output}")
