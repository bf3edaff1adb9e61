"""Expected embedding throughput on a datacenter GPU, from FLOPs and memory traffic (no GPU needed):
writes the estimate section of docs/gpu.md (between its `estimate` markers) and prints it.

    .venv/bin/python bench/gpu_estimate.py                 # -> docs/gpu.md
    .venv/bin/python bench/gpu_estimate.py --output -      # print only

The model of one step of the streamed recurrence (`elmokit.inference.engine.stream_layer`: R rows, both directions,
one layer) is

    GPU time     = max(FLOPs / peak, bytes / HBM bandwidth)
                   FLOPs: the recurrent and projection products, 2 * 2 * R * 5PC
                   bytes: those weights (unless one layer's weights, both directions, fit in L2)
                          + the elementwise passes over the gates and the cell (~41 R*C float32
                          values a direction, counted from the code; 47 in bfloat16, which also
                          widens the gates to float32)
    launch time  = kernels a step * the host's cost to launch one (eager PyTorch)
    step time    = max(GPU time, launch time)   (launches are asynchronous: the slower side sets the pace)

and per position the input products (4PC a direction and layer) and the token encoder (spec §12)
run as large batched products at the compute peak. Every figure is an upper bound on speed for
this code path as it is: no CUDA graphs, no fused LSTM kernel.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed import flops_per_position  # noqa: E402  (bench/embed.py: spec §12 FLOPs)

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "gpu.md"
BEGIN, END = "<!-- estimate: written by bench/gpu_estimate.py -->", "<!-- end of estimate -->"

# NVIDIA H100 SXM5 80 GB, from NVIDIA's datasheet (dense, no sparsity). torch runs float32 matmuls
# on the CUDA cores unless torch.backends.cuda.matmul.allow_tf32 is set (off by default).
GPU = {
    "name": "NVIDIA H100 SXM5 80 GB",
    "float32_tflops": 67.0,  # FP32, CUDA cores
    "tf32_tflops": 494.7,  # TF32 tensor cores (allow_tf32=True)
    "bfloat16_tflops": 989.4,  # BF16 tensor cores
    "hbm_tb_s": 3.35,  # HBM3
    "l2_mb": 50.0,
    "launch_us": 5.0,  # assumed host-side cost of one eager kernel launch (dispatch + cudaLaunchKernel)
}
KERNELS_A_STEP = {"float32": 29, "bfloat16": 34}  # counted in inference.engine.stream_layer, clipping on
ELEMENTWISE_VALUES = {"float32": 41, "bfloat16": 47}  # float32 values read or written per row and cell unit,
# a direction and a step
ROWS = (32, 256, 1024)


def estimate(shape: str, dtype: str, rows: int) -> dict:
    from elmokit import ElmoConfig

    config = ElmoConfig.from_name(shape)
    lstm = config.lstm
    P, C, L = lstm.projection_dim, lstm.cell_dim, lstm.n_layers
    peak = GPU[f"{dtype}_tflops"] * 1e12
    weight_bytes = 2 if dtype == "bfloat16" else 4
    flops = flops_per_position(config)
    # a step of one layer, both directions
    step_flops = 2 * 2 * rows * 5 * P * C
    layer_weight_bytes = 2 * 5 * P * C * weight_bytes
    weights_from_hbm = layer_weight_bytes > GPU["l2_mb"] * 1e6
    step_bytes = (layer_weight_bytes if weights_from_hbm else 0) + 2 * ELEMENTWISE_VALUES[dtype] * rows * C * 4
    gpu_seconds = max(step_flops / peak, step_bytes / (GPU["hbm_tb_s"] * 1e12))
    launch_seconds = KERNELS_A_STEP[dtype] * GPU["launch_us"] * 1e-6
    step_seconds = max(gpu_seconds, launch_seconds)
    # per position: the recurrence (L steps of R rows) and the large products
    batched_flops = flops["encoder"] + 2 * L * 2 * 4 * P * C
    seconds_a_position = L * step_seconds / rows + batched_flops / peak
    return {
        "shape": shape, "dtype": dtype, "rows": rows, "step_us": step_seconds * 1e6,
        "bound": "launches" if launch_seconds >= gpu_seconds else (
            "compute" if step_flops / peak >= step_bytes / (GPU["hbm_tb_s"] * 1e12) else "memory"),
        "weights_mb": layer_weight_bytes / 1e6, "weights_from_hbm": weights_from_hbm,
        "positions_per_s": 1 / seconds_a_position,
        "gflop_a_position": (flops["encoder"] + flops["lstm"]) / 1e9,
    }


def report() -> str:
    lines = [
        BEGIN,
        "",
        f"Assumed GPU: {GPU['name']}: {GPU['float32_tflops']:g} TFLOP/s float32 (CUDA cores; torch's default, "
        f"TF32 off), {GPU['tf32_tflops']:g} TFLOP/s TF32 and {GPU['bfloat16_tflops']:g} TFLOP/s bfloat16 "
        f"(tensor cores, dense), {GPU['hbm_tb_s']:g} TB/s HBM3, {GPU['l2_mb']:g} MB L2; "
        f"{GPU['launch_us']:g} µs of host time to launch one kernel from eager PyTorch (an assumption); "
        f"{KERNELS_A_STEP['float32']} kernels a step of one layer in float32, {KERNELS_A_STEP['bfloat16']} in "
        f"bfloat16 (counted in `elmokit.inference.engine.stream_layer`), {ELEMENTWISE_VALUES['float32']} "
        f"float32 values of elementwise traffic per row and cell unit, a direction and a step "
        f"({ELEMENTWISE_VALUES['bfloat16']} in bfloat16, which widens the gates to float32).",
        "",
        "| shape | dtype | rows R | GFLOP a position | one layer's recurrent weights (MB) | from | step (µs) | "
        "bound by | positions/s (upper bound) |",
        "|---|---|---:|---:|---:|---|---:|---|---:|",
    ]
    for shape in ("small", "original"):
        for dtype in ("float32", "bfloat16"):
            for rows in ROWS:
                e = estimate(shape, dtype, rows)
                lines.append(f"| {shape} | {dtype} | {rows} | {e['gflop_a_position']:.3f} | {e['weights_mb']:.1f} | "
                             f"{'HBM' if e['weights_from_hbm'] else 'L2'} | {e['step_us']:.0f} | {e['bound']} | "
                             f"{e['positions_per_s']:,.0f} |")
    lines += ["", END]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=str(DOC), help="the doc whose estimate section to rewrite, or - to print")
    args = parser.parse_args()
    section = report()
    print(section)
    if args.output == "-":
        return
    path = Path(args.output)
    text = path.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        sys.exit(f"{path} has no estimate markers ({BEGIN} ... {END})")
    path.write_text(re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: section, text, flags=re.S),
                    encoding="utf-8")
    print(f"\nwrote the estimate section of {path}")


if __name__ == "__main__":
    main()
