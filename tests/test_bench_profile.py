"""bench/profile_embed.py's bookkeeping: which kind each profiled operation counts as, and the page
it writes from a run's figures (the kinds and the time between operations add up to the wall)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def profile_embed():
    sys.path.insert(0, str(REPO / "bench"))  # its imports: bench/embed.py, bench/machine.py
    try:
        spec = importlib.util.spec_from_file_location("bench_profile_embed", REPO / "bench" / "profile_embed.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(REPO / "bench"))


@pytest.mark.parametrize("name, kind", [
    ("mkldnn::_linear_pointwise", "products"), ("onednn::qlinear_pointwise", "products"),
    ("aten::_int_mm", "products"), ("aten::addmm", "products"), ("aten::mkldnn_convolution", "char CNN convolution"),
    ("aten::sigmoid_", "elementwise and casts"), ("aten::copy_", "elementwise and casts"),
    ("aten::amax", "elementwise and casts"), ("aten::empty", "other operations"), ("aten::slice", "other operations"),
])
def test_each_operation_counts_as_its_kind(profile_embed, name, kind):
    assert profile_embed.kind_of(name) == kind


def test_the_page_splits_the_wall_time(profile_embed, tmp_path):
    result = {"dtype": "bfloat16", "wall": 10.0, "unprofiled": 9.5, "calls": 1234, "tokens": 500, "sentences": 20,
              "kinds": {"products": 6.0, "elementwise and casts": 2.5, "other operations": 0.5},
              "ops": [{"name": "mkldnn::_linear_pointwise", "shapes": "[[32, 512]]", "calls": 800, "seconds": 4.0}]}
    args = argparse.Namespace(batch_size=32, note="Nothing else ran.", output=tmp_path / "page.md")
    profile_embed.write_page(args, "Machine: a CPU. Matmul rooflines measured in this run: ...", "2026-11-27 00:00",
                             "quiet", "quiet", [result])
    page = args.output.read_text()
    assert ("| bfloat16 | 9.50 | 10.00 | 1,234 | 6.00 (60%) | 0.00 (0%) | 2.50 (25%) | 0.50 (5%) | 1.00 (10%) |"
            in page)
    assert "| mkldnn::_linear_pointwise | `[[32, 512]]` | 800 | 4.000 | 40.0% |" in page
    assert "first 20 UD English EWT dev sentences (500 tokens)" in page and "Nothing else ran." in page
    assert not list(tmp_path.glob("*.tmp"))
