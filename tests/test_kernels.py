"""elmokit.kernels: which path runs (oneDNN's private ops, or F.linear with ELMOKIT_KERNELS=torch),
the check of the first oneDNN product of each kind against F.linear (a torch whose private ops
changed is caught: one warning, then F.linear, the same vectors), the oneDNN cache settings made
only when oneDNN first runs, and the torch range pyproject.toml allows being the one tested here."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tomllib
import warnings

import numpy as np
import pytest
import torch
from packaging.requirements import Requirement

from elmokit import ElmoEmbedder, kernels
from tests.conftest import REPO, SENTENCES

needs_onednn = pytest.mark.skipif(not kernels.ONEDNN, reason="this torch has no oneDNN linear ops (torch.ops.mkldnn)")


@pytest.fixture(autouse=True)
def fresh_kernels(monkeypatch):
    monkeypatch.delenv(kernels.KERNELS_VARIABLE, raising=False)
    kernels.reset()
    yield
    kernels.reset()


def _vectors(model, dtype=None) -> list[np.ndarray]:
    """Every path's products: the token encoder, the streamed LSTM (reordered weights) and the
    padded batch."""
    embedder = ElmoEmbedder(module=copy.deepcopy(model), cache_tokens=False, dtype=dtype)
    return [*embedder.embed_many(SENTENCES, rows=2), *embedder.embed_batch(SENTENCES)]


def _switch_off_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "oneDNN switched off" in str(w.message)]


@needs_onednn
def test_onednn_by_default_and_f_linear_with_elmokit_kernels_torch(tiny_model, monkeypatch):
    onednn = _vectors(tiny_model)
    assert kernels.path_counts["onednn"] > 0 and kernels.path_counts["torch"] == 0
    assert {kind for kind, _ in kernels._verified} == {"linear", "packed"}
    monkeypatch.setenv(kernels.KERNELS_VARIABLE, "torch")
    kernels.reset()
    plain = _vectors(tiny_model)
    assert kernels.path_counts["onednn"] == 0 and kernels.path_counts["torch"] > 0
    for got, want in zip(plain, onednn):
        np.testing.assert_allclose(got, want, atol=1e-5)
    monkeypatch.setenv(kernels.KERNELS_VARIABLE, "fast")
    with pytest.raises(ValueError, match="ELMOKIT_KERNELS must be"):
        _vectors(tiny_model)


def _wrong(op):
    return lambda *args: op(*args) + 0.5


def _raises(op):
    def failing(*args):
        raise RuntimeError("mkldnn::_linear_pointwise: unknown argument (a torch whose private op changed)")
    return failing


@needs_onednn
@pytest.mark.parametrize("op, breaking", [("_onednn_linear", _wrong), ("_onednn_linear", _raises),
                                          ("_onednn_reorder", _raises)])
def test_a_changed_private_op_is_caught_with_one_warning(tiny_model, monkeypatch, op, breaking):
    monkeypatch.setenv(kernels.KERNELS_VARIABLE, "torch")
    reference = _vectors(tiny_model)
    monkeypatch.delenv(kernels.KERNELS_VARIABLE)
    kernels.reset()
    monkeypatch.setattr(kernels, op, breaking(getattr(kernels, op)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _vectors(tiny_model)
        again = _vectors(tiny_model)  # after the switch-off: no second warning, still F.linear
    assert len(_switch_off_warnings(caught)) == 1, _switch_off_warnings(caught)
    assert not kernels.onednn_active() and kernels.path_counts["torch"] > 0
    for vectors in (got, again):
        for a, b in zip(vectors, reference):
            np.testing.assert_allclose(a, b, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("breaking", [_wrong, _raises])
def test_a_changed_product_with_an_addend_is_caught_too(monkeypatch, breaking):
    """`PackedLinear.add` (training's recurrent step in float32; the engine's step runs its product
    alone): its first oneDNN product is checked too; a changed op gives one warning, then addmm's
    numbers."""
    generator = torch.Generator().manual_seed(0)
    weight, x, addend = (torch.randn(*shape, generator=generator) for shape in ((24, 16), (5, 16), (5, 24)))
    expected = torch.addmm(addend, x, weight.T)
    torch.testing.assert_close(kernels.PackedLinear(weight, 5).add(addend, x), expected)
    assert ("packed_add", torch.float32) in kernels._verified
    kernels.reset()
    monkeypatch.setattr(kernels, "_onednn_add_linear", breaking(kernels._onednn_add_linear))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = kernels.PackedLinear(weight, 5).add(addend, x)
        again = kernels.PackedLinear(weight, 5).add(addend, x)
    assert len(_switch_off_warnings(caught)) == 1 and not kernels.onednn_active()
    for result in (got, again):
        torch.testing.assert_close(result, expected)


@needs_onednn
@pytest.mark.skipif(torch.bfloat16 not in kernels._ONEDNN_DTYPES, reason="no oneDNN bfloat16 on this CPU")
def test_the_bfloat16_products_are_checked_too(tiny_model, monkeypatch):
    good = _vectors(tiny_model, torch.bfloat16)
    assert kernels._verified == {(kind, torch.bfloat16) for kind in ("linear", "packed")}
    kernels.reset()
    monkeypatch.setattr(kernels, "_onednn_linear", _wrong(kernels._onednn_linear))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _vectors(tiny_model, torch.bfloat16)
    assert len(_switch_off_warnings(caught)) == 1
    for a, b in zip(got, good):  # F.linear in bfloat16 instead of oneDNN: both round the same products
        np.testing.assert_allclose(a, b, atol=0.05)


CACHE_PROBE = r"""
import json, os, sys
import elmokit, elmokit.inference.elmo, elmokit.kernels
names = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
after_import = {name: os.environ.get(name) for name in names}
from elmokit import BiLM, ElmoEmbedder
from tests.conftest import tiny_config
ElmoEmbedder(module=BiLM(tiny_config())).embed_sentence(["a", "cat"])
print(json.dumps([after_import, {name: os.environ.get(name) for name in names}]))
"""


@pytest.mark.parametrize("setting", ["default", "user value", "torch kernels"])
def test_onednn_cache_settings_only_when_onednn_runs(setting):
    env = {k: v for k, v in os.environ.items() if k not in kernels.CACHE_VARIABLES + (kernels.KERNELS_VARIABLE,)}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]), OMP_NUM_THREADS="1")
    if setting == "user value":
        env["LRU_CACHE_CAPACITY"] = "8"
    if setting == "torch kernels":
        env[kernels.KERNELS_VARIABLE] = "torch"
    result = subprocess.run([sys.executable, "-c", CACHE_PROBE], env=env, capture_output=True, text=True,
                            cwd=REPO, check=True)
    after_import, after_embedding = json.loads(result.stdout.strip().splitlines()[-1])
    user = "8" if setting == "user value" else None
    assert after_import == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": None, "LRU_CACHE_CAPACITY": user}
    if setting == "torch kernels" or not kernels.ONEDNN:
        assert after_embedding == after_import
    else:
        assert after_embedding == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": user or "64"}


def test_the_torch_in_use_is_in_the_range_pyproject_allows():
    """pyproject.toml allows the torch versions this suite is run with, and no others: run it
    with a torch outside the range and this fails, saying the range is untested there."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    (torch_requirement,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"]
    version = torch.__version__.split("+")[0]
    assert torch_requirement.specifier.contains(version), (
        f"torch {torch.__version__} is outside pyproject.toml's {torch_requirement}: widen the range only "
        "after this suite passes with it")


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch's own forward-AD setup
def test_linear_with_gradients_on_empty_inputs_and_under_higher_order_autograd():
    """`linear` with gradients (oneDNN's LinearFunction on the CPU) against F.linear: batches with no
    rows or no input features (oneDNN has no empty product: torch's runs, nothing is switched off),
    a double backward (create_graph), forward-mode AD and torch.func.grad."""
    import torch.autograd.forward_ad as forward_ad
    import torch.nn.functional as F

    torch.manual_seed(0)
    for x_shape, w_shape in [((0, 4), (5, 4)), ((3, 0, 4), (5, 4)), ((3, 0), (5, 0))]:
        inputs = (torch.randn(*x_shape), torch.randn(*w_shape), torch.randn(5))
        results = []
        for use in (kernels.linear, F.linear):
            x, weight, bias = (t.clone().requires_grad_(True) for t in inputs)
            out = use(x, weight, bias)
            out.sum().backward()
            results.append((out, x.grad, weight.grad, bias.grad))
        for a, b in zip(*results):
            torch.testing.assert_close(a, b)
    assert kernels.onednn_active() or not kernels.ONEDNN

    x, weight = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    second = []
    for use in (kernels.linear, F.linear):
        grad_x, = torch.autograd.grad(torch.tanh(use(x, weight)).sum(), x, create_graph=True)
        second.append(torch.autograd.grad(grad_x.square().sum(), weight)[0])
    torch.testing.assert_close(second[0], second[1])
    tangents = []
    for use in (kernels.linear, F.linear):
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(x.detach(), torch.ones(3, 4))
            tangents.append(forward_ad.unpack_dual(use(dual, weight)).tangent)
    torch.testing.assert_close(tangents[0], tangents[1])
    grads = [torch.func.grad(lambda w: use(x.detach(), w).sum())(weight.detach()) for use in (kernels.linear, F.linear)]
    torch.testing.assert_close(grads[0], grads[1])


def test_a_weights_key_holds_its_storages_so_no_new_tensor_passes_for_them():
    """A freed tensor's memory goes to the next tensor of its size; while a key of the old one is
    kept (beside a copy made from it), the new one gets other memory and another key. Without
    the storages held, the new tensor took the old address (and version 0) in 19 of 20 trials."""
    same = 0
    for _ in range(20):
        old = torch.randn(4096)
        key = kernels.weights_key([old])
        del old
        new = torch.randn(4096)
        same += key == kernels.weights_key([new])
        del new
    assert same == 0
    linear = torch.nn.Linear(64, 64)
    key = kernels.weights_key(linear.parameters())
    assert key == kernels.weights_key(linear.parameters())  # the same tensors: equal keys
    linear.to(torch.bfloat16).to(torch.float32)  # rounded values in new float32 storages
    assert key != kernels.weights_key(linear.parameters())
