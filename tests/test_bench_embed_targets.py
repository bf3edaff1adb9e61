"""bench/embed.py judges issue 56's targets from its figures: each dtype's fraction of its step
ceiling (fused cell, `original`, token cache off) and the speed ratios, each where the CPU's flags
say it applies."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _row(tokens_per_s: float, gflops: float) -> dict:
    return {"tokens_per_s": tokens_per_s, "tokens_per_cpu_s": tokens_per_s, "executed_gflops": gflops}


def test_the_targets_are_judged_from_the_fused_rows_on_the_cpu_they_apply_to(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import embed as bench_embed

    best = {("original", 32, False, "float32", "fused"): _row(1000, 90.0),
            ("original", 32, False, "bfloat16", "fused"): _row(1850, 150.0),
            ("original", 32, False, "bfloat16", "eager"): _row(2000, 190.0),  # the eager cell's rows judge nothing
            ("original", 128, False, "bfloat16", "fused"): _row(1900, 135.0)}
    ceilings = {("original", 32, "float32"): 100.0, ("original", 32, "bfloat16"): 200.0,
                ("original", 128, "bfloat16"): 200.0}
    monkeypatch.setattr(bench_embed, "cpu_fields", lambda: {"flags": "avx512f avx512_bf16 avx512_vnni"})
    lines = "\n".join(bench_embed.reading_lines(best, ceilings, [], {}))
    assert "batch 32, token cache off, float32 >= 80% of its step ceiling): **met** (90.0%)" in lines
    assert "batch 32, token cache off, bfloat16 >= 80% of its step ceiling): **NOT met** (75.0%)" in lines
    assert "batch 128, token cache off, bfloat16 >= 70% of its step ceiling): **NOT met** (67.5%)" in lines
    assert ("bfloat16 >= 1.8x float32 at `original`, batch 32, token cache off, on a CPU with AVX512-BF16 and "
            "no AMX-BF16): **met** (1.85x)") in lines
    assert "bfloat16 >= 3.0x float32 at `original`, batch 32" in lines and "not applicable on this CPU (1.85x" in lines
    monkeypatch.setattr(bench_embed, "cpu_fields", lambda: {"flags": "avx512f avx512_bf16 amx_bf16 amx_tile"})
    lines = "\n".join(bench_embed.reading_lines(best, ceilings, [], {}))
    assert "on a CPU with AMX-BF16): **NOT met** (1.85x)" in lines
    assert "on a CPU with AVX512-BF16 and no AMX-BF16): not applicable on this CPU (1.85x measured)" in lines
