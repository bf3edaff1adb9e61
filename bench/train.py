"""Training speed: elmokit's LanguageModel against the same model built on torch.nn.LSTM.

For each shape, the models train on the same PTB windows in the same process, one step each
in turn (so that a busy machine slows all of them alike):

    elmokit (clip 3)    the ELMo cell with cell/projection clipping (bilm-tf's defaults)
    elmokit (no clip)   clips 0 (the gutenberg-cpu recipe); the same engine
    nn.LSTM baseline    each direction a torch.nn.LSTM(P, C, num_layers=L, proj_size=P) stack
                        (fused kernel; no clipping, no residual), the same TokenEncoder, the
                        same dropout 0.1, and the softmax as F.cross_entropy over F.linear

elmokit trains through `elmokit.training` (a hand-written forward/backward through time, a
one-pass softmax) and a fused Adam; the baseline through autograd and torch's Adam.

A step is forward, backward, gradient clipping to norm 10 and an Adam update, with the full
softmax over the PTB vocabulary. The training FLOPs of a token (forward, and backward counted as
twice the forward: spec §12's counts, multiply-adds as 2 FLOPs) are

    token encoder   per distinct token type of the window, shared by its positions:
                    2 (sum_w (W - w + 1) w E n_w + 2 n_hw F^2 + F P)
    LSTM            per position and direction: 2 L (8 C P + C P)
    softmax         per target and direction: 2 P V

so a step executes 3 x (types x encoder + 2 B U x (LSTM + softmax)) FLOPs; dividing by the step
time gives the executed GFLOP/s, reported against the fp32 matmul roofline measured in the same
run (the best of MKL and oneDNN on 2048 x 2048, as bench/embed.py). Prints a table and writes
bench/results/train.md (replaced, not appended: one run, one page).

    .venv/bin/python bench/train.py [--shapes gutenberg-cpu] [--steps 8] [--batch-size 32] [--bf16] [--threads 2]
    .venv/bin/python bench/train.py --shapes gutenberg-cpu --lstm-bf16 --profile-steps 0 \
        --output bench/results/train-lstm-bf16.md      # adds elmokit (no clip) with `elmo train --lstm-bf16`,
                                                       # `--softmax-bf16` and both
    .venv/bin/python bench/train.py ... --torch-kernels  # adds elmokit (no clip) with ELMOKIT_KERNELS=torch
                                                       # (torch's products, MKL's in float32, not oneDNN's; CPU only)
    .venv/bin/python bench/train.py --device cuda [--shapes original] [--batch-sizes 128 512]
                                                  # a GPU: bench/train_cuda.py -> bench/results/train-cuda.md
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from machine import kernel_dtype, matmul_gflops, page_header  # bench/machine.py: the rooflines, the page's header

from elmokit import kernels as elmokit_kernels
from elmokit.model.config import ElmoConfig, LSTMConfig
from elmokit.training.data import LMBatcher
from elmokit.training.lm import LanguageModel
from elmokit.training.recurrence import RecurrenceOptions
from train_kernels import direction_rows, heap_rows, maxpool_rows, product_rows  # bench/train_kernels.py
from elmokit.model.encoder import TokenEncoder
from elmokit.training.vocab import Vocabulary, make_vocab

REPO = Path(__file__).resolve().parents[1]
PTB = Path(os.environ.get("PTB_DATA", REPO.parent / "shared" / "data" / "ptb"))
SHAPES = {"small": ElmoConfig.from_name("small"), "ptb-cpu": ElmoConfig.load(REPO / "scripts" / "ptb-cpu.json"),
          "gutenberg-cpu": ElmoConfig.load(REPO / "scripts" / "gutenberg-cpu.json")}  # = ptb-small.json
CPU_SHAPES = list(SHAPES)  # the CPU's default
SHAPES["original"] = ElmoConfig.from_name("original")  # the GPU's default (--device cuda)


class TorchLstmLM(nn.Module):
    """The baseline: the same token encoder and softmax, one nn.LSTM stack per direction."""

    def __init__(self, config: ElmoConfig, vocab_size: int, dropout: float):
        super().__init__()
        lstm = config.lstm
        self.dropout = dropout
        self.token_encoder = TokenEncoder(config)
        self.stacks = nn.ModuleList(
            nn.LSTM(lstm.projection_dim, lstm.cell_dim, num_layers=lstm.n_layers, proj_size=lstm.projection_dim,
                    batch_first=True, dropout=dropout) for _ in range(2))
        self.softmax = nn.Linear(lstm.projection_dim, vocab_size)

    def forward(self, batch, state):
        char_ids = torch.stack([batch.forward_char_ids, batch.backward_char_ids])  # (D, B, U, W)
        unique_ids, inverse = torch.unique(char_ids.reshape(-1, char_ids.shape[-1]), dim=0, return_inverse=True)
        tokens = self.token_encoder(unique_ids)[inverse].view(*char_ids.shape[:-1], -1)  # (D, B, U, P)
        tokens = F.dropout(tokens, self.dropout, self.training)
        outputs, new_state = [], []
        for direction, stack in enumerate(self.stacks):
            output, final = stack(tokens[direction], None if state is None else state[direction])
            outputs.append(F.dropout(output, self.dropout, self.training))
            new_state.append(tuple(t.detach() for t in final))
        mask = batch.mask
        nll = sum(F.cross_entropy(self.softmax(out[mask]).float(), targets[mask], reduction="sum")
                  for out, targets in zip(outputs, (batch.forward_targets, batch.backward_targets)))
        return nll / (2 * max(int(mask.sum()), 1)), new_state


class Trainer:
    """One model, its optimizer and its carried state; `kernels`: ELMOKIT_KERNELS for its steps
    ("torch": torch's own products, MKL's in float32, instead of oneDNN's), or None (as set)."""

    def __init__(self, name: str, model: nn.Module, bf16: bool, kernels: str | None = None):
        self.name, self.model, self.bf16, self.kernels = name, model.train(), bf16, kernels
        fused = isinstance(model, LanguageModel)  # elmokit's trainer uses torch's fused Adam (train.build_optimizer)
        self.optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
        self.state, self.times, self.cpu_times = None, [], []

    def step(self, batch) -> None:
        kernels = {} if self.kernels is None else {elmokit_kernels.KERNELS_VARIABLE: self.kernels}
        with mock.patch.dict(os.environ, kernels):  # restored after the step, as it was
            self._step(batch)

    def _step(self, batch) -> None:
        start, start_cpu = time.perf_counter(), time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            if isinstance(self.model, LanguageModel):
                out = self.model(batch, self.state)
                loss, self.state = out.loss, out.state
            else:
                loss, self.state = self.model(batch, self.state)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 10.0)
        self.optimizer.step()
        self.times.append(time.perf_counter() - start)
        self.cpu_times.append(time.process_time() - start_cpu)  # this process's CPU time, all its threads


def unclipped(config: ElmoConfig) -> ElmoConfig:
    return dataclasses.replace(config, lstm=LSTMConfig(**{**dataclasses.asdict(config.lstm), "cell_clip": 0.0,
                                                         "proj_clip": 0.0}))


def clipped(config: ElmoConfig) -> ElmoConfig:
    return dataclasses.replace(config, lstm=LSTMConfig(**{**dataclasses.asdict(config.lstm), "cell_clip": 3.0,
                                                         "proj_clip": 3.0}))


def training_flops(config: ElmoConfig, vocab_size: int, batch) -> float:
    """FLOPs of one training step on `batch` (module docstring): forward x 3."""
    cnn, lstm = config.char_cnn, config.lstm
    encoder = 2.0 * (sum((50 - width + 1) * width * cnn.embedding_dim * count for width, count in cnn.filters)
                     + 2 * cnn.n_highway * cnn.n_filters ** 2 + cnn.n_filters * lstm.projection_dim)
    recurrence = 2.0 * lstm.n_layers * 9 * lstm.cell_dim * lstm.projection_dim  # a position, a direction
    softmax = 2.0 * lstm.projection_dim * vocab_size  # a target, a direction
    char_ids = torch.stack([batch.forward_char_ids, batch.backward_char_ids]).reshape(-1, 50)
    n_types = len(torch.unique(char_ids, dim=0))
    positions = batch.forward_char_ids.shape[0] * batch.forward_char_ids.shape[1]
    return 3.0 * (n_types * encoder + 2 * positions * recurrence + 2 * batch.n_tokens * softmax)


def bench_shape(name: str, config: ElmoConfig, vocab: Vocabulary, args) -> list[dict]:
    torch.manual_seed(0)
    trainers = [Trainer("elmokit (clip 3)", LanguageModel(clipped(config), len(vocab), dropout=0.1), args.bf16),
                Trainer("elmokit (no clip)", LanguageModel(unclipped(config), len(vocab), dropout=0.1), args.bf16),
                Trainer("nn.LSTM baseline", TorchLstmLM(config, len(vocab), dropout=0.1), args.bf16)]
    if args.lstm_bf16:  # the same model as "no clip", with bfloat16 products (`elmo train --lstm-bf16`,
        for lstm, softmax in BF16_OPTIONS:  # `--softmax-bf16`, both)
            low = LanguageModel(unclipped(config), len(vocab), dropout=0.1)
            low.recurrence = RecurrenceOptions(lstm_bf16=lstm)
            low.softmax_dtype = torch.bfloat16 if softmax else None
            trainers.insert(-1, Trainer(f"elmokit (no clip, {bf16_flags(lstm, softmax)})", low, args.bf16))
    if args.torch_kernels:  # the same model as "no clip", every product through torch's kernels (MKL's in float32)
        trainers.insert(-1, Trainer("elmokit (no clip, ELMOKIT_KERNELS=torch)",
                                    LanguageModel(unclipped(config), len(vocab), dropout=0.1), args.bf16, "torch"))
    batches = LMBatcher([PTB / "ptb.train.txt.gz"], vocab, args.batch_size, args.unroll_steps, seed=0)
    flops = []
    for _ in range(args.warmup + args.steps):
        batch = next(batches)
        flops.append(training_flops(config, len(vocab), batch))
        for trainer in trainers:
            trainer.step(batch)
    tokens = args.batch_size * args.unroll_steps
    baseline = tokens / statistics.median(trainers[-1].times[args.warmup:])
    rows = []
    for trainer in trainers:
        times = trainer.times[args.warmup:]
        speed = tokens / statistics.median(times)
        gflops = sum(flops[args.warmup:]) / sum(times) / 1e9
        rows.append({"shape": name, "model": trainer.name, "tokens_per_s": speed, "vs_baseline": speed / baseline,
                     "tokens_per_cpu_s": tokens / statistics.median(trainer.cpu_times[args.warmup:]),
                     "gflops": gflops, "flops_per_token": statistics.mean(flops) / tokens,
                     "params": sum(p.numel() for p in trainer.model.parameters())})
        print(f"{name:8s} {trainer.name:26s} {speed:8.0f} tokens/s  {speed / baseline:5.2f}x  "
              f"{gflops:6.1f} GFLOP/s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]: the GPU benchmark "
                        "(bench/train_cuda.py: eager, CUDA graphs, bf16 products, TF32, against cuDNN's nn.LSTM)")
    parser.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES),
                        help=f"default: {' '.join(CPU_SHAPES)} (original with --device cuda)")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[128, 512],
                        help="--device cuda: the rows of each measured batch")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per model (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--unroll-steps", type=int, default=20)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--lstm-bf16", action="store_true",
                        help="also train elmokit (no clip) with the LSTM's products, the softmax's, and both in "
                             "bfloat16 (elmo train --lstm-bf16, --softmax-bf16)")
    parser.add_argument("--torch-kernels", action="store_true",
                        help="also train elmokit (no clip) with ELMOKIT_KERNELS=torch: every product through torch's "
                             "kernels (MKL's in float32) instead of oneDNN's, which CPU gives which faster")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, default=None,
                        help="default: bench/results/train.md (train-cuda.md with --device cuda)")
    parser.add_argument("--note", default="", help="what else ran on the machine, for the page")
    parser.add_argument("--profile-steps", type=int, default=5,
                        help="then profile this many steps of elmokit (no clip) on the first shape: where "
                             "the time goes, by operator (0: no profile)")
    args = parser.parse_args()
    gpu = args.device.startswith("cuda")
    args.shapes = args.shapes or (["original"] if gpu else CPU_SHAPES)
    args.output = args.output or REPO / "bench" / "results" / ("train-cuda.md" if gpu else "train.md")
    if gpu:
        import train_cuda  # bench/train_cuda.py

        train_cuda.run(args, SHAPES, TorchLstmLM)
        return
    torch.set_num_threads(args.threads)
    elmokit_kernels.bound_onednn_caches(elmokit_kernels.TRAINING_CACHE_CAPACITY)  # as `elmo train`'s process
    vocab_path = Path(os.environ.get("TMPDIR", "/tmp")) / "elmokit-bench-ptb-vocab.txt"
    if not vocab_path.exists():
        make_vocab([PTB / "ptb.train.txt.gz"], vocab_path)
    vocab = Vocabulary.load(vocab_path)
    load_before = os.getloadavg()[0]
    config = SHAPES[args.shapes[0]]
    heap = heap_rows(elmokit_steps(config, vocab, args))  # then keep_freed_memory, as `elmo train`'s process
    kernels = matmul_gflops(args.threads, "cpu")  # every dtype's; the page's "of roofline" is of float32's
    print("matmul rooflines: " + ", ".join(f"{k} {v:.1f}" for k, v in kernels.items()) + " GFLOP/s", flush=True)
    rows = [row for shape in args.shapes for row in bench_shape(shape, SHAPES[shape], vocab, args)]
    profile = profile_steps(SHAPES[args.shapes[0]], vocab, args) if args.profile_steps else {}
    kernel_rows = {"products": product_rows(config.lstm.cell_dim, config.lstm.projection_dim, len(vocab),
                                            args.batch_size, args.unroll_steps),  # last: they disturbed the
                   "directions": direction_rows(config.lstm.cell_dim, config.lstm.projection_dim, args.batch_size,
                                                args.unroll_steps),
                   "maxpool": maxpool_rows(), "heap": heap}  # steps measured after them (the softmax's products)
    write_table(rows, args, kernels, load_before, os.getloadavg()[0], profile, kernel_rows)


def elmokit_steps(config: ElmoConfig, vocab: Vocabulary, args):
    """A function that takes one elmokit (no clip) training step on the next PTB window."""
    torch.manual_seed(0)
    trainer = Trainer("elmokit (no clip)", LanguageModel(unclipped(config), len(vocab), dropout=0.1), args.bf16)
    batches = LMBatcher([PTB / "ptb.train.txt.gz"], vocab, args.batch_size, args.unroll_steps, seed=2)
    return lambda: trainer.step(next(batches))


PRODUCTS = {"mkldnn::_linear_pointwise", "mkldnn::_reorder_linear_weight", "aten::mm", "aten::bmm", "aten::addmm",
            "aten::addmm_", "aten::baddbmm"}  # the products and oneDNN's weight reorders
REGIONS = {"CharConvMaxPool": "char CNN forward", "CharConvMaxPoolBackward": "char CNN backward",
           "LstmLayerFunction": "LSTM forward", "LstmLayerFunctionBackward": "LSTM backward",
           "SoftmaxNllSum": "softmax (loss and all its gradients)", "Optimizer.step#Adam.step": "Adam"}


def product_flops(name: str, shapes: list) -> float:
    """FLOPs one call of a product operator executes (2 per multiply-add), from its input shapes."""
    dims = [shape for shape in shapes if isinstance(shape, list) and shape]
    if name == "mkldnn::_linear_pointwise":  # (x, weight, bias, ...) or, with an addend, (x, addend, weight, ...)
        x, weight = shapes[0], shapes[2] if len(shapes) == 5 else shapes[1]
        return 2.0 * math.prod(x[:-1]) * x[-1] * weight[0]
    if name in ("aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_", "aten::baddbmm"):
        a, b = dims[-2], dims[-1]
        return 2.0 * math.prod(a) * b[-1]
    return 0.0


def region_times(events) -> list[tuple[str, float, float]]:
    """(region, own CPU time of everything under it, of which products) in microseconds, for the
    step's parts in REGIONS (outermost occurrences) and "everything else"."""
    def subtree(event):
        yield event
        for child in event.cpu_children:
            yield from subtree(child)

    def inside_region(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name in REGIONS:
                return True
            parent = parent.cpu_parent
        return False

    sums = {name: [0.0, 0.0] for name in [*REGIONS.values(), "everything else"]}
    for event in events:
        if event.name in REGIONS and not inside_region(event):
            for node in subtree(event):
                sums[REGIONS[event.name]][0] += node.self_cpu_time_total
                sums[REGIONS[event.name]][1] += node.self_cpu_time_total * (node.name in PRODUCTS)
    all_time = sum(event.self_cpu_time_total for event in events)
    all_products = sum(event.self_cpu_time_total for event in events if event.name in PRODUCTS)
    sums["everything else"] = [all_time - sum(t for t, _ in sums.values()),
                               all_products - sum(p for _, p in sums.values())]
    return [(name, total, products) for name, (total, products) in sums.items()]


def profile_steps(config: ElmoConfig, vocab: Vocabulary, args) -> dict:
    """Where the time of elmokit (no clip) steps goes: the 12 operators with the most own CPU time
    over `args.profile_steps` steps after 2 warm-up steps, (operator, ms a step, share), the step's
    parts (`region_times`), and the matrix products' share of the step and their own GFLOP/s (the
    FLOPs the products executed, from their recorded shapes, over the products' time)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    trainer = Trainer("elmokit (no clip)", LanguageModel(unclipped(config), len(vocab), dropout=0.1), args.bf16)
    batches = LMBatcher([PTB / "ptb.train.txt.gz"], vocab, args.batch_size, args.unroll_steps, seed=1)
    for _ in range(2):
        trainer.step(next(batches))
    windows = [next(batches) for _ in range(args.profile_steps)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # the times, without recording shapes
        for batch in windows:
            trainer.step(batch)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as shapes:  # the products' FLOPs:
        for batch in windows:  # the same windows give the same shapes as in the timed pass
            trainer.step(batch)
    flops = sum(event.count * product_flops(event.key, event.input_shapes)
                for event in shapes.key_averages(group_by_input_shape=True) if event.key in PRODUCTS)
    events = prof.key_averages()
    total = sum(event.self_cpu_time_total for event in events)
    products = sum(event.self_cpu_time_total for event in events if event.key in PRODUCTS)
    top = sorted(events, key=lambda event: event.self_cpu_time_total, reverse=True)[:12]
    per_step = lambda microseconds: microseconds / 1e3 / args.profile_steps  # noqa: E731
    return {"top": [(event.key, per_step(event.self_cpu_time_total), event.self_cpu_time_total / total)
                    for event in top],
            "regions": [(name, per_step(time), per_step(product_time))
                        for name, time, product_time in region_times(prof.events())],
            "step_ms": total / 1e3 / args.profile_steps, "products_ms": products / 1e3 / args.profile_steps,
            "products_gflops": flops / (products / 1e6) / 1e9 if products else float("nan")}


def write_table(rows: list[dict], args, kernels: dict[str, float], load_before: float, load_after: float,
                profile: dict, kernel_rows: dict) -> None:
    header = page_header("cpu", args.threads, kernels)  # the CPU, its flags and every dtype's roofline
    kernels = {name: gflops for name, gflops in kernels.items() if kernel_dtype(name) == "float32"}
    roofline = max(kernels.values())
    lines = [
        "# Training speed (bench/train.py)", "", header,
        f"Load average {load_before:.1f} before, {load_after:.1f} after. {args.note}".rstrip(),
        *([f"**oneDNN was switched off in this run** ({elmokit_kernels.switched_off()}): every row ran torch's "
           "kernels, so its elmokit rows compare nothing of oneDNN's."] if elmokit_kernels.switched_off() else []),
        f"Batch {args.batch_size} x {args.unroll_steps} tokens, full softmax over the PTB vocabulary, Adam, "
        f"clip norm 10, {'bf16 autocast' if args.bf16 else 'float32'}; median of {args.steps} steps after "
        f"{args.warmup} warm-up steps, the models stepping in turn on the same windows.",
        "fp32 matmul roofline measured in the same run (2048 x 2048, best of "
        + ", ".join(f"{k} {v:.1f}" for k, v in kernels.items()) + f"): **{roofline:.1f} GFLOP/s**. "
        "Training FLOPs a token as in the module docstring (forward + backward, the encoder counted once a "
        "distinct token type).", "",
        "| shape | model | parameters | training GFLOP a token | tokens/s | executed GFLOP/s | of roofline "
        "| vs nn.LSTM | tokens per CPU s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['shape']} | {r['model']} | {r['params'] / 1e6:.2f}M | {r['flops_per_token'] / 1e9:.4f} | "
              f"{r['tokens_per_s']:,.0f} | {r['gflops']:.1f} | {r['gflops'] / roofline:.1%} | "
              f"{r['vs_baseline']:.2f}x | {r['tokens_per_cpu_s']:,.0f} |" for r in rows]
    lines += lstm_bf16_lines(rows) if args.lstm_bf16 else []
    if profile:
        lines += ["", f"Where the time of an elmokit (no clip) step goes ({args.shapes[0]}, torch.profiler over "
                  f"{args.profile_steps} steps, own CPU time; the profiler's own cost makes these steps slower than the "
                  "timed ones). "
                  f"`mkldnn::_linear_pointwise` is every matrix product (oneDNN: the LSTM's per-step and "
                  f"all-steps products, their gradients, the softmax's logits and gradients, the char CNN's "
                  f"window products, the highway and projection): **{profile['products_ms']:.1f} of "
                  f"{profile['step_ms']:.1f} ms a step ({profile['products_ms'] / profile['step_ms']:.0%}), "
                  f"at {profile['products_gflops']:.0f} GFLOP/s** (the FLOPs they executed, from their shapes, "
                  f"over their time: {profile['products_gflops'] / roofline:.0%} of the roofline; the per-step "
                  "products have 32 rows, the char CNN's backward is a scatter-add and two small products, not "
                  "the dense backward the training FLOPs count). The rest bounds the step: elementwise work "
                  "(the gates, exp of the logits, dropout, the max-pool) and the per-operator cost of the "
                  "recurrence's 20 sequential steps a layer and direction, about 20 small operations each.",
                  "", "By part of the step (own CPU time of everything the part runs; products = oneDNN's products "
                  "and weight reorders; the rest = elementwise work and per-operator overhead):", "",
                  "| part | ms a step | products (ms) | the rest (ms) |", "|---|---:|---:|---:|"]
        lines += [f"| {name} | {ms:.1f} | {product_ms:.1f} | {ms - product_ms:.1f} |"
                  for name, ms, product_ms in profile["regions"]]
        lines += ["", "By operator (the 12 largest):", "",
                  "| operator | ms a step | share of CPU time |", "|---|---:|---:|"]
        lines += [f"| `{name}` | {ms:.1f} | {share:.1%} |" for name, ms, share in profile["top"]]
    lines += kernel_lines(args, kernel_rows)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"\nwrote {args.output}")


BF16_OPTIONS = [(True, False), (False, True), (True, True)]  # (--lstm-bf16, --softmax-bf16) rows of --lstm-bf16


def bf16_flags(lstm: bool, softmax: bool) -> str:
    return " ".join(flag for flag, on in (("--lstm-bf16", lstm), ("--softmax-bf16", softmax)) if on)


def lstm_bf16_lines(rows: list[dict]) -> list[str]:
    """What --lstm-bf16, --softmax-bf16 and both gave against float32 (the same model, no clip), in
    each shape."""
    lines = [""]
    for shape in dict.fromkeys(row["shape"] for row in rows):
        by_model = {row["model"]: row for row in rows if row["shape"] == shape}
        exact = by_model["elmokit (no clip)"]
        for lstm, softmax in BF16_OPTIONS:
            flags = bf16_flags(lstm, softmax)
            low = by_model[f"elmokit (no clip, {flags})"]
            parts = " and ".join(part for part, on in (("the LSTM's", lstm), ("the softmax's", softmax)) if on)
            lines.append(f"{shape}: `{flags}` ({parts} "
                         "products' operands in bfloat16 through oneDNN; state, gates, softmax and sums float32) "
                         f"against float32, the same model: **{low['tokens_per_s'] / exact['tokens_per_s']:.2f}x** "
                         f"tokens/s, {low['tokens_per_cpu_s'] / exact['tokens_per_cpu_s']:.2f}x tokens per CPU second "
                         "(its \"of roofline\" is of the float32 roofline).")
    return lines


def kernel_lines(args, kernel_rows: dict) -> list[str]:
    """The page's "kernels of the step" section (bench/train_kernels.py)."""
    lines = ["", f"## The kernels of the step ({args.shapes[0]}, measured in this run: bench/train_kernels.py)", "",
             "Each kind of product at the step's shape, median of 30 after 5 warm-up; *elmokit* marks the path a "
             "training step takes:", "", "| part | product | path | µs | GFLOP/s |", "|---|---|---|---:|---:|"]
    lines += [f"| {r['part']} | {r['shape']} | {r['path']} | {r['us']:,.0f} | "
              f"{'' if math.isnan(r['gflops']) else format(r['gflops'], '.0f')} |" for r in kernel_rows["products"]]
    lines += ["", "Each product of the recurrence for both directions, a direction at a time through oneDNN (two "
              "calls; the float32 recurrent weight reordered, as the step runs it) against one batched product "
              "(torch.bmm: MKL's in float32, oneDNN's in bfloat16), median after warm-up; *elmokit* marks what "
              "`elmokit.training.recurrence` runs for each dtype:", "",
              "| dtype | product | a direction at a time, µs | batched, µs | batched / a direction at a time |",
              "|---|---|---:|---:|---:|"]
    for r in kernel_rows["directions"]:
        batched_runs = r["dtype"] == "bfloat16"  # RecurrenceOptions: batched on the CPU for bfloat16 products
        mark = lambda text, chosen: f"**{text}** (elmokit)" if chosen else text  # noqa: E731
        lines.append(f"| {r['dtype']} | {r['product']} | {mark(format(r['each_us'], ',.0f'), not batched_runs)} | "
                     f"{mark(format(r['batched_us'], ',.0f'), batched_runs)} | {r['batched_us'] / r['each_us']:.2f} |")
    lines += ["", "The char CNN's max-pool with the window of each max, (64 tokens, 46 windows, 128 filters), "
              "median of 100:", "", "| path | µs |", "|---|---:|"]
    lines += [f"| {r['path']} | {r['us']:.0f} |" for r in kernel_rows["maxpool"]]
    lines += ["", "The C heap: elmokit (no clip) steps in this process, 12 after 3 warm-up, before and after "
              "`keep_freed_memory` (what `elmo train` sets; every other figure on this page was measured after it):",
              "", "| setting | minor page faults a step | ms a step |", "|---|---:|---:|"]
    lines += [f"| {r['setting']} | {r['faults']:,.0f} | {r['ms']:.1f} |" for r in kernel_rows["heap"]]
    return lines


if __name__ == "__main__":
    main()
