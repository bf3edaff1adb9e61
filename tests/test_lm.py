"""LanguageModel: the loss, the token de-duplication, the carried state, the training engine
(hand-written recurrence, one-pass softmax) and
the sampled softmax with its log-uniform sampler. Batches come from a tiny in-test generator."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from elmokit import kernels
from elmokit.model.config import CharCNNConfig, ElmoConfig, LSTMConfig
from elmokit.training.data import LMBatch
from elmokit.training import lm
from elmokit.training.lm import LanguageModel, LogUniformSampler, unique_rows
from elmokit.model.lstm import LstmState
from elmokit.training.recurrence import forward_streams

VOCAB = 40


def tiny_config(clip: float = 3.0) -> ElmoConfig:
    return ElmoConfig(CharCNNConfig(embedding_dim=4, filters=((1, 4), (2, 8), (3, 8)), n_highway=1),
                      LSTMConfig(cell_dim=12, projection_dim=6, n_layers=2, cell_clip=clip, proj_clip=clip))


def make_model(clip: float = 3.0, dropout: float = 0.0, n_samples: int = 0, seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(tiny_config(clip), VOCAB, dropout=dropout, n_samples=n_samples)


def random_streams(batch_size: int, steps: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Char ids (B, steps + 1, W) and vocab ids (B, steps + 1) of token streams over a small
    vocabulary (token k always has the same characters, so repeated tokens repeat char rows)."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randint(1, 262, (VOCAB, 50), generator=generator)
    ids = torch.randint(0, VOCAB, (batch_size, steps + 1), generator=generator)
    return table[ids], ids


def window(chars: torch.Tensor, ids: torch.Tensor, start: int, steps: int, lengths=None) -> LMBatch:
    """Positions start..start+steps-1 as inputs, the next ones as targets; the backward stream is
    another stream here (the flipped ids): what matters to the model is only the layout."""
    forward = slice(start, start + steps)
    target = slice(start + 1, start + steps + 1)
    mask = torch.ones(ids.shape[0], steps, dtype=torch.bool)
    if lengths is not None:
        mask = torch.arange(steps) < torch.tensor(lengths).unsqueeze(1)
    flipped_chars, flipped_ids = chars.flip(1), ids.flip(1)
    return LMBatch(chars[:, forward] * mask[..., None], flipped_chars[:, forward] * mask[..., None],
                   ids[:, target] * mask, flipped_ids[:, target] * mask, mask, int(mask.sum()))


def test_loss_is_mean_of_both_directions_full_softmax():
    model = make_model().eval()
    chars, ids = random_streams(3, 6)
    batch = window(chars, ids, 0, 6, lengths=[6, 4, 1])
    out = model(batch)
    hidden, _ = model.contextualize(batch.forward_char_ids, batch.backward_char_ids, None)
    logits = model.softmax(hidden)  # (D, B, U, V)
    expected = [F.cross_entropy(logits[d][batch.mask], t[batch.mask], reduction="sum")
                for d, t in enumerate((batch.forward_targets, batch.backward_targets))]
    assert out.n_targets == 11
    torch.testing.assert_close(out.forward_nll, expected[0])
    torch.testing.assert_close(out.backward_nll, expected[1])
    torch.testing.assert_close(out.loss, (expected[0] + expected[1]) / 22)


def test_unique_token_encoding_equals_encoding_every_position():
    model = make_model().eval()
    chars, ids = random_streams(4, 10)
    batch = window(chars, ids, 0, 10)
    hidden, _ = model.contextualize(batch.forward_char_ids, batch.backward_char_ids, None)
    tokens = model.bilm.encode_tokens(torch.stack([batch.forward_char_ids, batch.backward_char_ids]))
    layers, _ = forward_streams(model.bilm.lstm, tokens)
    torch.testing.assert_close(hidden, layers[-1], atol=1e-6, rtol=1e-5)


def test_unique_rows_are_torch_unique_rows_and_survive_a_hash_collision(monkeypatch):
    rows = torch.randint(0, 3, (500, 50))
    rows[::5] = rows[1]  # repeats
    rows[:, 10:] *= (torch.arange(500) % 2 == 0)[:, None]  # many rows alike but in a few ids
    unique, inverse = unique_rows(rows)
    assert torch.equal(unique[inverse], rows)
    reference = torch.unique(rows, dim=0)
    assert len(unique) == len(reference)
    assert torch.equal(unique[_lexicographic_order(unique)], reference)  # the same rows, in another order
    monkeypatch.setattr(lm, "_ROW_HASH_WEIGHTS", torch.zeros(50, dtype=torch.long))  # every row one hash
    unique, inverse = unique_rows(rows)
    assert torch.equal(unique, reference) and torch.equal(unique[inverse], rows)


def _lexicographic_order(rows: torch.Tensor) -> torch.Tensor:
    order = torch.arange(len(rows))
    for column in reversed(range(rows.shape[1])):  # stable sorts, last key first
        order = order[torch.sort(rows[order, column], stable=True).indices]
    return order


def test_carried_state_equals_one_long_window():
    model = make_model().eval()
    chars, ids = random_streams(2, 12)
    long_hidden, _ = model.contextualize(chars[:, :12], chars.flip(1)[:, :12], None)
    first = window(chars, ids, 0, 6)
    second = window(chars, ids, 6, 6)
    state = model(first).state
    hidden, _ = model.contextualize(second.forward_char_ids, second.backward_char_ids, state)
    torch.testing.assert_close(hidden, long_hidden[:, :, 6:], atol=1e-6, rtol=1e-5)


def test_state_is_detached_and_zero_for_rows_that_ended():
    model = make_model().train()
    chars, ids = random_streams(3, 5)
    out = model(window(chars, ids, 0, 5, lengths=[5, 2, 0]))
    assert not out.state.hidden.requires_grad and not out.state.cell.requires_grad
    assert out.state.hidden[:, :, 1:].abs().sum() == 0 and out.state.cell[:, :, 1:].abs().sum() == 0
    assert out.state.hidden[:, :, 0].abs().sum() > 0


def test_masked_positions_do_not_change_the_loss():
    model = make_model().eval()
    chars, ids = random_streams(2, 5)
    batch = window(chars, ids, 0, 5, lengths=[5, 3])
    changed = LMBatch(batch.forward_char_ids.clone(), batch.backward_char_ids, batch.forward_targets.clone(),
                      batch.backward_targets, batch.mask, batch.n_tokens)
    changed.forward_targets[1, 3:] = 7
    changed.forward_char_ids[1, 3:] = 9
    torch.testing.assert_close(model(batch).loss, model(changed).loss)


def test_rows_are_independent():
    model = make_model().eval()
    chars, ids = random_streams(3, 7)
    batch = window(chars, ids, 0, 7)
    together, _ = model.contextualize(batch.forward_char_ids, batch.backward_char_ids, None)
    for row in range(3):
        alone, _ = model.contextualize(batch.forward_char_ids[row:row + 1], batch.backward_char_ids[row:row + 1], None)
        torch.testing.assert_close(alone[:, 0], together[:, row], atol=1e-6, rtol=1e-5)


def test_every_parameter_gets_a_gradient():
    for n_samples in (0, 10):
        model = make_model(dropout=0.1, n_samples=n_samples).train()
        chars, ids = random_streams(3, 6)
        model(window(chars, ids, 0, 6)).loss.backward()
        for name, parameter in model.named_parameters():
            assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
            if name != "bilm.token_encoder.char_cnn.char_embedding.weight":
                assert parameter.grad.abs().sum() > 0, name


def recurrence_case(clip: float):
    """A float64 biLSTM with large weights (so that a clip of 0.05 binds), inputs (D, B, U, P), a
    carried state and a random weight for each layer's outputs: what the recurrence tests compare on."""
    torch.manual_seed(0)
    lstm = make_model(clip=clip).bilm.lstm.double()
    for parameter in lstm.parameters():
        torch.nn.init.normal_(parameter, 0.0, 0.6)
    inputs = torch.randn(2, 3, 7, 6, dtype=torch.float64, requires_grad=True)  # (D, B, U, P)
    state = LstmState(torch.randn(2, 2, 3, 6, dtype=torch.float64), torch.randn(2, 2, 3, 12, dtype=torch.float64))
    weights = [torch.randn(2, 3, 7, 6, dtype=torch.float64) for _ in lstm.layers]
    return lstm, inputs, state, weights


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_training_recurrence_matches_the_autograd_step_loop(clip):
    """The hand-written forward/backward through time (training.recurrence) gives the outputs,
    final state and every gradient of autograd over BiLstmLayer's step loop, clipped or not
    (a clip of 0.05 is hit by many cells), from a carried state, in float64."""
    lstm, inputs, state, weights = recurrence_case(clip)
    results = []
    for engine in ("hand-written", "autograd"):
        if engine == "hand-written":
            layers, final = forward_streams(lstm, inputs, state)
        else:
            packed = inputs.transpose(1, 2).reshape(2, 7 * 3, 6)
            outputs, final = lstm._run_layers(packed, [3] * 7, state)
            layers = [output.view(2, 7, 3, 6).transpose(1, 2) for output in outputs]
        loss = sum((layer * weight).sum() for layer, weight in zip(layers, weights))
        loss = loss + final.hidden.square().sum() + final.cell.sin().sum()
        grads = torch.autograd.grad(loss, [inputs, *lstm.parameters()])
        results.append((layers, final, grads))
    (layers, final, grads), (ref_layers, ref_final, ref_grads) = results
    for layer, ref in zip(layers, ref_layers):
        torch.testing.assert_close(layer, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(final.hidden, ref_final.hidden, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(final.cell, ref_final.cell, atol=1e-12, rtol=1e-10)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, atol=1e-10, rtol=1e-8)
    if clip:
        assert any((layer.abs() >= clip - 1e-12).any() for layer in layers)  # the clip was exercised


def test_char_cnn_backward_through_the_argmax_matches_autograd():
    """The training path of the char CNN (`CharConvMaxPool`: oneDNN convolutions, gradients from
    the chosen windows through the 262-row char table) against autograd over nn.Embedding(padding_idx=0),
    conv1d and amax, in float64: real tokens (begin/end-of-word marks, in-word padding, so tied
    windows of equal chars), rows of id 0 (no token) and a token of 50 chars."""
    from elmokit.model.chars import tokens_to_char_ids
    from elmokit.model.encoder import CharConvMaxPool

    torch.manual_seed(0)
    words = ["a", "I", "the", "play", "Zürich", "football", "x" * 60, ".", "don't", "北京"]
    char_ids = torch.cat([torch.from_numpy(tokens_to_char_ids(words)), torch.zeros(2, 50, dtype=torch.long)])
    embedding = torch.randn(262, 5, dtype=torch.float64)
    embedding[0] = 0
    kernels = [torch.randn(count, 5, width, dtype=torch.float64) for width, count in ((1, 3), (2, 4), (3, 6), (5, 2))]
    grad = torch.randn(len(char_ids), sum(k.shape[0] for k in kernels), dtype=torch.float64)

    leaves = [embedding.clone().requires_grad_(), *(k.clone().requires_grad_() for k in kernels)]
    pooled = CharConvMaxPool.apply(char_ids, *leaves)
    pooled.backward(grad)
    expected_leaves = [embedding.clone().requires_grad_(), *(k.clone().requires_grad_() for k in kernels)]
    chars = F.embedding(char_ids, expected_leaves[0], padding_idx=0).transpose(1, 2)
    expected = torch.cat([F.conv1d(chars, kernel).amax(dim=2) for kernel in expected_leaves[1:]], dim=-1)
    expected.backward(grad)

    torch.testing.assert_close(pooled, expected, rtol=0, atol=1e-12)
    for got, want in zip(leaves, expected_leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-10, atol=1e-10)
    assert leaves[0].grad[0].abs().max() == 0 and leaves[0].grad[1:].abs().max() > 0


def test_char_cnn_training_path_under_autocast_frozen_and_empty():
    """Under bf16 autocast the training path computes in the weights' float32 (the same pooled
    features and gradients as without autocast) and leaves oneDNN on; frozen weights take the
    plain path (no autograd node); no tokens give (0, F) and zero gradients."""
    from elmokit import kernels
    from elmokit.model.encoder import CharCNN

    torch.manual_seed(0)
    cnn = CharCNN(4, ((1, 3), (2, 5), (3, 4)), "relu")
    char_ids = torch.randint(1, 262, (70, 50))  # more than one chunk of 64 tokens
    plain = cnn(char_ids)
    plain.sum().backward()
    expected = [p.grad.clone() for p in cnn.parameters()]
    cnn.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = cnn(char_ids)
    mixed.sum().backward()
    assert mixed.dtype == torch.float32 and kernels.onednn_active() == kernels.ONEDNN
    torch.testing.assert_close(mixed, plain, rtol=0, atol=0)
    for parameter, want in zip(cnn.parameters(), expected):
        torch.testing.assert_close(parameter.grad, want, rtol=0, atol=0)

    empty = cnn(torch.zeros(0, 50, dtype=torch.long))
    assert empty.shape == (0, 12)
    empty.sum().backward()
    for parameter in cnn.parameters():
        parameter.requires_grad_(False)
    assert cnn(char_ids).grad_fn is None


def test_training_step_losses_match_the_plain_pytorch_computation(monkeypatch):
    """Adam steps through the fast path (hand-written recurrence, one-pass softmax, oneDNN's
    products) give the losses of the same model computed with autograd over the step loop and
    F.cross_entropy, every product torch's own (ELMOKIT_KERNELS=torch): five windows with the
    state carried, then the first window again three times."""
    chars, ids = random_streams(4, 25, seed=3)
    losses = []
    for fast in (True, False):
        monkeypatch.setenv(kernels.KERNELS_VARIABLE, "auto" if fast else "torch")
        model = make_model(clip=3.0, n_samples=0).train()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        state, run = None, []
        for start in [0, 5, 10, 15, 20, 0, 0, 0]:
            if start == 0:
                state = None
            batch = window(chars, ids, start, 5)
            if fast:
                out = model(batch, state)
                loss, state = out.loss, out.state
            else:
                loss, state = _plain_loss(model, batch, state)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.append(loss.item())
        losses.append(run)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert losses[0][-1] < losses[0][-2] < losses[0][-3]  # it learns the repeated window


def _plain_loss(model: LanguageModel, batch: LMBatch, state: LstmState | None):
    """The loss the obvious way: autograd over BiLstm's step loop, F.cross_entropy."""
    lstm = model.bilm.lstm
    char_ids = torch.stack([batch.forward_char_ids, batch.backward_char_ids])  # (D, B, U, W)
    tokens = model.bilm.token_encoder(char_ids.reshape(-1, 50)).view(*char_ids.shape[:-1], -1)
    _, batch_size, steps, dim = tokens.shape
    state = state or lstm.zero_state(batch_size, tokens)
    outputs, final = lstm._run_layers(tokens.transpose(1, 2).reshape(2, steps * batch_size, dim),
                                      [batch_size] * steps, state)
    hidden = outputs[-1].view(2, steps, batch_size, dim).transpose(1, 2)
    targets = (batch.forward_targets, batch.backward_targets)
    nll = sum(F.cross_entropy(model.softmax(hidden[d][batch.mask]), targets[d][batch.mask], reduction="sum")
              for d in range(2))
    return 0.5 * nll / batch.n_tokens, LstmState(final.hidden.detach(), final.cell.detach())


def test_evaluation_always_uses_the_full_softmax():
    sampled, full = make_model(n_samples=10), make_model(n_samples=0)
    chars, ids = random_streams(2, 6)
    batch = window(chars, ids, 0, 6)
    torch.testing.assert_close(sampled.eval()(batch).loss, full.eval()(batch).loss)
    torch.manual_seed(1)
    assert not torch.allclose(sampled.train()(batch).loss, full.train()(batch).loss)


def test_log_uniform_sampler_probabilities_and_draws():
    sampler = LogUniformSampler(1000)
    probabilities = sampler.probability(torch.arange(1000))
    assert math.isclose(float(probabilities.sum()), 1.0, rel_tol=1e-9)
    assert math.isclose(float(probabilities[0]), math.log(2) / math.log(1001), rel_tol=1e-12)
    torch.manual_seed(0)
    draws = sampler._draw(200_000)
    frequencies = torch.bincount(draws, minlength=1000).double() / draws.numel()
    torch.testing.assert_close(frequencies[:5], probabilities[:5], atol=3e-3, rtol=0)
    ids, n_tries = sampler.sample(100)
    assert ids.numel() == 100 and ids.unique().numel() == 100 and n_tries >= 100
    expected = sampler.expected_count(ids, n_tries, 100)
    torch.testing.assert_close(expected, 1 - (1 - sampler.probability(ids)) ** n_tries)
    torch.testing.assert_close(sampler.expected_count(ids, 100, 100), sampler.probability(ids) * 100)
    with pytest.raises(ValueError, match="n_samples"):
        sampler.sample(1000)


def test_sampler_counts_every_draw_up_to_the_kth_distinct_id():
    """`sample(K)` returns the K distinct ids in order of first draw and the number of draws up to
    and including the one that found the K-th (TF's num_tries): with the draws fixed, exactly."""
    sampler = LogUniformSampler(50)
    stream = iter([3, 3, 5, 3, 7, 9, 3, 5, 11, 5, 5, 12, 40, 41])
    sampler._draw = lambda n: torch.tensor([next(stream) for _ in range(n)])  # 2K draws, then K more at a time
    ids, n_tries = sampler.sample(3)  # first 6 draws: 3 3 5 3 7 9 -> 3, 5, 7 found at draw 5
    assert ids.tolist() == [3, 5, 7] and n_tries == 5
    ids, n_tries = sampler.sample(3)  # 3 5 11 | 5 5 12 ... -> 3 found in draw 1, 5 in 2, 11 in 3
    assert ids.tolist() == [3, 5, 11] and n_tries == 3
    stream = iter([4, 4, 4, 4, 4, 4, 4, 6, 8])  # six draws, one id: K = 3 more, 6 found at draw 8
    ids, n_tries = sampler.sample(3)
    assert ids.tolist() == [4, 6, 8] and n_tries == 9


class FixedSample(LogUniformSampler):
    """The log-uniform sampler with its draw fixed: these ids, found in `n_tries` draws."""

    def __init__(self, vocab_size: int, ids: list[int], n_tries: int):
        super().__init__(vocab_size)
        self.ids, self.n_tries = torch.tensor(ids), n_tries

    def sample(self, n_samples: int) -> tuple[torch.Tensor, int]:
        assert n_samples == len(self.ids)
        return self.ids.clone(), self.n_tries


def plain_sampled_nll(model: LanguageModel, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The sampled softmax's NLL of each target (N,), the plain autograd way (the (N, 1+K) logits
    whole): the reference of the one-pass `nll_sums(sampled=True)`; one sample from the RNG."""
    negatives, n_tries = model.sampler.sample(model.n_samples)  # (K,)
    weight, bias = model.softmax.weight, model.softmax.bias
    log_q = lambda ids: torch.log(model.sampler.expected_count(ids, n_tries, model.n_samples)).float()  # noqa: E731
    true_logits = (hidden * weight[targets]).sum(-1) + bias[targets] - log_q(targets)  # (N,)
    sampled_logits = hidden @ weight[negatives].t() + bias[negatives] - log_q(negatives)  # (N, K)
    hits = targets.unsqueeze(1) == negatives.unsqueeze(0)  # accidental hits are removed
    logits = torch.cat([true_logits.unsqueeze(1), sampled_logits.masked_fill(hits, float("-inf"))], dim=1)
    return -torch.log_softmax(logits, dim=1)[:, 0]


def test_sampled_softmax_is_tensorflows_formula_on_a_fixed_sample():
    """tf.nn.sampled_softmax_loss as bilm-tf calls it (log-uniform unique sampler, subtract_log_q,
    remove_accidental_hits), computed by hand in plain Python floats for a fixed sample:

        Q(k) = 1 - (1 - p(k))^n_tries,  p(k) = log((k + 2) / (k + 1)) / log(V + 1)
        true logit = w_t . h + b_t - log Q(t);  sampled logit = w_s . h + b_s - log Q(s), dropped if s == t
        NLL = log(exp(true) + sum exp(sampled)) - true

    When the K ids took exactly K draws, TF's expected count is P(k) K instead (`ExpectedCountHelper`).
    The training loss (`nll_sums`) is checked here; test_softmax holds its gradients to autograd's."""
    for n_tries in (9, 5):
        _check_sampled_softmax([0, 3, 7, 12, 31], n_tries)


def _check_sampled_softmax(negatives: list[int], n_tries: int) -> None:
    model = make_model(n_samples=len(negatives)).train()
    model.sampler = FixedSample(VOCAB, negatives, n_tries)
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(4, 6, generator=generator)
    targets = torch.tensor([3, 5, 31, 0])  # three of them are also sampled: accidental hits

    weight, bias, rows = model.softmax.weight.tolist(), model.softmax.bias.tolist(), hidden.tolist()

    def log_q(k: int) -> float:
        p = math.log((k + 2) / (k + 1)) / math.log(VOCAB + 1)
        return math.log(p * n_tries if n_tries == len(negatives) else 1 - (1 - p) ** n_tries)

    def logit(h: list[float], k: int) -> float:
        return sum(a * b for a, b in zip(h, weight[k])) + bias[k] - log_q(k)

    expected = []
    for h, target in zip(rows, targets.tolist()):
        true = logit(h, target)
        sampled = [logit(h, k) for k in negatives if k != target]
        expected.append(math.log(math.exp(true) + sum(math.exp(s) for s in sampled)) - true)
    torch.testing.assert_close(plain_sampled_nll(model, hidden, targets), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.nll_sums([hidden], [targets], sampled=True)[0], torch.tensor(expected).sum(),
                               atol=1e-5, rtol=1e-5)
    # and not the uncorrected formula: without log Q the numbers differ
    uncorrected = [math.log(math.exp(logit(h, t) + log_q(t)) + sum(math.exp(logit(h, k) + log_q(k))
                                                                  for k in negatives if k != t)) - logit(h, t) - log_q(t)
                   for h, t in zip(rows, targets.tolist())]
    assert not torch.allclose(plain_sampled_nll(model, hidden, targets), torch.tensor(uncorrected), atol=1e-3)


@pytest.mark.skipif(not kernels.onednn_active(),
                    reason="this torch has no oneDNN linear ops (or ELMOKIT_KERNELS=torch is set)")
@pytest.mark.parametrize("n_samples", [0, 25])
def test_a_training_step_runs_every_product_through_onednn(n_samples):
    """Forward, backward (token encoder, both LSTM layers, the softmax) and the optimizer step of a
    training step on the CPU: every matrix product is oneDNN's, none goes to torch's plain
    (MKL) products, which run AVX2 code on AMD CPUs at about half of oneDNN's speed."""
    from torch.profiler import ProfilerActivity, profile

    plain_products = {"aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_", "aten::baddbmm", "aten::matmul"}
    chars, ids = random_streams(4, 12, seed=5)
    model = make_model(clip=3.0, dropout=0.1, n_samples=n_samples).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def step(batch):
        loss = model(batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    step(window(chars, ids, 0, 6))  # the kernels' one-time checks (which use torch's products) happen here
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(window(chars, ids, 6, 6))
    operators = {event.key: event.count for event in prof.key_averages()}
    assert operators.get("mkldnn::_linear_pointwise", 0) > 0
    assert not plain_products & operators.keys(), {k: operators[k] for k in plain_products & operators.keys()}


@pytest.mark.parametrize("batched", [False, True])
def test_a_layer_of_no_steps_returns_its_state(batched):
    """U = 0 steps (an empty window): no outputs, the final state the initial one, both products."""
    from elmokit.training.recurrence import RecurrenceOptions, lstm_layer

    cell_dim, dim, rows = 8, 4, 3
    hidden, cell = torch.randn(2, rows, dim), torch.randn(2, rows, cell_dim)
    weights = (torch.randn(2, 4 * cell_dim, dim), torch.randn(2, 4 * cell_dim, dim), torch.randn(2, 1, 4 * cell_dim),
               torch.randn(2, dim, cell_dim))
    products = RecurrenceOptions(batched=batched).products(torch.device("cpu"))
    outputs, final_hidden, final_cell = lstm_layer(torch.randn(2, 0, rows, dim), hidden, cell, *weights,
                                                   products=products)
    assert outputs.shape == (2, 0, rows, dim)
    assert torch.equal(final_hidden, hidden) and torch.equal(final_cell, cell)
