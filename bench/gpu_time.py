"""How long the original recipe takes on a GPU, for 1B training tokens: writes the `time` section of
docs/gpu.md (between its markers) from two sources, each labelled as what it is:

    measured     bench/results/train-cuda.md (bench/train.py --device cuda, a recorded run): hours for
                 1B tokens at each measured row's tokens/s; "not measured yet" while the page says so
    arithmetic   the training FLOPs of a token of the original recipe (the `original` shape, the sampled
                 softmax's 8,192 negatives; forward + backward = 3 x forward, spec §12's counts, the
                 token encoder at every position) over a datasheet peak (bench/gpu_estimate.py's GPU):
                 the least time the arithmetic allows, not a prediction

    .venv/bin/python bench/gpu_time.py            # -> docs/gpu.md
    .venv/bin/python bench/gpu_time.py --check    # exit 1 if docs/gpu.md's section is not what this writes
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed import flops_per_position  # noqa: E402  (bench/embed.py: spec §12 FLOPs)
from gpu_estimate import GPU  # noqa: E402  (the datasheet figures the estimate uses)

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "gpu.md"
PAGE = REPO / "bench" / "results" / "train-cuda.md"
BEGIN, END = "<!-- time: written by bench/gpu_time.py -->", "<!-- end of time -->"
TOKENS = 1e9
NEGATIVES = 8192  # the original recipe's sampled softmax


def flops_a_token() -> dict[str, float]:
    """Training FLOPs of one token of the original recipe, by part (both directions, x3)."""
    from elmokit import ElmoConfig

    config = ElmoConfig.from_name("original")
    forward = flops_per_position(config)  # encoder, and the LSTM of both directions
    softmax = 2 * 2.0 * config.lstm.projection_dim * (NEGATIVES + 1)  # a target a direction: K negatives + it
    return {"encoder": 3 * forward["encoder"], "lstm": 3 * forward["lstm"], "softmax": 3 * softmax}


def measured_rows(page: Path) -> list[tuple[str, str, str, float]] | None:
    """(shape, rows, model, tokens/s) of a recorded run's table, or None while it says not measured."""
    text = page.read_text(encoding="utf-8") if page.is_file() else ""
    if "Run of " not in text:
        return None
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) >= 4 and cells[1].isdigit():
            rows.append((cells[0], cells[1], cells[2], float(cells[3].replace(",", ""))))
    return rows


def section() -> str:
    parts = flops_a_token()
    total = sum(parts.values())
    lines = [BEGIN, "", "**Measured** (`bench/results/train-cuda.md`, written by `bench/train.py --device cuda`; "
             "its softmax is the full one over its corpus's vocabulary, about the work of the recipe's 8,192 "
             "negatives):", ""]
    rows = measured_rows(PAGE)
    if rows is None:
        lines.append("Not measured yet: no GPU has run `bash scripts/gpu_check.sh`.")
    else:
        page = PAGE.read_text(encoding="utf-8").splitlines()
        run = next(line for line in page if line.startswith("Run of "))
        gpu = next((line.removeprefix("Machine: ").split(". ")[0] for line in page if line.startswith("Machine: ")), "")
        lines += [run.split(". ")[0] + (f" on {gpu}" if gpu else "") + ".", "", "| shape | rows | model | tokens/s | hours for 1B tokens |",
                  "|---|---:|---|---:|---:|"]
        lines += [f"| {shape} | {n} | {model} | {speed:,.0f} | {TOKENS / speed / 3600:.1f} |"
                  for shape, n, model, speed in rows]
    lines += ["", f"**Arithmetic, not a measurement**: a training token of the original recipe is "
              f"{total / 1e9:.2f} GFLOP (the LSTM {parts['lstm'] / 1e9:.2f}, the sampled softmax "
              f"{parts['softmax'] / 1e9:.3f}, the token encoder at every position {parts['encoder'] / 1e9:.2f}; "
              "elmokit runs the encoder once a distinct token of a window, so less), so 1B tokens are "
              f"{total * TOKENS / 1e18:.2f} EFLOP. At the full datasheet peak of an {GPU['name']}, which no "
              "recurrence reaches, that takes at least:", "",
              "| products in | peak (TFLOP/s) | hours for 1B tokens, at the peak |", "|---|---:|---:|"]
    rest = total - parts["lstm"]
    float32, tf32, bf16 = (GPU[key] * 1e12 for key in ("float32_tflops", "tf32_tflops", "bfloat16_tflops"))
    for name, peak, seconds in (
            ("float32 (CUDA cores; elmokit's default)", f"{GPU['float32_tflops']:g}", total / float32),
            ("TF32 (`--tf32`: every float32 product)", f"{GPU['tf32_tflops']:g}", total / tf32),
            ("bfloat16 for the LSTM (`--lstm-bf16`), float32 for the rest",
             f"{GPU['bfloat16_tflops']:g} / {GPU['float32_tflops']:g}", parts["lstm"] / bf16 + rest / float32)):
        lines.append(f"| {name} | {peak} | {seconds * TOKENS / 3600:.2f} |")
    lines += ["", END]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/gpu.md's section differs")
    args = parser.parse_args()
    text = DOC.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        sys.exit(f"{DOC} has no time markers ({BEGIN} ... {END})")
    new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: section(), text, flags=re.S)
    if args.check:
        sys.exit(0 if new == text else f"{DOC}'s time section is out of date: run bench/gpu_time.py")
    DOC.write_text(new, encoding="utf-8")
    print(section())


if __name__ == "__main__":
    main()
