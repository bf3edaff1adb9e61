"""The one LSTM cell (`elmokit.model.cell`) through each of its three drivers, against the
float64 reference of spec §5-§7 (tests/reference.py): the stateless stream engine on the golden
fixture's weights and on those weights scaled until both clips bind, and every dropout placement
at a nonzero rate with fixed masks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from elmokit import batch_to_ids, load_original, save_original
from elmokit.inference.engine import bilm_forward
from elmokit.model import cell as lstm_cell
from elmokit.model.lstm import BiLstm
from elmokit.training.recurrence import forward_streams
from tests.reference import read_weights, reference_bilm

CELL_CLIP, PROJ_CLIP = 0.8, 1.5  # different, so that swapping the two clips shows


def _fixture_sentences(fixture_dir, n: int = 4) -> list[list[str]]:
    groups = json.loads((fixture_dir / "sentences.json").read_text())
    return [sentence.split() for sentence in groups[0][:n]]


def _engine_layers(model, sentences) -> list[np.ndarray]:
    """The stateless stream engine's layers of each sentence, (L+1, n+2, 2P) float64; the step loop
    refused, so a call that fell back to it fails."""
    with torch.no_grad():
        output = bilm_forward(model, batch_to_ids(sentences))
    assert output.state is None  # the engine's answer (the step loop returns a state)
    layers = torch.stack(output.layers).double().numpy()
    return [layers[:, row, :len(sentence) + 2] for row, sentence in enumerate(sentences)]


def _no_step_loop(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the step loop ran where the stream engine should")
    monkeypatch.setattr(BiLstm, "forward", refuse)


def test_stream_engine_replays_the_fixture_weights(fixture_dir, monkeypatch):
    """bilm-tf's golden weights through the engine that serves `Elmo`, `ElmoEmbedder` and
    `elmo embed`, each sentence from a zero state, against the float64 reference."""
    model = load_original(fixture_dir / "options.json", fixture_dir / "lm_weights.hdf5").eval()
    weights = read_weights(fixture_dir / "lm_weights.hdf5")
    sentences = _fixture_sentences(fixture_dir)
    _no_step_loop(monkeypatch)
    for got, sentence in zip(_engine_layers(model, sentences), sentences):
        expected = reference_bilm(weights, model.config, sentence, model.lstm.cell_clip, model.lstm.proj_clip)
        for k, layer in enumerate(expected):
            np.testing.assert_allclose(got[k], layer, atol=2e-5, rtol=0, err_msg=f"layer {k}")


@pytest.fixture
def clipping_model(fixture_dir, tmp_path):
    """The fixture's model with its LSTM weights scaled (x4) and its clips set to CELL_CLIP and
    PROJ_CLIP, so that both clips bind on a measurable fraction of the values, in float64 (the
    scaled recurrence amplifies float32's rounding past any useful tolerance, and a mask that
    depends on the values needs the values exact); and its weights in the original layout
    (written by save_original, read back as arrays) for the reference."""
    model = load_original(fixture_dir / "options.json", fixture_dir / "lm_weights.hdf5").eval()
    with torch.no_grad():
        for layer in model.lstm.layers:
            for weight in (layer.input_weight, layer.recurrent_weight, layer.projection):
                weight.mul_(4.0)
    model.lstm.cell_clip, model.lstm.proj_clip = CELL_CLIP, PROJ_CLIP
    save_original(model, tmp_path / "options.json", tmp_path / "weights.hdf5")
    return model.double(), read_weights(tmp_path / "weights.hdf5")


def _reference(model, weights, sentences, **kwargs) -> tuple[list[list[np.ndarray]], dict]:
    clipped = {}
    layers = [reference_bilm(weights, model.config, sentence, CELL_CLIP, PROJ_CLIP, clipped=clipped, **kwargs)
              for sentence in sentences]
    return layers, clipped


def _assert_every_driver_gives(expected, model, sentences, step_loop, monkeypatch):
    """The step loop's output (`step_loop`, already run), the training recurrence and the stream
    engine each give `expected` (per sentence, per layer) to 1e-6; leaves the step loop disabled."""
    for row, sentence in enumerate(sentences):
        for k, layer in enumerate(expected[row]):
            got = step_loop.layers[k][row, :len(sentence) + 2].detach().double().numpy()
            np.testing.assert_allclose(got, layer, atol=1e-6, rtol=0, err_msg=f"step loop, layer {k}")

    for row, sentence in enumerate(sentences):  # training's recurrence: one sentence, both streams
        tokens = torch.from_numpy(expected[row][0][:, :16])  # (n+2, P): the token layer
        layers, _ = forward_streams(model.lstm, torch.stack([tokens, tokens.flip(0)])[:, None])  # (D, 1, U, P)
        for k, layer in enumerate(layers, start=1):
            got = torch.cat([layer[0, 0], layer[1, 0].flip(0)], dim=-1).detach().double().numpy()
            np.testing.assert_allclose(got, expected[row][k], atol=1e-6, rtol=0, err_msg=f"recurrence, layer {k}")

    _no_step_loop(monkeypatch)
    for got, want in zip(_engine_layers(model, sentences), expected):
        for k, layer in enumerate(want):
            np.testing.assert_allclose(got[k], layer, atol=1e-6, rtol=0, err_msg=f"engine, layer {k}")


def test_every_driver_clips_where_the_reference_does(clipping_model, fixture_dir, monkeypatch):
    """Both clips bind on at least 10% of their values; the stream engine, the step loop (with
    gradients, as fine-tuning runs) and the training recurrence all give the reference's layers."""
    model, weights = clipping_model
    sentences = _fixture_sentences(fixture_dir)
    expected, clipped = _reference(model, weights, sentences)
    for name, (hit, total) in clipped.items():
        assert hit / total > 0.1, f"the {name} clip binds on {hit} of {total} values only"

    step_loop = model(batch_to_ids(sentences))  # gradients enabled: BiLM.forward's step loop
    assert step_loop.state is not None
    _assert_every_driver_gives(expected, model, sentences, step_loop, monkeypatch)


# ---------------------------------------------------------------------------------------------
# Dropout at a nonzero rate: fixed masks, the same wherever the values are laid out
# ---------------------------------------------------------------------------------------------
RATE = 0.3


def sign_dropout(input, p=0.5, training=True, inplace=False):
    """F.dropout with a mask that is a function of each value (kept where > 0), not of the RNG or
    of where the value sits: every driver's layout of the same values gets the same mask."""
    if not training or p == 0:
        return input
    return input * (input > 0).to(input.dtype) / (1 - p)


def sign_drop(values: np.ndarray) -> np.ndarray:
    return values * (values > 0) / (1 - RATE)


def test_every_driver_drops_each_layer_input_and_adds_the_dropped_input(clipping_model, fixture_dir, monkeypatch):
    """In training at dropout 0.3, every layer's input is dropped and the residual (layer 2 on)
    adds the dropped input (bilm-tf's DropoutWrapper(ResidualWrapper(cell))): the step loop, the
    recurrence and the stream engine against the reference with the same masks."""
    model, weights = clipping_model
    model.lstm.dropout = RATE
    model.train()
    monkeypatch.setattr(F, "dropout", sign_dropout)
    sentences = _fixture_sentences(fixture_dir, 3)
    expected, _ = _reference(model, weights, sentences, drop=sign_drop)
    undropped, _ = _reference(model, weights, sentences)
    assert max(np.abs(a[-1] - b[-1]).max() for a, b in zip(expected, undropped)) > 0.1  # the masks matter

    step_loop = model(batch_to_ids(sentences))
    _assert_every_driver_gives(expected, model, sentences, step_loop, monkeypatch)


def test_dropout_is_torch_dropout_with_a_seeded_bernoulli_mask():
    """The stack's dropout is F.dropout itself: under a seed, x * Bernoulli(1 - p) / (1 - p) with
    the mask drawn from that seed (so the sign masks above stand for the real ones); in eval mode
    and at rate 0 the input is returned untouched."""
    values = torch.randn(2, 5, 3, 4)
    seen = []
    run = lambda layer, dropped, index: (seen.append(dropped) or dropped * 0, None)  # noqa: E731
    torch.manual_seed(7)
    lstm_cell.run_layers([None], values, RATE, True, run)
    torch.manual_seed(7)
    mask = torch.empty_like(values).bernoulli_(1 - RATE)
    torch.testing.assert_close(seen[0], values * mask / (1 - RATE))
    assert 0 < (seen[0] == 0).float().mean() < 0.6
    for rate, training in ((RATE, False), (0.0, True)):
        seen.clear()
        lstm_cell.run_layers([None], values, rate, training, run)
        assert seen[0] is values


def test_the_doubled_activation_is_the_activation():
    """The engine's one-sigmoid form of the gates equals sigmoid/tanh of the plain pre-activations."""
    gates = torch.randn(3, 4 * 5, dtype=torch.float64) * 4
    doubled = gates.clone()
    doubled[:, 15:] *= 2
    torch.testing.assert_close(lstm_cell.activate_doubled_gates_(doubled), lstm_cell.activate_gates(gates))
    torch.testing.assert_close(lstm_cell.tanh_via_sigmoid(gates), torch.tanh(gates))


def test_the_language_model_drops_the_top_layer_before_the_softmax(monkeypatch):
    """In training, the LM's loss is the full softmax's NLL of the top layer with dropout applied
    (bilm-tf's dropout before the softmax), the LSTM's own dropout as the drivers above."""
    from tests.test_lm import make_model, random_streams, window

    model = make_model(dropout=RATE).train()  # full softmax
    monkeypatch.setattr(F, "dropout", sign_dropout)
    batch = window(*random_streams(3, 6), 0, 6)
    loss = model(batch).loss
    hidden, _ = model.contextualize(batch.forward_char_ids, batch.backward_char_ids, None)  # (D, B, U, P)
    targets = (batch.forward_targets, batch.backward_targets)
    for top, message in ((sign_dropout(hidden, RATE), None), (hidden, "undropped")):
        nll = [F.cross_entropy(model.softmax(top[d][batch.mask]), targets[d][batch.mask], reduction="sum")
               for d in range(2)]
        expected = 0.5 * (nll[0] + nll[1]) / int(batch.mask.sum())
        if message is None:
            torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
        else:
            assert abs(float((loss - expected).detach())) > 1e-3, message


def test_elmo_drops_each_mixed_representation(tiny_model, monkeypatch):
    """`Elmo(dropout=p)` in training mode returns each scalar mix with dropout applied; in eval
    mode, the mix itself."""
    from elmokit import Elmo
    from tests.conftest import SENTENCES

    elmo = Elmo(module=tiny_model, num_output_representations=2, dropout=RATE,
                scalar_mix_parameters=[0.0, 1.0, -1.0])
    ids = batch_to_ids(SENTENCES)
    with torch.no_grad():
        plain = elmo.eval()(ids)["elmo_representations"]
        monkeypatch.setattr(F, "dropout", sign_dropout)
        dropped = elmo.train()(ids)["elmo_representations"]
    for want, got in zip(plain, dropped):
        assert (want < 0).any()
        torch.testing.assert_close(got, want * (want > 0) / (1 - RATE))


@pytest.mark.parametrize("cell", ["fused", "eager"])
def test_stream_engine_in_bfloat16_rounds_the_products_and_keeps_the_cell_in_float32(cell, monkeypatch):
    """Weights in bfloat16: each product (the gate inputs with their bias included) rounded once
    to bfloat16; a step's gates the float32 sum of its two terms, the gate inputs and the
    recurrent product (`engine.recurrent_gates`: the sum not rounded); the cell state, the
    recurrent state and the outputs float32. Written out here per step and direction; the engine
    agrees to a mean error of eps/16 of the values' mean size (eps = 2^-8, bfloat16's; rounding
    the gates' sum to bfloat16 too, as one product with its addend does, costs ~eps). With the
    compiled cell (`fused_cell`, where it runs) and with the eager one."""
    from elmokit.model import fused_cell

    if cell == "eager":
        monkeypatch.setitem(fused_cell._STATE, "library", None)
    elif not fused_cell.available():
        pytest.skip(f"the fused cell does not run here ({fused_cell.status()[1]})")
    from elmokit import BiLM, CharCNNConfig, ElmoConfig, LSTMConfig
    from elmokit.inference.engine import candidate_doubled, stream_layer, stream_layout

    torch.manual_seed(0)
    config = ElmoConfig(CharCNNConfig(4, ((1, 4), (2, 8)), 1), LSTMConfig(32, 16, 1, 3.0, 3.0))
    layer = BiLM(config).lstm.layers[0]
    with torch.no_grad():
        layer.bias.normal_(0.0, 0.5)
    low = layer.to(torch.bfloat16)
    layout = stream_layout(np.array([40, 25, 33]), 3)
    n_steps, rows = layout.forward_index.shape
    inputs = torch.randn(2, n_steps, rows, 16)  # (D, U, R, P)
    with torch.no_grad():
        got = stream_layer(low, inputs, layout, 3.0, 3.0).double()

    bf16 = lambda t: t.to(torch.bfloat16).double()  # noqa: E731  one rounding, of a float64 result
    doubled = candidate_doubled(low).double()[:, None]  # (4C, 1): the candidate's rows x2, exact
    weights = [(low.input_weight[d].double() * doubled, low.recurrent_weight[d].double() * doubled,
                low.projection[d].double()) for d in range(2)]
    bias = bf16(low.gate_bias().float().squeeze(1) * candidate_doubled(low))  # (D, 4C)
    expected = torch.zeros(2, n_steps, rows, 16, dtype=torch.float64)
    with torch.no_grad():
        for d, (input_weight, recurrent_weight, projection) in enumerate(weights):
            hidden, cell = torch.zeros(rows, 16, dtype=torch.float64), torch.zeros(rows, 32)
            for step in range(n_steps):
                keep = (~layout.starts[step])[:, None]
                hidden, cell = hidden * keep, cell * keep
                gate_inputs = bf16(bf16(inputs[d, step]) @ input_weight.T + bias[d])
                gates = (gate_inputs + bf16(bf16(hidden) @ recurrent_weight.T)).float()  # summed, not rounded
                cell, cell_output = lstm_cell.cell_step(lstm_cell.activate_doubled_gates_(gates), cell, 3.0,
                                                        tanh=lstm_cell.tanh_via_sigmoid)
                hidden = bf16(bf16(cell_output) @ projection.T).clamp(-3.0, 3.0)
                expected[d, step] = hidden
    epsilon = 2.0 ** -8
    assert float((got - expected).abs().mean()) <= epsilon / 16 * float(expected.abs().mean())
    assert float((got - expected).abs().max()) <= 2 * epsilon * float(expected.abs().max())
