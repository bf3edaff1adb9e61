"""LanguageModel: the loss, the token de-duplication, the carried state, the fused LSTM path and
the sampled softmax with its log-uniform sampler. Batches come from a tiny in-test generator."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from elmokit.config import CharCNNConfig, ElmoConfig, LSTMConfig
from elmokit.data import LMBatch
from elmokit.lm import LanguageModel, LogUniformSampler
from elmokit.lstm import LstmState

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
    layers, _ = model.bilm.lstm.forward_streams(tokens)
    torch.testing.assert_close(hidden, layers[-1], atol=1e-6, rtol=1e-5)


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


def test_fused_path_matches_the_step_by_step_lstm():
    """Without clipping the nn.LSTM kernel runs the same cell: outputs, state and gradients agree."""
    fused = make_model(clip=0.0)
    assert fused.fused is not None and make_model(clip=3.0).fused is None
    reference = make_model(clip=0.0)
    reference.fused = None
    chars, ids = random_streams(3, 8)
    batch = window(chars, ids, 0, 8)
    state = LstmState(torch.randn(2, 2, 3, 6), torch.randn(2, 2, 3, 12))
    outputs = []
    for model in (fused, reference):
        hidden, final = model.contextualize(batch.forward_char_ids, batch.backward_char_ids, state)
        hidden.square().sum().backward()
        outputs.append((hidden, final, model.bilm.lstm.layers[0].input_weight.grad))
    torch.testing.assert_close(outputs[0][0], outputs[1][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(outputs[0][1].hidden, outputs[1][1].hidden, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(outputs[0][1].cell, outputs[1][1].cell, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(outputs[0][2], outputs[1][2], atol=1e-5, rtol=1e-4)


def test_fused_path_is_not_part_of_the_state_dict():
    assert set(make_model(clip=0.0).state_dict()) == set(make_model(clip=3.0).state_dict())


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
    expected = sampler.expected_count(ids, n_tries)
    torch.testing.assert_close(expected, 1 - (1 - sampler.probability(ids)) ** n_tries)
    with pytest.raises(ValueError, match="n_samples"):
        sampler.sample(1000)


class FixedSample(LogUniformSampler):
    """The log-uniform sampler with its draw fixed: these ids, found in `n_tries` draws."""

    def __init__(self, vocab_size: int, ids: list[int], n_tries: int):
        super().__init__(vocab_size)
        self.ids, self.n_tries = torch.tensor(ids), n_tries

    def sample(self, n_samples: int) -> tuple[torch.Tensor, int]:
        assert n_samples == len(self.ids)
        return self.ids.clone(), self.n_tries


def test_sampled_softmax_is_tensorflows_formula_on_a_fixed_sample():
    """tf.nn.sampled_softmax_loss as bilm-tf calls it (log-uniform unique sampler, subtract_log_q,
    remove_accidental_hits), computed by hand in plain Python floats for a fixed sample:

        Q(k) = 1 - (1 - p(k))^n_tries,  p(k) = log((k + 2) / (k + 1)) / log(V + 1)
        true logit = w_t . h + b_t - log Q(t);  sampled logit = w_s . h + b_s - log Q(s), dropped if s == t
        NLL = log(exp(true) + sum exp(sampled)) - true

    (The training loss, nll_sum, is held to target_nll by test_one_pass_softmax_matches_cross_entropy.)"""
    negatives, n_tries = [0, 3, 7, 12, 31], 9
    model = make_model(n_samples=len(negatives)).train()
    model.sampler = FixedSample(VOCAB, negatives, n_tries)
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(4, 6, generator=generator)
    targets = torch.tensor([3, 5, 31, 0])  # three of them are also sampled: accidental hits

    weight, bias, rows = model.softmax.weight.tolist(), model.softmax.bias.tolist(), hidden.tolist()

    def log_q(k: int) -> float:
        p = math.log((k + 2) / (k + 1)) / math.log(VOCAB + 1)
        return math.log(1 - (1 - p) ** n_tries)

    def logit(h: list[float], k: int) -> float:
        return sum(a * b for a, b in zip(h, weight[k])) + bias[k] - log_q(k)

    expected = []
    for h, target in zip(rows, targets.tolist()):
        true = logit(h, target)
        sampled = [logit(h, k) for k in negatives if k != target]
        expected.append(math.log(math.exp(true) + sum(math.exp(s) for s in sampled)) - true)
    torch.testing.assert_close(model.target_nll(hidden, targets, sampled=True), torch.tensor(expected),
                               atol=1e-5, rtol=1e-5)
    # and not the uncorrected formula: without log Q the numbers differ
    uncorrected = [math.log(math.exp(logit(h, t) + log_q(t)) + sum(math.exp(logit(h, k) + log_q(k))
                                                                  for k in negatives if k != t)) - logit(h, t) - log_q(t)
                   for h, t in zip(rows, targets.tolist())]
    assert not torch.allclose(model.target_nll(hidden, targets, sampled=True), torch.tensor(uncorrected), atol=1e-3)
