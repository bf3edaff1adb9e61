"""The training recipe's semantics, each against a hand-written expectation: Adagrad with its
initial accumulator and the global gradient clip, the average perplexity of two directions that
differ, bilm-tf's char-CNN initialisation per activation, the one `seed_everything`, and the
devices refused whatever form names them."""

from __future__ import annotations

import copy
import math
import random

import numpy as np
import pytest
import torch

from elmokit import BiLM, CharCNNConfig, ElmoConfig, LSTMConfig
from elmokit.devices import resolve_device
from elmokit.training.build import build_optimizer
from elmokit.training.config import TrainConfig
from elmokit.training.loop import evaluate, train_step
from elmokit.training.perplexity import SentenceScore
from elmokit.training.processes import Dist, seed_everything
from tests.test_lm import make_model, random_streams, window


def test_adagrad_and_the_gradient_clip_are_the_hand_written_update(tmp_path):
    """Two `train_step`s with Adagrad (initial accumulator 0.7) and a clip to global norm 0.02
    (which binds): every parameter as g' = g min(1, 0.02 / (|g| + 1e-6)), a = 0.7 + sum g'^2,
    p -= lr g' / (sqrt(a) + 1e-10), written out here."""
    config = TrainConfig(output_dir=str(tmp_path), optimizer="adagrad", lr=0.2, initial_accumulator=0.7,
                         grad_clip=0.02)
    model = make_model(dropout=0.0).train()
    expected = copy.deepcopy(model)
    optimizer = build_optimizer(config, model)
    parameters = list(expected.parameters())
    accumulators = [torch.full_like(p, 0.7) for p in parameters]
    chars, ids = random_streams(2, 10)
    for start in (0, 5):
        batch = window(chars, ids, start, 5)
        result = train_step(model, optimizer, batch, None, config.lr, config, Dist())
        grads = torch.autograd.grad(expected(batch).loss, parameters, allow_unused=True)
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads if g is not None))
        assert norm > 10 * config.grad_clip  # the clip binds
        assert result.grad_norm == pytest.approx(norm, rel=1e-5)
        scale = min(1.0, config.grad_clip / (norm + 1e-6))
        with torch.no_grad():
            for parameter, grad, accumulator in zip(parameters, grads, accumulators):
                if grad is None:
                    continue
                accumulator.add_((grad * scale).square())
                parameter.sub_(config.lr * grad * scale / (accumulator.sqrt() + 1e-10))
    for (name, got), want in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=name)


def test_average_perplexity_is_exp_of_the_mean_nll_of_two_directions_that_differ():
    """ppl = exp((forward NLL + backward NLL) / 2), the geometric mean of the two perplexities, on
    a model whose directions differ (the backward top layer's projection zeroed, the forward one's
    and the softmax scaled up)."""
    model = make_model().eval()
    with torch.no_grad():
        model.bilm.lstm.layers[-1].projection[1].zero_()
        model.bilm.lstm.layers[-1].projection[0].mul_(10.0)
        model.softmax.weight.mul_(10.0)
    chars, ids = random_streams(3, 10)
    batches = [window(chars, ids, start, 5) for start in (0, 5)]
    sums, state = [0.0, 0.0, 0], None
    with torch.no_grad():
        for batch in batches:
            out = model(batch, state)
            state = out.state
            sums = [sums[0] + float(out.forward_nll), sums[1] + float(out.backward_nll), sums[2] + out.n_targets]
    forward, backward = sums[0] / sums[2], sums[1] / sums[2]
    result = evaluate(model, batches, torch.device("cpu"))
    assert result["forward_ppl"] == pytest.approx(math.exp(forward), rel=1e-6)
    assert result["backward_ppl"] == pytest.approx(math.exp(backward), rel=1e-6)
    assert abs(math.log(result["forward_ppl"] / result["backward_ppl"])) > 0.3  # the directions differ
    assert result["ppl"] == pytest.approx(math.exp(0.5 * (forward + backward)), rel=1e-6)
    assert result["ppl"] == pytest.approx(math.sqrt(result["forward_ppl"] * result["backward_ppl"]), rel=1e-6)
    score = SentenceScore(n_targets=4, forward_nll=8.0, backward_nll=2.0)
    assert (score.forward_ppl, score.backward_ppl, score.ppl) == pytest.approx((math.e ** 2, math.e ** 0.5, math.e ** 1.25))


@pytest.mark.parametrize("activation", ["relu", "tanh"])
def test_char_cnn_initialisation_follows_bilm_tf_for_each_activation(activation):
    """bilm-tf: relu filters uniform in ±0.05, tanh filters normal with std sqrt(1 / (w E))."""
    torch.manual_seed(0)
    config = ElmoConfig(CharCNNConfig(embedding_dim=16, filters=((1, 64), (4, 128)), n_highway=1,
                                      activation=activation),
                        LSTMConfig(cell_dim=8, projection_dim=4, n_layers=1))
    model = BiLM(config)
    for conv, (width, _) in zip(model.token_encoder.char_cnn.convolutions, config.char_cnn.filters):
        weight = conv.weight.detach()
        if activation == "relu":
            assert 0.049 < float(weight.abs().max()) <= 0.05
            assert float(weight.std()) == pytest.approx(0.05 / math.sqrt(3), rel=0.05)
        else:
            assert float(weight.std()) == pytest.approx(math.sqrt(1 / (width * 16)), rel=0.05)
        assert not conv.bias.any()


def test_one_seed_everything_seeds_every_generator():
    """The one definition (training and tasks share it) seeds Python's, NumPy's and torch's RNGs."""
    import importlib

    task_train = importlib.import_module("elmokit.tasks.train")  # the package re-exports a function `train`

    assert task_train.seed_everything is seed_everything
    draws = []
    for _ in range(2):
        seed_everything(11)
        draws.append((random.random(), float(np.random.rand()), float(torch.rand(()))))
        random.seed(3), np.random.seed(3), torch.manual_seed(3)  # noqa: B018 (anything else in between)
    random.seed(11)
    np.random.seed(11)
    torch.manual_seed(11)
    assert draws[0] == draws[1] == (random.random(), float(np.random.rand()), float(torch.rand(())))


@pytest.mark.parametrize("device", ["mps", torch.device("mps"), torch.device("meta"), "meta"])
def test_devices_elmokit_cannot_run_are_refused_by_name_or_object(device):
    """`torch.device("mps")` is refused as the string "mps" is (training runs float64 products,
    which MPS lacks); so is any device other than the CPU and CUDA."""
    with pytest.raises(ValueError, match="device must be cpu, cuda"):
        resolve_device(device)
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_a_part_empty_window_steps_in_proportion_to_its_targets(tmp_path):
    """At an epoch's end rows run dry and a window holds few targets (the last PTB window of 32 x
    20 holds 4). Every target weighs 1 / (B U) in the gradient whatever the window's fill: the
    gradient of the summed NLL over the window's positions (bilm-tf's mean over a full window);
    the reported loss stays the mean over the window's targets. A mean over the targets gave
    those 4 the weight of a whole window (the validation perplexity jumped 606 -> 10,044)."""
    config = TrainConfig(output_dir=str(tmp_path), grad_clip=0.0)
    chars, ids = random_streams(4, 6, seed=3)
    for lengths in ([6, 6, 6, 6], [6, 2, 0, 0], [1, 0, 0, 0]):
        model = make_model(dropout=0.0).train()
        expected = copy.deepcopy(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the gradients, no update
        batch = window(chars, ids, 0, 6, lengths=lengths)
        result = train_step(model, optimizer, batch, None, 0.0, config, Dist())
        out = expected(batch)
        assert result.n_tokens == sum(lengths)
        assert result.loss == pytest.approx(float(out.loss), rel=1e-5)  # the mean over its targets
        summed = 0.5 * (out.forward_nll + out.backward_nll)
        grads = torch.autograd.grad(summed / batch.mask.numel(), list(expected.parameters()), allow_unused=True)
        for parameter, grad in zip(model.parameters(), grads):
            if grad is not None:
                torch.testing.assert_close(parameter.grad, grad, rtol=1e-4, atol=1e-7)
