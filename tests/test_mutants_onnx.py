"""What the ONNX export's check and input contract must refuse, without an export (the mutants of
`elmokit.inference.onnx_export` that tests/test_onnx.py did not kill; scripts/mutation.py): the check
compares a graph's outputs with elmokit's and must fail on a NaN, not only on a large difference;
`check_graph_input` takes exactly the ids 0..261. The "graph" here is elmokit's own inference path
on the char ids it is given (what a correct graph computes), changed where a test says, so these
tests need neither an export nor onnx or onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elmokit.inference.elmo import run_bilm, token_layers
from elmokit.inference.onnx_export import ExportableBiLM, OnnxMismatchError, check_graph_input, check_onnx
from elmokit.model.chars import N_CHAR_IDS

SENTENCES = (("The", "old", "sailor", "."), (), ("naïve", "😀"))  # mixed lengths and a row of padding


class FakeGraph:
    """An onnxruntime session's `run` (char ids (B, T, 50) -> layers (B, L+1, T, 2P), mask (B, T))
    answered by elmokit's stateless path, with `poison` applied to the layers of every batch (a
    stand-in for a graph that computes something else)."""

    def __init__(self, module: ExportableBiLM, poison=None):
        self.module, self.poison = module, poison

    def run(self, names, feeds):
        char_ids = torch.from_numpy(feeds["char_ids"])
        with torch.no_grad():
            layers = token_layers(run_bilm(self.module.bilm, char_ids, None)).numpy().copy()
        if self.poison is not None and layers.size:
            self.poison(layers)
        return [layers, (char_ids != 0).any(-1).numpy()]


def test_the_check_passes_elmokits_own_outputs_and_fails_a_nan(tiny_model):
    """Unchanged outputs pass; one NaN in the layers
    (a comparison `difference > tolerance` is False for NaN) must raise, as must a large change."""
    module = ExportableBiLM(tiny_model).eval()
    assert check_onnx("graph.onnx", module, SENTENCES, session=FakeGraph(module)) <= 1e-5

    def nan(layers):
        layers[0, -1, 0, 0] = np.nan

    with pytest.raises(OnnxMismatchError, match=r"'layers' differs from elmokit's by nan"):
        check_onnx("graph.onnx", module, SENTENCES, session=FakeGraph(module, nan))

    def shifted(layers):
        layers[..., 0] += 1e-3

    with pytest.raises(OnnxMismatchError, match=r"graph\.onnx: onnxruntime's 'layers' differs"):
        check_onnx("graph.onnx", module, SENTENCES, session=FakeGraph(module, shifted))


def test_the_default_tolerance_is_1e_5(tiny_model):
    """Issue 35's bound: every value within 1e-5 of elmokit's. A shift of 1.5e-5 fails the check
    that `export_onnx` runs with its default tolerance, 0.5e-5 passes it."""
    module = ExportableBiLM(tiny_model).eval()

    def by(amount):
        def shift(layers):
            layers[0, 0, 0, 0] += amount
        return shift

    assert check_onnx("graph.onnx", module, SENTENCES, session=FakeGraph(module, by(0.5e-5))) <= 1e-5
    with pytest.raises(OnnxMismatchError, match=r"by 1\.\d+e-05 \(> 1e-05\)"):
        check_onnx("graph.onnx", module, SENTENCES, session=FakeGraph(module, by(1.5e-5)))


@pytest.mark.parametrize("bad", [-1, N_CHAR_IDS, N_CHAR_IDS + 1, -N_CHAR_IDS])
def test_the_input_contract_is_exactly_the_ids_of_the_table(bad):
    """0 and 261 (the last row) pass; -1 and 262 and beyond are refused, naming the value."""
    ids = np.zeros((1, 2, 50), np.int64)
    ids[0, 0, :2] = (0, N_CHAR_IDS - 1)
    assert check_graph_input(ids) is not None
    ids[0, 1, 5] = bad
    with pytest.raises(ValueError, match=rf"ids must be in 0\.\.{N_CHAR_IDS - 1} .*got \[{bad}\]"):
        check_graph_input(ids)
