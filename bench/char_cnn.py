"""The token encoder's char CNN at inference: how many tokens a pass, and its max over windows.

`elmokit.model.encoder.CharCNN` runs each convolution as one product over all its windows
(`window_products`) for `CharCNN.CHUNK` tokens at a time, then takes the max over the windows
(`window_max`). This program times, on the `original` shape (random weights, seed 0) over the
tokens of UD English EWT dev (synthetic words where the shared data is absent):

1. the whole char CNN (no gradients) in float32 and bfloat16 at several tokens a pass, with its
   executed GFLOP/s and their fraction of the same run's matmul roofline of that dtype;
2. the max over the windows of one pass's products, per convolution width: torch's `amax` in the
   products' dtype against the bfloat16 products widened to float32 first (what `window_max` does
   below `NARROW_MAX_FILTERS` filters).

Every configuration runs in turn in each of `--repeats` rounds; the fastest is kept. Writes
bench/results/char-cnn.md (replaced: one run, one page).

    .venv/bin/python bench/char_cnn.py [--threads 2] [--limit 500] [--note "what else ran"]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from embed import REPO, _model, bench_sentences  # bench/embed.py
from machine import busy_processes, matmul_gflops, page_header, replace_page, rooflines  # bench/machine.py

from elmokit.model import encoder
from elmokit.model.chars import tokens_to_char_ids

CHUNKS = (16, 32, 64, 128)
DTYPES = (torch.float32, torch.bfloat16)


def char_cnn_flops(cnn: encoder.CharCNN, n_chars: int) -> int:
    """Multiply-adds x 2 of the window products of one token (the max and the embedding aside)."""
    return sum(2 * (n_chars - conv.kernel_size[0] + 1) * conv.in_channels * conv.kernel_size[0] * conv.out_channels
               for conv in cnn.convolutions)


def best_seconds(call, rounds: int) -> float:
    call()  # oneDNN builds its primitives at the first call
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def time_passes(ids: torch.Tensor, repeats: int) -> dict[tuple[torch.dtype, int], float]:
    """Seconds for the whole char CNN over `ids`, by (dtype, tokens a pass), rounds interleaved."""
    cnns = {dtype: _model("original").to(dtype).eval().token_encoder.char_cnn for dtype in DTYPES}
    default = encoder.CharCNN.CHUNK
    seconds: dict[tuple[torch.dtype, int], float] = {}
    try:
        with torch.no_grad():
            for _ in range(repeats):
                for dtype, cnn in cnns.items():
                    for chunk in CHUNKS:
                        encoder.CharCNN.CHUNK = chunk
                        took = best_seconds(lambda cnn=cnn: cnn(ids), 1)
                        seconds[dtype, chunk] = min(seconds.get((dtype, chunk), float("inf")), took)
    finally:
        encoder.CharCNN.CHUNK = default
    return seconds


def time_maxes(ids: torch.Tensor, repeats: int) -> list[tuple[int, int, float, float, float]]:
    """Per convolution: (width, filters, float32 amax, bfloat16 amax, bfloat16 widened) in
    microseconds, over the window products of one pass of `CharCNN.CHUNK` tokens."""
    cnn = _model("original").eval().token_encoder.char_cnn
    chunk = ids[:encoder.CharCNN.CHUNK]
    with torch.no_grad():
        chars = torch.nn.functional.embedding(chunk, cnn.char_embedding.weight)
        kernels = encoder.flat_kernels([conv.weight for conv in cnn.convolutions])
        products = list(encoder.window_products(chars, kernels))
    rows = []
    for conv, float32 in zip(cnn.convolutions, products, strict=True):
        bfloat16 = float32.to(torch.bfloat16)
        calls = 50
        timed = [best_seconds(lambda call=call: [call() for _ in range(calls)], repeats * 3) / calls * 1e6
                 for call in (lambda: float32.amax(dim=1), lambda: bfloat16.amax(dim=1),
                              lambda: bfloat16.float().amax(dim=1).to(torch.bfloat16))]
        rows.append((conv.kernel_size[0], conv.out_channels, *timed))
    return rows


def write_page(args, header: str, kernels: dict[str, float], seconds, maxes, tokens: int, flops: int,
               loads: tuple[str, str]) -> str:
    roofline = rooflines(kernels)
    lines = [
        "# The char CNN at inference (`bench/char_cnn.py`)",
        "",
        header,
        f"Run of {time.strftime('%Y-%m-%d %H:%M')}; `original` shape (random weights, seed 0), {tokens:,} tokens "
        f"({'UD English EWT dev' if args.ud_dev else 'synthetic words'}), no gradients; the fastest of "
        f"{args.repeats} interleaved rounds. {args.note}".rstrip(),
        "",
        f"Machine load: before, {loads[0]}. After, {loads[1]}.",
        "",
        "## The whole char CNN by tokens a pass (`CharCNN.CHUNK`; the library's is "
        f"{encoder.CharCNN.CHUNK})",
        "",
        f"Executed work: {flops / 1e6:.1f} MFLOP a token (the window products).",
        "",
        "| dtype | tokens a pass | seconds | tokens/s | GFLOP/s | of roofline |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for (dtype, chunk), took in seconds.items():
        name = str(dtype).removeprefix("torch.")
        gflops = tokens * flops / took / 1e9
        lines.append(f"| {name} | {chunk} | {took:.3f} | {tokens / took:,.0f} | {gflops:.1f} | "
                     f"{gflops / roofline[name]:.1%} |")
    lines += [
        "",
        f"## The max over windows, one pass of {encoder.CharCNN.CHUNK} tokens (microseconds a call)",
        "",
        f"`window_max` widens bfloat16 products of fewer than {encoder.NARROW_MAX_FILTERS} filters.",
        "",
        "| width | filters | float32 amax | bfloat16 amax | bfloat16 widened, amax, narrowed |",
        "|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {width} | {filters} | {f32:.1f} | {bf16:.1f} | {widened:.1f} |"
              for width, filters, f32, bf16, widened in maxes]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=500, help="first N UD dev sentences (default 500)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "char-cnn.md")
    parser.add_argument("--note", default="", help="what else ran on the machine, for the page")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from embed import UD_DEV

    args.ud_dev = UD_DEV.is_file()
    before = busy_processes()
    kernels = matmul_gflops(args.threads, "cpu", repeats=4, trials=3)
    header = page_header("cpu", args.threads, kernels)
    words = [word for sentence in bench_sentences(args.limit) for word in sentence]
    ids = torch.as_tensor(tokens_to_char_ids(words)).long()  # (N, 50)
    flops = char_cnn_flops(_model("original").token_encoder.char_cnn, ids.shape[1])
    seconds = time_passes(ids, args.repeats)
    maxes = time_maxes(ids, args.repeats)
    page = write_page(args, header, kernels, seconds, maxes, len(words), flops, (before, busy_processes()))
    print(page)
    replace_page(args.output, page)


if __name__ == "__main__":
    main()
