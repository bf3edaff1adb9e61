"""The kernels of a training step, measured one by one (bench/train.py writes them on its page).

    products      each kind of product a gutenberg-cpu step runs, at its shape: torch's plain
                  product (MKL on the CPU) against oneDNN as elmokit.kernels runs it (and, for
                  `kernels.matmul`, the orientation it does not choose; for the recurrent
                  product, with its weight reordered, and what the reorder costs once)
    directions    each product of the recurrence for both directions, float32 and bfloat16: a
                  direction at a time through oneDNN (two calls) against one batched product
                  (torch.bmm: MKL's in float32, oneDNN's in bfloat16), what decides which
                  `elmokit.training.recurrence` runs for each dtype
    max-pool      torch.max(dim=1) with indices against `max_over_windows` on the char CNN's
                  window products (64 tokens, 46 windows, 128 filters)
    heap          minor page faults and time of elmokit steps before and after
                  `keep_freed_memory` (glibc's mmap and trim thresholds), in this process

Every figure is the median of timed repeats after warm-up, on the threads the caller set.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from elmokit import kernels
from elmokit.model.encoder import max_over_windows
from elmokit.training.processes import keep_freed_memory


def median_us(run: Callable[[], object], repeats: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def product_rows(cell_dim: int, projection_dim: int, vocab_size: int, rows: int, steps: int) -> list[dict]:
    """(part, product, path, microseconds, GFLOP/s) for each kind of product of a training step."""
    torch.manual_seed(0)
    positions = rows * steps
    linear = kernels._onednn_linear  # oneDNN's op as elmokit.kernels calls it (x w^T)
    measured = []

    def add(part: str, shape: str, flops: float, paths: dict[str, Callable[[], object]]) -> None:
        for path, run in paths.items():
            microseconds = median_us(run)
            measured.append({"part": part, "shape": shape, "path": path, "us": microseconds,
                             "gflops": flops / microseconds / 1e3})

    hidden, gates = torch.randn(rows, projection_dim), torch.randn(rows, 4 * cell_dim)
    recurrent = torch.randn(4 * cell_dim, projection_dim)
    packed = kernels._onednn_reorder(recurrent, rows)
    add("LSTM step, forward", f"({rows}, {projection_dim}) x ({projection_dim}, {4 * cell_dim}) + G_t",
        2.0 * rows * projection_dim * 4 * cell_dim,
        {"MKL (addmm)": lambda: torch.addmm(gates, hidden, recurrent.T),
         "oneDNN": lambda: kernels._onednn_add_linear(gates, hidden, recurrent),
         "oneDNN, weight reordered (elmokit)": lambda: kernels._onednn_add_linear(gates, hidden, packed)})
    measured.append({"part": "LSTM step, forward", "shape": "reordering that weight, once a pass", "path": "oneDNN",
                     "us": median_us(lambda: kernels._onednn_reorder(recurrent, rows)), "gflops": float("nan")})
    add("LSTM step, backward", f"({rows}, {4 * cell_dim}) x ({4 * cell_dim}, {projection_dim})",
        2.0 * rows * projection_dim * 4 * cell_dim,
        {"MKL (mm)": lambda: torch.mm(gates, recurrent),
         "oneDNN, weight as it is (elmokit)": lambda: linear(gates, recurrent.mT, None)})
    measured.append({"part": "LSTM step, backward", "shape": "reordering W_rec^T (a transposed view)",
                     "path": "oneDNN", "us": median_us(lambda: kernels._onednn_reorder(recurrent.mT, rows)),
                     "gflops": float("nan")})

    def matmul_paths(a: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], object]]:
        chosen_flipped = kernels.matmul_flipped(a, b)
        orientations = {False: lambda: linear(a, b.mT, None), True: lambda: linear(b.mT, a, None).mT}
        return {"MKL (mm)": lambda: torch.mm(a, b),
                "oneDNN, kernels.matmul's orientation (elmokit)": orientations[chosen_flipped],
                "oneDNN, the other orientation": orientations[not chosen_flipped]}

    grad_gates, layer_input = torch.randn(positions, 4 * cell_dim), torch.randn(positions, projection_dim)
    add("LSTM all steps, weight gradient", f"({4 * cell_dim}, {positions}) x ({positions}, {projection_dim})",
        2.0 * positions * projection_dim * 4 * cell_dim, matmul_paths(grad_gates.mT, layer_input))
    add("LSTM all steps, input gradient", f"({positions}, {4 * cell_dim}) x ({4 * cell_dim}, {projection_dim})",
        2.0 * positions * projection_dim * 4 * cell_dim, matmul_paths(grad_gates, recurrent))
    weight, bias = torch.randn(vocab_size, projection_dim) * 0.1, torch.zeros(vocab_size)
    probabilities = torch.softmax(torch.randn(positions, vocab_size), dim=1)
    add("softmax, logits", f"({positions}, {projection_dim}) x ({projection_dim}, {vocab_size}) + b",
        2.0 * positions * projection_dim * vocab_size,
        {"MKL (F.linear)": lambda: F.linear(layer_input, weight, bias),
         "oneDNN (elmokit)": lambda: linear(layer_input, weight, bias)})
    add("softmax, weight gradient", f"({vocab_size}, {positions}) x ({positions}, {projection_dim})",
        2.0 * positions * projection_dim * vocab_size, matmul_paths(probabilities.mT, layer_input))
    add("softmax, hidden gradient", f"({positions}, {vocab_size}) x ({vocab_size}, {projection_dim})",
        2.0 * positions * projection_dim * vocab_size, matmul_paths(probabilities, weight))
    return measured


def direction_rows(cell_dim: int, projection_dim: int, rows: int, steps: int) -> list[dict]:
    """(dtype, product, microseconds a direction at a time, batched) for each product of the
    recurrence, both directions (D = 2), each direction's weight as the training step holds it."""
    torch.manual_seed(0)
    n_dirs, positions, gates_dim = 2, rows * steps, 4 * cell_dim
    linear = kernels._onednn_linear
    measured = []
    for dtype in (torch.float32, torch.bfloat16):
        def tensor(*shape):
            return torch.randn(n_dirs, *shape).to(dtype)

        hidden, step_grads, cell_output, grad_hidden = (tensor(rows, projection_dim), tensor(rows, gates_dim),
                                                        tensor(rows, cell_dim), tensor(rows, projection_dim))
        layer_input, grad_gates = tensor(positions, projection_dim), tensor(positions, gates_dim)
        outputs, grad_hiddens = tensor(positions, cell_dim), tensor(positions, projection_dim)
        weight, projection = tensor(gates_dim, projection_dim), tensor(projection_dim, cell_dim)  # (4C, P), (P, C)
        packed = [kernels._onednn_reorder(weight[d], rows) for d in range(n_dirs)] if dtype == torch.float32 else None
        cases = [  # (product, a direction at a time, batched)
            (f"step, recurrent: ({rows}, {projection_dim}) x ({projection_dim}, {gates_dim})",
             lambda: [linear(hidden[d], (weight if packed is None else packed)[d], None) for d in range(n_dirs)],
             lambda: torch.bmm(hidden, weight.mT)),
            (f"step, projection: ({rows}, {cell_dim}) x ({cell_dim}, {projection_dim})",
             lambda: [linear(cell_output[d], projection[d], None) for d in range(n_dirs)],
             lambda: torch.bmm(cell_output, projection.mT)),
            (f"step, backward through the projection: ({rows}, {projection_dim}) x ({projection_dim}, {cell_dim})",
             lambda: [linear(grad_hidden[d], projection[d].mT, None) for d in range(n_dirs)],
             lambda: torch.bmm(grad_hidden, projection)),
            (f"step, backward through W_rec: ({rows}, {gates_dim}) x ({gates_dim}, {projection_dim})",
             lambda: [linear(step_grads[d], weight[d].mT, None) for d in range(n_dirs)],
             lambda: torch.bmm(step_grads, weight)),
            (f"all steps, gate inputs: ({positions}, {projection_dim}) x ({projection_dim}, {gates_dim})",
             lambda: [linear(layer_input[d], weight[d], None) for d in range(n_dirs)],
             lambda: torch.bmm(layer_input, weight.mT)),
            (f"all steps, input gradient: ({positions}, {gates_dim}) x ({gates_dim}, {projection_dim})",
             lambda: [kernels.matmul(grad_gates[d], weight[d]) for d in range(n_dirs)],
             lambda: torch.bmm(grad_gates, weight)),
            (f"all steps, weight gradient: ({gates_dim}, {positions}) x ({positions}, {projection_dim})",
             lambda: [kernels.matmul(grad_gates[d].mT, layer_input[d]) for d in range(n_dirs)],
             lambda: torch.bmm(grad_gates.mT, layer_input)),
            (f"all steps, projection gradient: ({projection_dim}, {positions}) x ({positions}, {cell_dim})",
             lambda: [kernels.matmul(grad_hiddens[d].mT, outputs[d]) for d in range(n_dirs)],
             lambda: torch.bmm(grad_hiddens.mT, outputs)),
        ]
        for product, each, batched in cases:
            repeats = 200 if product.startswith("step") else 30
            measured.append({"dtype": str(dtype).removeprefix("torch."), "product": product,
                             "each_us": median_us(each, repeats, 20), "batched_us": median_us(batched, repeats, 20)})
    return measured


def maxpool_rows(tokens: int = 64, windows: int = 46, filters: int = 128) -> list[dict]:
    """The char CNN's max-pool with the window of each max: torch.max(dim=1) against
    `max_over_windows`, on (tokens, windows, filters) window products."""
    products = torch.randn(tokens, windows, filters)
    return [{"path": path, "us": median_us(run, repeats=100)} for path, run in
            (("torch.max(dim=1)", lambda: products.max(dim=1)), ("max_over_windows (elmokit)",
                                                                lambda: max_over_windows(products)))]


def heap_rows(step: Callable[[], None], steps: int = 12) -> list[dict]:
    """Minor page faults and milliseconds a step of `step`, with glibc's defaults and then after
    `keep_freed_memory` (which cannot be undone: call this before anything else sets it)."""
    measured = []
    for setting in ("glibc's defaults", "keep_freed_memory (elmo train)"):
        if setting.startswith("keep"):
            keep_freed_memory()
        for _ in range(3):
            step()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        for _ in range(steps):
            step()
        measured.append({"setting": setting, "ms": (time.perf_counter() - start) / steps * 1e3,
                         "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps})
    return measured
