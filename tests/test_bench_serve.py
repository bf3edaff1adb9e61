"""bench/serve.py's bound of a closed loop (`closed_loop_rows`): the rows that clients who wait for
each answer let a server keep busy, checked against loads worked out by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench_serve():
    saved = list(sys.path)  # bench/serve.py puts bench/ on the path for its imports: taken off again after, or
    try:  # bench/onnx.py would shadow the onnx package for every later test
        spec = importlib.util.spec_from_file_location("bench_serve", REPO / "bench" / "serve.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path[:] = saved


def sentences(*lengths: int) -> list[list[str]]:
    return [["w"] * length for length in lengths]


@pytest.mark.parametrize("lengths, per_request, clients, rows", [
    # one client, one sentence a request: the one row is busy at every step
    ((5, 1, 7), "1", 1, 1.0),
    # one client, 2 a request: [1, 3] busy 2 + 4 steps over 4, then [2, 2] 3 + 3 over 3: 12 row-steps in 7 steps
    ((1, 3, 2, 2), "2", 1, 12 / 7),
    # two clients: 4 steps (client A), 2 then 2 (client B, its second request at step 2): 8 row-steps in 4 steps
    ((3, 1, 1), "1", 2, 2.0),
    # more clients than requests: both start at step 0, the longer ends at step 4: 6 row-steps in 4 steps
    ((3, 1), "1", 4, 1.5),
])
def test_closed_loop_rows_is_the_busy_row_steps_over_the_steps(bench_serve, lengths, per_request, clients, rows):
    assert bench_serve.closed_loop_rows(sentences(*lengths), per_request, clients) == pytest.approx(rows)
