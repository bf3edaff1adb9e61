"""Would fused elementwise work make training 2x the nn.LSTM baseline? An upper bound, measured.

The training step's matrix products run through oneDNN at 77% of the roofline
(bench/results/train.md); the other half of the step is elementwise work and per-operator cost.
The largest part of it is the recurrence's per-step elementwise work (the gates, the cell, their
gradients), which `elmokit.training.recurrence` runs as ~10 eager operations a step, layer and
pass. This program times those groups at the gutenberg-cpu shape as elmokit runs them (the
recurrence's own `forward_cell`, `backward_cell` and `gate_factors`: eager, `out=` into the pass's
buffers) and fused into one kernel each by
torch.compile (inductor's C++ kernels, the fastest fusion PyTorch offers on a CPU), with the
results copied into the same buffers as the recurrence needs them. Then

    saving a training step <= U L (forward cell + backward cell, eager - fused)
                              + L (the backward's all-steps gate factors, eager - fused)

(a group whose fused kernel is slower counts as no saving: it would stay eager)

is compared with what 2x the baseline needs, the step times of elmokit (no clip) and of the
nn.LSTM baseline measured in the same run (bench/train.py's trainers, the same PTB windows).
Writes bench/results/fused_cell.md (replaced: one run, one page).

    .venv/bin/python bench/fused_cell.py [--threads 2] [--steps 12] [--note "what else ran"]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from train import PTB, REPO, SHAPES, Trainer, TorchLstmLM, unclipped  # bench/train.py
from machine import page_header, replace_page  # bench/machine.py: the CPU, its flags, the rooflines
from train_kernels import median_us  # bench/train_kernels.py

from elmokit import kernels as elmokit_kernels
from elmokit.training.data import LMBatcher
from elmokit.training.lm import LanguageModel
from elmokit.training.processes import keep_freed_memory
from elmokit.training.recurrence import backward_cell, forward_cell, gate_factors
from elmokit.training.vocab import Vocabulary, make_vocab


def fused_forward_cell(pre0, pre1, cell_prev):
    """recurrence.forward_cell without clipping as one expression for inductor, per direction's
    gates pre0, pre1 (B, 4C): returns acts, c_t, tanh(c_t), m_t instead of writing them."""
    pre = torch.stack([pre0, pre1])
    cell_dim = cell_prev.shape[-1]
    sig, candidate = torch.sigmoid(pre[..., :3 * cell_dim]), 2 * torch.sigmoid(2 * pre[..., 3 * cell_dim:]) - 1
    cell = sig[..., cell_dim:2 * cell_dim] * cell_prev + sig[..., :cell_dim] * candidate
    tanh_cell = 2 * torch.sigmoid(2 * cell) - 1  # tanh as forward_cell computes it
    return torch.cat([sig, candidate], dim=-1), cell, tanh_cell, sig[..., 2 * cell_dim:] * tanh_cell


def fused_backward_cell(grad_m, cell_grad, through_tanh, factors, forget_gate):
    """recurrence.backward_cell without clipping as one expression: returns the gate gradients
    (D, B, 4, C) and dL/dc_{t-1}."""
    grad_c = cell_grad + grad_m * through_tanh
    scale = torch.stack([grad_c, grad_c, grad_m, grad_c], dim=2)
    return factors * scale, grad_c * forget_gate


def cell_rows(n_rows: int, cell_dim: int, n_steps: int) -> list[dict]:
    """Each group eager and fused (with the copies into the pass's buffers), µs a call."""
    D, B, C, U = 2, n_rows, cell_dim, n_steps
    pre = [torch.randn(B, 4 * C), torch.randn(B, 4 * C)]
    acts, cell_prev, cell_next = torch.empty(D, B, 4 * C), torch.randn(D, B, C), torch.empty(D, B, C)
    tanh_cell, cell_output = torch.empty(D, B, C), torch.empty(D, B, C)
    forward = torch.compile(fused_forward_cell, dynamic=False)

    def fused_forward():
        outputs = forward(pre[0], pre[1], cell_prev)
        for buffer, value in zip((acts, cell_next, tanh_cell, cell_output), outputs):
            buffer.copy_(value)

    grad_m, cell_grad, through_tanh = torch.randn(D, B, C), torch.randn(D, B, C), torch.rand(D, B, C)
    factors, forget_gate, step_grads = torch.rand(D, B, 4, C), torch.rand(D, B, C), torch.empty(D, B, 4, C)
    backward = torch.compile(fused_backward_cell, dynamic=False)

    def fused_backward():
        grads, carried = backward(grad_m, cell_grad, through_tanh, factors, forget_gate)
        step_grads.copy_(grads)
        return carried

    all_acts, cells, tanh_cells = torch.rand(D, U, B, 4 * C), torch.randn(D, U + 1, B, C), torch.rand(D, U, B, C)
    all_factors = torch.compile(gate_factors, dynamic=False)
    def eager_forward():  # forward_cell doubles the candidate slot of its products in place (a pass hands it
        forward_cell(pre, acts, cell_prev, cell_next, tanh_cell, cell_output, 0.0)  # fresh ones): halved back
        for gates in pre:  # here, so that every call sees the same values (two small operations more)
            gates.narrow(-1, 3 * C, C).mul_(0.5)

    groups = [("forward cell (a step, both directions)", U, eager_forward, fused_forward),
              ("backward cell (a step, both directions)", U,
               lambda: backward_cell(grad_m, cell_grad, through_tanh, factors, forget_gate, None, step_grads),
               fused_backward),
              ("backward gate factors (all steps, once a layer)", 1,
               lambda: gate_factors(all_acts, cells, tanh_cells), lambda: all_factors(all_acts, cells, tanh_cells))]
    rows = []
    for name, per_layer, eager, fused in groups:
        start = time.perf_counter()
        fused()  # compiles
        compile_s = time.perf_counter() - start
        rows.append({"group": name, "calls_per_layer": per_layer, "eager_us": median_us(eager, 300, 30),
                     "fused_us": median_us(fused, 300, 30), "compile_s": compile_s})
        print(f"{name:48s} eager {rows[-1]['eager_us']:7.1f} µs  fused {rows[-1]['fused_us']:7.1f} µs  "
              f"(compiled in {compile_s:.1f} s)", flush=True)
    return rows


def step_times(vocab: Vocabulary, args) -> dict[str, float]:
    """Median seconds a training step of elmokit (no clip) and of the nn.LSTM baseline, in turn."""
    config = SHAPES["gutenberg-cpu"]
    torch.manual_seed(0)
    trainers = [Trainer("elmokit (no clip)", LanguageModel(unclipped(config), len(vocab), dropout=0.1), False),
                Trainer("nn.LSTM baseline", TorchLstmLM(config, len(vocab), dropout=0.1), False)]
    batches = LMBatcher([PTB / "ptb.train.txt.gz"], vocab, args.batch_size, args.unroll_steps, seed=0)
    for _ in range(2 + args.steps):
        batch = next(batches)
        for trainer in trainers:
            trainer.step(batch)
    return {trainer.name: statistics.median(trainer.times[2:]) for trainer in trainers}


def saved_ms(row: dict, n_layers: int) -> float:
    """What fusing the group saves a training step; none where the fused kernel is slower (kept eager)."""
    return n_layers * row["calls_per_layer"] * max(row["eager_us"] - row["fused_us"], 0.0) / 1e3


def write_page(rows: list[dict], steps: dict[str, float], args, lstm, load: tuple[float, float], header: str) -> str:
    tokens = args.batch_size * args.unroll_steps
    elmokit_s, baseline_s = steps["elmokit (no clip)"], steps["nn.LSTM baseline"]
    n_layers = lstm.n_layers
    saving_s = sum(saved_ms(r, n_layers) for r in rows) * 1e-3
    lines = ["# Fused elementwise work in the recurrence: an upper bound (bench/fused_cell.py)", "",
             header, f"Load average {load[0]:.1f} before, {load[1]:.1f} after. {args.note}".rstrip(), "",
             f"gutenberg-cpu shape (2 directions, {n_layers} layers, {args.unroll_steps} steps, "
             f"{args.batch_size} rows, {lstm.cell_dim} cells, projection {lstm.projection_dim}), float32, no "
             "clipping. Each group of the recurrence's elementwise work as elmokit runs it (eager) and as one "
             "torch.compile (inductor) kernel whose results are copied into the pass's buffers; median of 300 "
             "calls after 30 warm-up, in a process set up as `elmo train`'s (oneDNN's training caches, "
             "`keep_freed_memory`). A group whose fused kernel is slower saves nothing (it would stay eager). "
             "First call: the compile, or less where inductor's on-disk cache already held the kernel.", "",
             "| group | calls a layer and step | eager (µs) | fused (µs) | saved a training step (ms) "
             "| first call (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['group']} | {n_layers} x {r['calls_per_layer']} | {r['eager_us']:.1f} | "
                     f"{r['fused_us']:.1f} | {saved_ms(r, n_layers):.1f} | {r['compile_s']:.1f} |")
    best_s = elmokit_s - saving_s
    lines += ["", "Training steps in the same run (batch 32 x 20, full PTB softmax, Adam; median of "
              f"{args.steps} after 2 warm-up, the two models in turn):", "",
              "| | ms a step | tokens/s | vs nn.LSTM |", "|---|---:|---:|---:|",
              f"| nn.LSTM baseline | {baseline_s * 1e3:.1f} | {tokens / baseline_s:,.0f} | 1.00x |",
              f"| elmokit (no clip) | {elmokit_s * 1e3:.1f} | {tokens / elmokit_s:,.0f} | "
              f"{baseline_s / elmokit_s:.2f}x |",
              f"| elmokit with every group above fused (bound: measured step - saving) | {best_s * 1e3:.1f} | "
              f"{tokens / best_s:,.0f} | {baseline_s / best_s:.2f}x |",
              f"| what 2x the baseline needs | {baseline_s / 2 * 1e3:.1f} | {2 * tokens / baseline_s:,.0f} | 2.00x |",
              "", f"Fusing the recurrence's elementwise work saves at most {saving_s * 1e3:.1f} ms of the "
              f"{elmokit_s * 1e3:.1f} ms step; 2x the baseline needs {(elmokit_s - baseline_s / 2) * 1e3:.1f} ms."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12, help="timed training steps a model (median reported)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--unroll-steps", type=int, default=20)
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "fused_cell.md")
    parser.add_argument("--note", default="", help="what else ran on the machine, for the page")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    elmokit_kernels.bound_onednn_caches(elmokit_kernels.TRAINING_CACHE_CAPACITY)  # as `elmo train`'s process,
    keep_freed_memory()  # and its C heap (freed blocks reused, not faulted in again every call)
    vocab_path = Path(os.environ.get("TMPDIR", "/tmp")) / "elmokit-bench-ptb-vocab.txt"
    if not vocab_path.exists():
        make_vocab([PTB / "ptb.train.txt.gz"], vocab_path)
    load_before = os.getloadavg()[0]
    header = page_header("cpu", args.threads)  # the rooflines measured before the timings
    lstm = SHAPES["gutenberg-cpu"].lstm
    rows = cell_rows(args.batch_size, lstm.cell_dim, args.unroll_steps)
    steps = step_times(Vocabulary.load(vocab_path), args)
    page = write_page(rows, steps, args, lstm, (load_before, os.getloadavg()[0]), header)
    print(page)
    replace_page(args.output, page)


if __name__ == "__main__":
    main()
