"""The LSTM cell's compiled pass (elmokit.model.fused_cell) against the eager cell it replaces
(elmokit.model.cell), in every kind it takes, and how it is built, cached, checked and refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from elmokit.model import cell as lstm_cell
from elmokit.model import fused_cell
from elmokit.model.int8 import Int8Linear, int8_native
from elmokit.model.lstm import LstmState

REPO = Path(__file__).resolve().parents[1]

if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
    pytest.skip("no C++ compiler here: the fused cell cannot be built (the eager cell runs)", allow_module_level=True)


@pytest.fixture(autouse=True)
def runs_here():
    assert fused_cell.available(), fused_cell.status()


def eager(gates: torch.Tensor, previous: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's eager cell: gates (i, f, o, 2j) widened to float32, one sigmoid, tanh via sigmoid."""
    acts = lstm_cell.activate_doubled_gates_(gates.to(torch.float32, copy=True))
    return lstm_cell.cell_step(acts, previous.clone(), clip, tanh=lstm_cell.tanh_via_sigmoid)


@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("output_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cell_dim,clip", [(1, 7, 0.0), (5, 700, 3.0), (32, 1024, 0.5)])
def test_the_fused_cell_is_the_eager_cell(gate_dtype, output_dtype, rows, cell_dim, clip):
    generator = torch.Generator().manual_seed(rows)
    gates = (torch.randn(rows, 4 * cell_dim, generator=generator) * 5).to(gate_dtype)
    previous = torch.randn(rows, cell_dim, generator=generator) * 4
    cell, output = previous.clone(), torch.full((rows, cell_dim), float("nan"), dtype=output_dtype)
    assert fused_cell.cell_(gates, cell, output, clip)
    expected_cell, expected_output = eager(gates, previous, clip)
    torch.testing.assert_close(cell, expected_cell, rtol=0, atol=2e-6)
    if output_dtype == torch.float32:
        torch.testing.assert_close(output, expected_output, rtol=0, atol=2e-6)
    else:  # one bfloat16 rounding of values a few float32 ulps apart: equal, or one bfloat16 step apart
        apart = (output.float() - expected_output.to(output_dtype).float()).abs()
        assert (apart <= torch.clamp(expected_output.abs() * 2 ** -7, min=1e-6)).all(), apart.max()
    if clip:
        assert cell.abs().max() <= clip and (cell.abs() == clip).any()  # the clip held and bit


def test_gates_with_a_row_stride_are_read_in_place():
    generator = torch.Generator().manual_seed(1)
    wide = torch.randn(3, 4 * 16 + 5, generator=generator)
    gates = wide[:, :64]  # rows 69 apart
    previous = torch.randn(3, 16, generator=generator)
    cell, output = previous.clone(), torch.empty(3, 16)
    assert fused_cell.cell_(gates, cell, output, 0.0)
    torch.testing.assert_close(output, eager(gates, previous, 0.0)[1], rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_terms_are_added_in_float32_as_they_are_read(dtype):
    """The engine's step (`cell_`'s addend): the recurrent product and the gate inputs, each in the
    products' dtype and with rows apart by their own strides, give the eager cell on their float32
    sum, not on the sum rounded to their dtype (in bfloat16 that rounding alone is ~100x the
    tolerance here)."""
    generator = torch.Generator().manual_seed(3)
    rows, cell_dim = 6, 300
    product = (torch.randn(rows, 4 * cell_dim + 9, generator=generator) * 3).to(dtype)[:, :4 * cell_dim]
    addend = (torch.randn(rows, 4 * cell_dim + 2, generator=generator) * 3).to(dtype)[:, 1:4 * cell_dim + 1]
    previous = torch.randn(rows, cell_dim, generator=generator) * 2
    cell, output = previous.clone(), torch.empty(rows, cell_dim)
    assert fused_cell.cell_(product, cell, output, 3.0, addend=addend)
    summed = product.float() + addend.float()
    expected_cell, expected_output = eager(summed, previous, 3.0)
    torch.testing.assert_close(cell, expected_cell, rtol=0, atol=2e-6)
    torch.testing.assert_close(output, expected_output, rtol=0, atol=2e-6)
    if dtype == torch.bfloat16:  # the sum rounded once more (one product with its addend) is told apart
        rounded_output = eager(summed.to(dtype), previous, 3.0)[1]
        assert (rounded_output - output).abs().max() > 100 * 2e-6


def test_what_it_does_not_take_is_refused_untouched():
    previous = torch.randn(2, 8)
    cell, output = previous.clone(), torch.zeros(2, 8)
    assert not fused_cell.cell_(torch.randn(2, 32, dtype=torch.float64), cell, output, 0.0)  # a dtype it has no pass for
    assert not fused_cell.cell_(torch.randn(32, 2).T, cell, output, 0.0)  # columns not contiguous
    assert not fused_cell.cell_(torch.randn(2, 32), cell.T.contiguous().T, output, 0.0)
    assert not fused_cell.cell_(torch.randn(2, 36), cell, output, 0.0)  # gates of another width: never read past them
    assert not fused_cell.cell_(torch.randn(3, 32), cell, output, 0.0)  # another row count
    for addend in (torch.randn(2, 32, dtype=torch.bfloat16), torch.randn(2, 36)[:, :28], torch.randn(32, 2).T):
        assert not fused_cell.cell_(torch.randn(2, 32), cell, output, 0.0, addend=addend)  # dtype, width, layout
    sums, scales, weights = torch.zeros(2, 32, dtype=torch.int32), torch.ones(2, 1), torch.ones(1, 32)
    bias = torch.zeros(32)
    assert not fused_cell.cell_int8_((sums, torch.ones(1, 1), weights), (sums, scales, weights), bias, cell, output, 0.0)
    assert not fused_cell.cell_int8_((sums, scales, weights), (sums[:1], scales, weights), bias, cell, output, 0.0)
    assert not fused_cell.cell_int8_((sums, scales, weights), (sums.float(), scales, weights), bias, cell, output, 0.0)
    wide = torch.zeros(2, 40, dtype=torch.int32)[:, :32]  # rows 40 apart: the int8 pass reads rows 4C apart
    assert not fused_cell.cell_int8_((wide, scales, weights), (sums, scales, weights), bias, cell, output, 0.0)
    assert torch.equal(cell, previous) and not output.any()
    assert fused_cell.cell_int8_((sums, scales, weights), (sums, scales, weights), bias, cell, output, 0.0)  # the control


@pytest.mark.skipif(not int8_native(), reason="needs a CPU with int8 dot products (VNNI or AMX-INT8)")
@pytest.mark.parametrize("kernel", ["int_mm", "onednn"])
def test_int8_gates_are_scaled_as_int8linear_scales_them(kernel, monkeypatch):
    """The two products' sums scaled inside the cell give Int8Linear's own gates (its call with the
    bias, then `add`) through the eager cell, with either kernel's form of the product."""
    monkeypatch.setenv("ELMOKIT_INT8_KERNEL", kernel)
    generator = torch.Generator().manual_seed(2)
    rows, dim, cell_dim = 6, 48, 40
    products = [Int8Linear(torch.randn(4 * cell_dim, dim, generator=generator), rows) for _ in "ab"]
    x, h = (torch.randn(rows, dim, generator=generator) for _ in "xh")
    bias = torch.randn(4 * cell_dim, generator=generator)
    previous = torch.randn(rows, cell_dim, generator=generator) * 2
    gates = products[1].add(products[0](x, bias), h)
    cell, output = previous.clone(), torch.empty(rows, cell_dim)
    forms = [products[0].unscaled(x), products[1].unscaled(h)]
    assert (forms[0][2] is None) == (kernel == "onednn")  # oneDNN's product arrives scaled by the weight
    assert fused_cell.cell_int8_(forms[0], forms[1], bias, cell, output, 3.0)
    expected_cell, expected_output = eager(gates, previous, 3.0)
    torch.testing.assert_close(cell, expected_cell, rtol=0, atol=2e-6)
    torch.testing.assert_close(output, expected_output, rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"] + (["int8"] if int8_native() else []))
def test_the_embedder_gives_the_eager_numbers(dtype, monkeypatch):
    """The whole engine with the fused cell against the same engine with the eager one: float32 to
    float32 rounding, bfloat16 and int8 within one bfloat16 rounding of the projection's input."""
    from elmokit import ElmoEmbedder

    sentences = [["The", "cat", "sat", "."], ["A", "much", "longer", "sentence", "than", "that", "one", "."], ["Hi"]]
    embedder = ElmoEmbedder(dtype=torch.bfloat16 if dtype == "bfloat16" else dtype, cache_tokens=False)
    fused = embedder.embed_many(sentences)
    monkeypatch.setitem(fused_cell._STATE, "library", None)
    eager_vectors = embedder.embed_many(sentences)
    tolerance = 2e-5 if dtype == "float32" else 2e-2
    for got, expected in zip(fused, eager_vectors):
        np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance)
    if dtype == "float32":
        assert max(np.abs(g - e).max() for g, e in zip(fused, eager_vectors)) > 0  # the fused pass really ran


def _python(code: str, cache: Path, **environment: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ELMOKIT_CACHE": str(cache), "PYTHONPATH": str(REPO / "src"), **environment}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


STATUS = "from elmokit.model import fused_cell; print(fused_cell.status())"


def test_built_once_then_loaded_by_later_processes(tmp_path):
    first = _python(STATUS, tmp_path)
    assert first.returncode == 0 and "(True, 'loaded from " in first.stdout, first.stderr
    [library] = (tmp_path / ".kernels").glob("*/lstm_cell.so")
    built = library.stat().st_mtime_ns
    second = _python(STATUS, tmp_path)
    assert str(library) in second.stdout and library.stat().st_mtime_ns == built
    assert not [path for path in library.parent.iterdir() if path.name.startswith(".build-")]  # no leftovers


def test_no_compiler_is_one_warning_and_the_eager_cell(tmp_path):
    code = ("import warnings, torch; warnings.simplefilter('always')\n"
            "from elmokit.model import fused_cell\n"
            "g, c, o = torch.zeros(1, 8), torch.zeros(1, 2), torch.zeros(1, 2)\n"
            "print(fused_cell.cell_(g, c, o, 0.0), fused_cell.cell_(g, c, o, 0.0))")
    done = _python(code, tmp_path, CXX="no-such-compiler")
    assert done.returncode == 0 and done.stdout.strip() == "False False", done.stderr
    assert done.stderr.count("the LSTM cell's compiled pass does not run (no C++ compiler: set CXX or install g++)") == 1
    assert not (tmp_path / ".kernels").exists()


def test_switched_off_says_nothing(tmp_path):
    done = _python("import warnings; warnings.simplefilter('error')\n" + STATUS, tmp_path, ELMOKIT_FUSED_CELL="0")
    assert done.returncode == 0 and done.stdout.strip() == "(False, 'off')", done.stderr


def test_a_pass_that_computes_something_else_is_refused(tmp_path, monkeypatch):
    """The self-check at load: a source whose cell output forgets tanh is caught and switched off."""
    wrong = fused_cell._source().replace(b"(sigmoid(2.0f * next) * 2.0f - 1.0f)", b"next")
    assert wrong != fused_cell._source()
    monkeypatch.setenv("ELMOKIT_CACHE", str(tmp_path))
    monkeypatch.setattr(fused_cell, "_source", lambda: wrong)
    monkeypatch.setattr(fused_cell, "_STATE", {})
    with pytest.warns(RuntimeWarning, match=r"compiled pass does not run \(it differs from the eager cell "
                                            r"\(torch.float32 gates, torch.float32 output: cell off by [0-9.]+e-0[67], output by [0-9.]+e"
                                            r"[-+]0[01]\)"):
        assert not fused_cell.available()


@pytest.mark.parametrize("clip, lstm_bf16, batched", [(0.0, False, None), (0.05, False, None), (0.05, True, None),
                                                     (0.05, True, False), (0.0, False, True)])
def test_training_steps_give_the_eager_cells_values_and_gradients(clip, lstm_bf16, batched, monkeypatch):
    """The training recurrence (forward and backward through time) with the compiled passes against
    the same recurrence with the eager cell, float32 (or its products in bfloat16, `--lstm-bf16`:
    the bias, G_t and the recurrent product added inside the pass, m_t and the gates' gradients
    written in bfloat16 by it), both directions' products batched or a direction at a time, from a
    carried state, clipped (0.05 binds often with these weights) or not: outputs, final state and
    every gradient within float32 rounding; the compiled passes really ran (counted)."""
    from tests.test_lm import recurrence_case
    from elmokit.training.recurrence import RecurrenceOptions, forward_streams

    if lstm_bf16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("--lstm-bf16 needs native bfloat16 products (AVX512-BF16 or AMX)")

    lstm, inputs, state, weights = recurrence_case(clip)
    lstm = lstm.float()
    inputs = inputs.detach().float().requires_grad_()
    state = LstmState(state.hidden.float(), state.cell.float())
    calls = {"forward": 0, "backward": 0}
    for name in ("forward", "backward"):
        compiled = getattr(fused_cell, f"train_{name}_")

        def counted(*args, name=name, compiled=compiled):
            ran = compiled(*args)
            calls[name] += ran
            return ran

        monkeypatch.setattr(fused_cell, f"train_{name}_", counted)
    results = []
    for cell in ("compiled", "eager"):
        if cell == "eager":
            monkeypatch.setitem(fused_cell._STATE, "library", None)
        layers, final = forward_streams(lstm, inputs, state, RecurrenceOptions(batched=batched, lstm_bf16=lstm_bf16))
        loss = sum((layer * weight.float()).sum() for layer, weight in zip(layers, weights))
        loss = loss + final.hidden.square().sum() + final.cell.sin().sum()
        results.append((layers, final, torch.autograd.grad(loss, [inputs, *lstm.parameters()])))
    assert calls == {"forward": 14, "backward": 14}  # 2 layers x 7 steps, each pass, the compiled run only
    (layers, final, grads), (eager_layers, eager_final, eager_grads) = results
    for got, expected in zip([*layers, final.hidden, final.cell], [*eager_layers, eager_final.hidden,
                                                                    eager_final.cell]):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    for got, expected in zip(grads, eager_grads):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-3)


def test_training_buffers_it_does_not_take_are_refused_untouched():
    """Gates or buffers of another width, dtype or layout: False, nothing written (the eager cell
    runs instead)."""
    n_dirs, rows, cell_dim = 2, 3, 8
    gates = torch.randn(n_dirs, rows, 4 * cell_dim)
    acts, cell_prev, cell_next, tanh_cell, output = (torch.zeros(n_dirs, rows, w * cell_dim) for w in (4, 1, 1, 1, 1))
    assert fused_cell.train_forward_(gates, acts, cell_prev, cell_next, tanh_cell, output, 0.0)  # the right ones
    for wrong in (dict(acts=torch.zeros(n_dirs, rows, 3 * cell_dim)), dict(cell_next=torch.zeros(n_dirs, rows, 4)),
                  dict(output=torch.zeros(n_dirs, rows, 2 * cell_dim)),
                  dict(output=torch.zeros(n_dirs, rows, cell_dim, dtype=torch.float64)),
                  dict(tanh_cell=torch.zeros(n_dirs, cell_dim, rows).mT)):
        given = dict(acts=torch.zeros_like(acts), cell_prev=cell_prev, cell_next=torch.zeros_like(cell_next),
                     tanh_cell=torch.zeros_like(tanh_cell), output=torch.zeros_like(output)) | wrong
        assert not fused_cell.train_forward_(gates, given["acts"], given["cell_prev"], given["cell_next"],
                                             given["tanh_cell"], given["output"], 0.0), list(wrong)
        assert all(not t.any() for name, t in given.items() if name != "cell_prev")
    low = [gate.to(torch.bfloat16) for gate in gates]  # bfloat16 products: the bias and the addends go with them
    bias = torch.randn(n_dirs, 4 * cell_dim)
    for wrong in (dict(addends=None), dict(bias=None), dict(bias=bias[:, :-1]), dict(gates=list(gates)),
                  dict(addends=[gate.float() for gate in low])):
        given = dict(gates=low, addends=low, bias=bias) | wrong
        outputs = torch.zeros_like(output)
        assert not fused_cell.train_forward_(given["gates"], acts, cell_prev, cell_next, tanh_cell, outputs, 0.0,
                                             given["addends"], given["bias"]), list(wrong)
        assert not outputs.any()
    grad_m, cell_grad = torch.randn(n_dirs, rows, cell_dim), torch.randn(n_dirs, rows, cell_dim)
    kept = cell_grad.clone()
    grad_gates, bias_grad = torch.zeros(n_dirs, rows, 4, cell_dim), torch.zeros(n_dirs, 4 * cell_dim)
    transposed = torch.zeros(n_dirs, rows, cell_dim, 4).transpose(2, 3)  # (D, R, 4, C), not rows of 4C
    for wrong in (dict(gate_grads=transposed), dict(bias_grad=bias_grad[:, 1:]),
                  dict(grad_m=[grad_m[0], grad_m[1].to(torch.bfloat16)]),  # one dtype for both directions
                  dict(gate_grads=grad_gates.double())):
        given = dict(grad_m=grad_m, gate_grads=grad_gates, bias_grad=bias_grad) | wrong
        assert not fused_cell.train_backward_(given["grad_m"], cell_grad, acts, cell_prev, cell_next, tanh_cell,
                                              given["gate_grads"], 0.0, given["bias_grad"]), list(wrong)
        assert torch.equal(cell_grad, kept) and not given["gate_grads"].any() and not bias_grad.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, width", [(3, 37), (64, 2050)])  # the second on both threads
def test_the_training_softmax_pass_is_torchs_softmax_nll_and_bias_gradient(dtype, rows, width):
    """Each row's nll and softmax - onehot(target), float32 over the logits or bfloat16 beside
    them (the bias added first), and the bias gradient added to what its buffer held."""
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(rows, width, generator=generator) * 5).to(dtype)
    bias = None if dtype == torch.float32 else torch.randn(width, generator=generator)
    targets = torch.randint(0, width, (rows,), generator=generator)
    full = logits.float() + (0 if bias is None else bias)
    expected = torch.softmax(full, dim=1)
    expected[torch.arange(rows), targets] -= 1
    expected_nll = torch.logsumexp(full, dim=1) - full[torch.arange(rows), targets]
    grad = logits if dtype == torch.float32 else torch.empty_like(logits)
    bias_grad = torch.full((width,), 0.5)
    nll = fused_cell.softmax_rows_(logits, bias, targets, grad, bias_grad)
    torch.testing.assert_close(nll, expected_nll, rtol=0, atol=2e-5)
    torch.testing.assert_close(grad.float(), expected, rtol=0, atol=1e-6 if dtype == torch.float32 else 4e-3)
    torch.testing.assert_close(bias_grad, 0.5 + expected.sum(dim=0), rtol=0, atol=2e-5)


def test_the_training_softmax_pass_refuses_what_it_does_not_take():
    logits, targets, bias_grad = torch.randn(4, 9), torch.tensor([0, 8, 3, 1]), torch.zeros(9)
    kept = logits.clone()
    for wrong in (dict(targets=torch.tensor([0, 9, 3, 1])), dict(targets=torch.tensor([0, -1, 3, 1])),
                  dict(targets=targets.int()), dict(grad=torch.empty(4, 9, dtype=torch.bfloat16)),
                  dict(bias_grad=torch.zeros(8)), dict(logits=logits.double(), grad=logits.double()),
                  dict(logits=logits.T.contiguous().T, grad=logits.T.contiguous().T)):
        given = dict(logits=logits, bias=None, targets=targets, grad=logits, bias_grad=bias_grad) | wrong
        assert fused_cell.softmax_rows_(**given) is None, list(wrong)
        assert torch.equal(logits, kept) and not bias_grad.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_highway_pass_is_the_highway_layer(dtype):
    """`highway_`: `highway_gate` on the product widened to float32, and the result again in the
    product's dtype (rounded once, as torch rounds) for the next product; the encoder's highway
    under inference (this pass) gives what it gives with gradients on (the eager layers)."""
    from elmokit.model.encoder import Highway
    from elmokit.model.highway import highway_gate

    generator = torch.Generator().manual_seed(4)
    x = torch.randn(37, 300, generator=generator)
    product = (torch.randn(37, 600, generator=generator) * 4).to(dtype)
    out, operand = fused_cell.highway_(product, x)
    torch.testing.assert_close(out, highway_gate(product.float(), x), rtol=0, atol=2e-6)
    assert operand is out if dtype == torch.float32 else torch.equal(operand, out.to(dtype))
    highway = Highway(300, 2).to(dtype)
    with torch.no_grad():
        fused = highway(x)
    eager = highway(x).detach()  # gradients on: the eager layers
    torch.testing.assert_close(fused, eager, rtol=0, atol=1e-5)


def test_the_highway_pass_refuses_what_it_does_not_take():
    x, product = torch.randn(4, 8), torch.randn(4, 16)
    assert fused_cell.highway_(product, x.double()) is None  # x not float32
    assert fused_cell.highway_(product[:, :15], x) is None  # not [transform | carry] of x's width
    assert fused_cell.highway_(torch.randn(16, 4).T, x) is None  # columns not contiguous
    assert fused_cell.highway_(product.half(), x) is None  # a dtype it has no pass for
    assert fused_cell.highway_(product, x) is not None  # the control


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 44, 1024), (3, 1, 700), (5, 9, 32)])
def test_the_max_over_windows_is_amax(dtype, shape):
    """`window_max_`: torch's amax over the windows, exactly (a max is one of its values), NaN
    wherever a window holds one; the char CNN under inference gives its numbers with gradients on."""
    generator = torch.Generator().manual_seed(5)
    products = (torch.randn(*shape, generator=generator) * 3).to(dtype)
    products[0, -1, 3] = float("nan")
    products[-1, 0, 5] = float("inf")
    pooled = fused_cell.window_max_(products)
    assert pooled.dtype == dtype and pooled.shape == (shape[0], shape[2])
    assert torch.equal(pooled.nan_to_num(-9.0), products.amax(dim=1).nan_to_num(-9.0))
    assert pooled[0, 3].isnan() and pooled[-1, 5] == float("inf")


def test_the_char_cnn_pools_the_same_without_gradients():
    from elmokit.model.encoder import CharCNN

    torch.manual_seed(0)
    cnn = CharCNN(16, ((1, 32), (2, 32), (3, 64), (7, 1024)), "relu")
    ids = torch.randint(1, 261, (70, 50))
    with torch.no_grad():
        fused = cnn(ids)
    eager = cnn(ids).detach()  # gradients on: CharConvMaxPool, torch's amax
    torch.testing.assert_close(fused, eager, rtol=0, atol=0)


def test_the_max_over_windows_refuses_what_it_does_not_take():
    products = torch.randn(4, 6, 8)
    assert fused_cell.window_max_(products.double()) is None  # a dtype it has no pass for
    assert fused_cell.window_max_(products.transpose(0, 1)) is None  # not contiguous
    assert fused_cell.window_max_(products[:, :0]) is None  # no window: amax raises, the eager path says why
    assert fused_cell.window_max_(products[0]) is None  # not (n, L, f)
    assert fused_cell.window_max_(products) is not None  # the control


def test_the_load_checks_on_the_cpu_whatever_the_default_device(monkeypatch):
    """The self-check hands the library raw pointers: its tensors are made on the CPU also where a
    caller set another default device (here `meta`, which has no memory at all)."""
    monkeypatch.setattr(fused_cell, "_STATE", {})
    with torch.device("meta"):
        assert fused_cell.available(), fused_cell.status()
