"""bench/fused_cell.py compares like with like: the expressions it hands to torch.compile compute
what the recurrence's own elementwise groups (`forward_cell`, `backward_cell`, `gate_factors`,
which the bench times as the eager side) compute, and both agree with the LSTM cell of spec §3
and with autograd's gradients of it."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from elmokit.training.recurrence import backward_cell, forward_cell, gate_factors

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fused_cell():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(REPO / "bench"))  # its sibling imports (train, embed, train_kernels)
        yield importlib.import_module("fused_cell")


@pytest.mark.parametrize("via_sigmoid", [None, False])  # the CPU's default, and the other devices'
def test_the_forward_groups_compute_the_lstm_cell(fused_cell, via_sigmoid):
    torch.manual_seed(0)
    n_rows, cell_dim = 3, 5
    pre = [torch.randn(n_rows, 4 * cell_dim), torch.randn(n_rows, 4 * cell_dim)]
    cell_prev = torch.randn(2, n_rows, cell_dim)
    acts, cell_next, tanh_cell, cell_output = (torch.empty(2, n_rows, 4 * cell_dim), torch.empty(2, n_rows, cell_dim),
                                               torch.empty(2, n_rows, cell_dim), torch.empty(2, n_rows, cell_dim))
    fused = fused_cell.fused_forward_cell(pre[0], pre[1], cell_prev)
    products = [gates.clone() for gates in pre]
    forward_cell(products, acts, cell_prev, cell_next, tanh_cell, cell_output, 0.0, via_sigmoid)  # may double
    # the products' candidate slot
    for eager, other in zip((acts, cell_next, tanh_cell, cell_output), fused):
        torch.testing.assert_close(eager, other)
    for product, original in zip(products, pre):  # on the CPU by default one sigmoid: the candidate doubled
        doubled = torch.cat([original[:, :3 * cell_dim], 2 * original[:, 3 * cell_dim:]], dim=1)
        assert torch.equal(product, doubled if via_sigmoid is None else original)
    i, f, o, j = torch.stack(pre).split(cell_dim, dim=-1)  # elmokit's gate order (i, f, o, j)
    expected_cell = torch.sigmoid(f) * cell_prev + torch.sigmoid(i) * torch.tanh(j)
    torch.testing.assert_close(cell_next, expected_cell)
    torch.testing.assert_close(cell_output, torch.sigmoid(o) * torch.tanh(expected_cell))


def test_the_backward_groups_agree_with_autograd(fused_cell):
    torch.manual_seed(1)
    n_rows, cell_dim = 3, 5
    pre = torch.randn(2, n_rows, 4 * cell_dim, dtype=torch.float64, requires_grad=True)
    cell_prev = torch.randn(2, n_rows, cell_dim, dtype=torch.float64, requires_grad=True)
    acts, cell, tanh_cell, cell_output = fused_cell.fused_forward_cell(pre[0], pre[1], cell_prev)
    grad_m, grad_cell_next = torch.randn_like(cell_output), torch.randn_like(cell)
    (cell_output * grad_m + cell * grad_cell_next).sum().backward()

    factors, through_tanh = gate_factors(acts.detach()[:, None], torch.stack([cell_prev.detach(), cell.detach()], 1),
                                         tanh_cell.detach()[:, None])
    factors, through_tanh = factors[:, 0], through_tanh[:, 0]  # the one step
    forget = acts.detach()[..., cell_dim:2 * cell_dim]
    step_grads = torch.empty(2, n_rows, 4, cell_dim, dtype=torch.float64)
    carried = backward_cell(grad_m, grad_cell_next, through_tanh, factors, forget, None, step_grads)
    fused_grads, fused_carried = fused_cell.fused_backward_cell(grad_m, grad_cell_next, through_tanh, factors, forget)
    torch.testing.assert_close(step_grads.view(2, n_rows, 4 * cell_dim), pre.grad)  # d loss / d pre-activations
    torch.testing.assert_close(fused_grads, step_grads)
    torch.testing.assert_close(fused_carried, carried)
    torch.testing.assert_close(carried, cell_prev.grad)  # d loss / d c_{t-1}
