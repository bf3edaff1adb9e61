"""The LM's softmax (elmokit.training.softmax): the one-pass loss against the plain log-softmax,
no gradient work without grad mode, and the sampled rows' gather whose gradient the trainer adds in
place into the softmax weight's kept gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from elmokit.model import fused_cell
from elmokit.training import softmax
from tests.test_lm import VOCAB, make_model, plain_sampled_nll, random_streams, window


@pytest.fixture(autouse=True, params=["compiled", "eager"])
def softmax_pass(request, monkeypatch):
    """Every test with the full form's compiled pass (where it runs here) and with the eager code
    that runs where it does not (no compiler, other devices)."""
    if request.param == "eager":
        monkeypatch.setitem(fused_cell._STATE, "library", None)
    return request.param


@pytest.mark.parametrize("n_samples", [0, 25])
def test_one_pass_softmax_matches_cross_entropy(n_samples, monkeypatch):
    """nll_sums (logits a block at a time, gradients in the forward pass) equals the plain
    log-softmax computation (F.cross_entropy of the logits, plain_sampled_nll): the loss and every
    gradient, full and sampled (the same sample drawn from the same RNG state)."""
    monkeypatch.setattr(softmax, "LOGIT_BUDGET", 64 * VOCAB)  # blocks of 64 rows
    model = make_model(n_samples=n_samples).train()
    hidden = torch.randn(300, 6, requires_grad=True)  # five blocks
    targets = torch.randint(0, VOCAB, (300,))
    results = []
    for fused in (True, False):
        torch.manual_seed(5)
        if fused:
            loss = model.nll_sums([hidden], [targets], sampled=True)[0]
        else:
            loss = (plain_sampled_nll(model, hidden, targets).sum() if n_samples
                    else F.cross_entropy(model.softmax(hidden), targets, reduction="sum"))
        grads = torch.autograd.grad(2.5 * loss, [hidden, model.softmax.weight, model.softmax.bias])
        results.append((loss, grads))
    (loss, grads), (ref_loss, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=1e-6)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, atol=1e-5, rtol=1e-5)


def test_training_softmax_scores_a_target_the_softmax_lost():
    """The full form's nll is logsumexp - target logit, its logsumexp from the softmax's largest
    probability: a target whose logit is far below its row's largest (probability under float32's
    smallest number, 0 here) is scored too: every row's nll and gradient as float64
    cross-entropy's."""
    torch.manual_seed(3)
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(50, 4).requires_grad_()
    bias = torch.zeros(50)
    bias[7] = -200.0  # row 0's and row 3's target: p = exp(-200) ~ 1e-87, 0 in float32
    bias = bias.requires_grad_()
    targets = torch.tensor([7, 1, 2, 7, 4, 5])
    loss = softmax.full_softmax_nll_sum(hidden, weight, bias, targets)
    grads = torch.autograd.grad(loss, [hidden, weight, bias])
    wide = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    expected = F.cross_entropy(F.linear(*wide), targets, reduction="sum")
    expected_grads = torch.autograd.grad(expected, wide)
    assert loss.item() > 400  # the two lost targets count ~200 each: not inf, not 0
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-4)
    for grad, ref in zip(grads, expected_grads):
        torch.testing.assert_close(grad.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sampled", [False, True])
def test_training_softmax_in_bfloat16_products(sampled, monkeypatch):
    """product_dtype bfloat16 (--softmax-bf16): the loss and gradients are those of the three
    products with operands rounded to bfloat16 and results rounded to bfloat16 (an independent
    float64 computation of exactly that), the bias, the softmax and the sums float32; within a
    bfloat16 rounding of float32's, and not float32's."""
    monkeypatch.setattr(softmax, "LOGIT_BUDGET", 64 * 40)  # blocks of 64 rows: the sums over blocks too
    torch.manual_seed(4)
    hidden = torch.randn(150, 16, requires_grad=True)
    weight = (0.5 * torch.randn(40, 16)).requires_grad_()
    bias = torch.randn(40).requires_grad_()
    targets = torch.randint(0, 40, (150,))
    true_logits = torch.randn(150, requires_grad=True)
    hits = torch.where(torch.rand(150) < 0.3, torch.randint(0, 40, (150,)), -1)
    inputs = [hidden, weight, bias] + ([true_logits] if sampled else [])

    def loss_and_grads(product_dtype):
        if sampled:
            loss = softmax.sampled_softmax_nll_sum(hidden, weight, bias, true_logits, hits, product_dtype)
        else:
            loss = softmax.full_softmax_nll_sum(hidden, weight, bias, targets, product_dtype)
        return loss, torch.autograd.grad(loss, inputs)

    def rounded(tensor):  # to bfloat16 and back, in float64
        return tensor.detach().to(torch.bfloat16).double()

    logits = rounded(rounded(hidden) @ rounded(weight).T) + bias.detach().double()
    if sampled:  # the true logit first, a hit removed
        logits[hits >= 0, hits[hits >= 0]] = float("-inf")
        logits = torch.cat([true_logits.detach().double()[:, None], logits], dim=1)
        columns = torch.zeros(150, dtype=torch.long)
    else:
        columns = targets
    expected_loss = F.cross_entropy(logits, columns, reduction="sum")
    grad_logits = torch.softmax(logits, dim=1) - F.one_hot(columns, logits.shape[1])
    grad_candidates = grad_logits[:, 1:] if sampled else grad_logits
    blocks = [slice(first, first + 64) for first in range(0, 150, 64)]  # each block's weight gradient rounded
    expected = [rounded(rounded(grad_candidates) @ rounded(weight)),
                sum(rounded(rounded(grad_candidates[rows]).T @ rounded(hidden[rows])) for rows in blocks),
                grad_candidates.sum(0)]
    if sampled:
        expected.append(grad_logits[:, 0])
    loss, grads = loss_and_grads(torch.bfloat16)
    exact_loss, exact_grads = loss_and_grads(None)
    assert loss.dtype == torch.float32 and all(grad.dtype == torch.float32 for grad in grads)
    torch.testing.assert_close(loss.double(), expected_loss, rtol=1e-5, atol=1e-4)
    for grad, want in zip(grads, expected):  # measured here: equal, or 1e-7 for the float32 sums
        torch.testing.assert_close(grad.double(), want, rtol=2 ** -7, atol=1e-5)  # a bfloat16 rounding's flip
    for grad, exact in zip(grads[:2], exact_grads[:2]):  # within bfloat16's error of float32, not float32
        assert 1e-4 < float((grad - exact).norm() / exact.norm()) < 1e-2
    assert 0 < abs(loss.item() - exact_loss.item()) < 1e-2 * exact_loss.item()


@pytest.mark.parametrize("rows, logits", [(300, 1 << 20), (300, 64 * 8), (7, 16)])
def test_scoring_nll_matches_cross_entropy(rows, logits, monkeypatch):
    """full_softmax_nll (scoring: the vocabulary a slice at a time, the online log-sum-exp) equals
    F.cross_entropy per row: one slice, several slices in row blocks of 64 (8 and 11 columns, the
    last slice short), 20 slices of 2 columns, and logits far from zero (a running maximum that grows from
    slice to slice); full_softmax_nll_sum without gradients is its sum, target_nll the same rows."""
    monkeypatch.setattr(softmax, "SCORING_ROWS", 64)
    monkeypatch.setattr(softmax, "SCORING_LOGITS", logits)
    model = make_model().eval()
    generator = torch.Generator().manual_seed(rows)
    hidden = 30 * torch.randn(rows, 6, generator=generator)
    targets = torch.randint(0, VOCAB, (rows,), generator=generator)
    with torch.no_grad():
        model.softmax.bias.copy_(3 * torch.randn(VOCAB, generator=generator))  # a bias that matters
    weight, bias = model.softmax.weight.detach(), model.softmax.bias.detach()
    expected = F.cross_entropy(F.linear(hidden.double(), weight.double(), bias.double()), targets, reduction="none")
    got = softmax.full_softmax_nll(hidden, weight, bias, targets)
    assert got.dtype == torch.float32 and got.shape == (rows,)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(model.target_nll(hidden, targets).double(), expected, atol=1e-4, rtol=1e-5)
    with torch.no_grad():
        total = softmax.full_softmax_nll_sum(hidden, weight, bias, targets)
    torch.testing.assert_close(total.double(), expected.sum(), atol=1e-3, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scoring_sums_in_float32_for_a_half_precision_softmax(dtype, monkeypatch):
    """A softmax held in bfloat16 or float16: the products in its dtype, the log-sum-exp in float32
    (as F.cross_entropy of the widened logits): within 1e-3 of it, and a float16 sum of 2,000
    exp(~0) terms (past float16's 65,504 at 65,536 columns; here a slice's) does not overflow."""
    monkeypatch.setattr(softmax, "SCORING_LOGITS", 64 * 16)  # many slices
    generator = torch.Generator().manual_seed(3)
    vocab = 70_000 if dtype == torch.float16 else 2_000
    weight = (0.01 * torch.randn(vocab, 6, generator=generator)).to(dtype)
    bias = torch.zeros(vocab, dtype=dtype)
    hidden = torch.randn(5, 6, generator=generator)
    targets = torch.randint(0, vocab, (5,), generator=generator)
    expected = F.cross_entropy(F.linear(hidden.to(dtype), weight, bias).float(), targets, reduction="none")
    got = softmax.full_softmax_nll(hidden, weight, bias, targets)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)


def test_scoring_edge_cases(monkeypatch):
    """No rows (a validation window whose rows ran dry) give no NLL and a sum of 0 in the weight's
    dtype; a target outside 0..V-1 is an error naming the range; a slice whose logits are all
    -inf (a -inf bias) adds nothing, and a target whose logit is -inf costs +inf."""
    weight, bias = torch.randn(10, 4), torch.zeros(10)
    nothing = softmax.full_softmax_nll(torch.zeros(0, 4), weight, bias, torch.zeros(0, dtype=torch.long))
    assert nothing.shape == (0,) and nothing.dtype == torch.float32
    with torch.no_grad():
        total = softmax.full_softmax_nll_sum(torch.zeros(0, 4, dtype=torch.bfloat16), weight, bias,
                                             torch.zeros(0, dtype=torch.long))
    assert total.item() == 0 and total.dtype == torch.float32
    for bad in (-1, 10):
        with pytest.raises(IndexError, match=r"0\.\.9"):
            softmax.full_softmax_nll(torch.zeros(1, 4), weight, bias, torch.tensor([bad]))
    bias[:5] = float("-inf")
    hidden, targets = torch.randn(3, 4), torch.tensor([7, 9, 2])
    expected = F.cross_entropy(F.linear(hidden, weight, bias), targets, reduction="none")
    monkeypatch.setattr(softmax, "SCORING_LOGITS", 3 * 5)  # slices of 5: the first all -inf
    got = softmax.full_softmax_nll(hidden, weight, bias, targets)
    torch.testing.assert_close(got[:2], expected[:2])
    assert got[2].item() == float("inf")


@pytest.mark.parametrize("sparse", [False, True])
def test_gather_rows_gradient_dense_or_added_in_place(sparse):
    """GatherRows (the sampled softmax's one gather of rows, repeated rows included) gives the
    gradient of plain indexing; with `sparse` and a dense `.grad` already on the weight, that
    gradient comes as the rows alone (sparse), added by autograd into the same dense `.grad`."""
    weight = torch.randn(VOCAB, 6, requires_grad=True)
    rows = torch.tensor([3, 7, 3, 0, 39, 7, -1, 7])  # -1: the last row, as indexing reads it
    upstream = torch.randn(len(rows), 6)
    expected = torch.zeros(VOCAB, 6).index_put_((rows % VOCAB,), upstream, accumulate=True)  # autograd of weight[rows]
    gathered = lambda: softmax.GatherRows.apply(weight, rows, sparse)  # noqa: E731
    torch.testing.assert_close(gathered(), weight[rows])
    (gathered() * upstream).sum().backward()  # no .grad yet: dense either way
    assert weight.grad.layout == torch.strided
    torch.testing.assert_close(weight.grad, expected)
    kept = weight.grad
    kept.fill_(0.5)  # the trainer zeroes it between steps; any dense values add the same way
    (gathered() * upstream).sum().backward()
    assert weight.grad is kept and kept.layout == torch.strided
    torch.testing.assert_close(weight.grad, expected + 0.5)
    grad, = torch.autograd.grad((gathered() * upstream).sum(), weight)  # what autograd adds into .grad
    assert grad.layout == (torch.sparse_coo if sparse else torch.strided)
    torch.testing.assert_close(grad.to_dense(), expected)


def test_trainer_keeps_the_softmax_gradient_dense_and_in_place(tmp_path):
    """Sampled-softmax steps of the trainer: the (V, P) weight's gradient is the same dense tensor
    from the second step on and equals the dense gradient of the same step without the in-place
    path; every other gradient is freed between steps, as zero_grad(set_to_none=True) does."""
    from elmokit.training.config import TrainConfig
    from elmokit.training.loop import train_step
    from elmokit.training.processes import Dist
    chars, ids = random_streams(4, 12, seed=2)
    model = make_model(n_samples=15).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0)  # lr 0: every step sees the same weights
    config = TrainConfig(output_dir=str(tmp_path), grad_clip=0.0)
    softmax_grads, other_grads = [], []
    for step in range(3):
        model.sparse_softmax_grad = step < 2  # the third step as without the in-place path
        torch.manual_seed(7)
        train_step(model, optimizer, window(chars, ids, 0, 5), None, 0.0, config, Dist())
        softmax_grads.append(model.softmax.weight.grad)
        other_grads.append(model.softmax.bias.grad)
    assert softmax_grads[0] is softmax_grads[1] is not softmax_grads[2]
    assert softmax_grads[1].layout == softmax_grads[2].layout == torch.strided
    torch.testing.assert_close(softmax_grads[1], softmax_grads[2])
    assert other_grads[0] is not other_grads[1]
    torch.testing.assert_close(other_grads[0], other_grads[1])


@pytest.mark.parametrize("n_samples", [0, 25])
def test_no_gradient_is_computed_without_grad_mode(n_samples):
    """Scoring under torch.no_grad (validation, `elmo perplexity`) runs the logits' product only:
    none of the two gradient products (hidden, weight) the training pass computes up front."""
    from torch.profiler import ProfilerActivity, profile

    products = {"aten::mm", "aten::addmm_", "aten::addmm", "mkldnn::_linear_pointwise"}  # MKL's or oneDNN's
    model = make_model(n_samples=n_samples).train()
    hidden, targets = torch.randn(50, 6), torch.randint(0, VOCAB, (50,))
    counts = {}
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            model.nll_sums([hidden], [targets], sampled=True)  # the kernels' one-time checks happen here
        with torch.set_grad_enabled(grad), profile(activities=[ProfilerActivity.CPU]) as prof:
            model.nll_sums([hidden], [targets], sampled=True)
        counts[grad] = sum(event.count for event in prof.key_averages() if event.key in products)
    assert counts == {True: 3, False: 1}


def test_a_sampled_hit_is_removed_whatever_its_logit():
    """A hit's logit is set to -inf, not added to: a candidate whose logit overflowed to +inf,
    a hit in every row, is removed as any other (the loss as with a finite logit there)."""
    torch.manual_seed(6)
    hidden, weight, true_logits = torch.randn(3, 4), torch.randn(5, 4), torch.randn(3)
    hits = torch.tensor([0, 0, 0])
    finite = torch.zeros(5)
    overflowed = finite.clone()
    overflowed[0] = float("inf")
    expected = softmax.sampled_softmax_nll_sum(hidden, weight, finite, true_logits, hits)
    got = softmax.sampled_softmax_nll_sum(hidden, weight, overflowed, true_logits, hits)
    assert torch.isfinite(expected) and torch.equal(got, expected)
