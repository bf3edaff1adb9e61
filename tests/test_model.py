"""BiLM: shapes, masking, batch invariance, determinism, gradients, and a float64 reference
written from the formulas of spec §5-§7 (independent of elmokit's packed layout)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elmokit import BiLM, CharCNNConfig, ElmoConfig, LSTMConfig, ScalarMix, batch_to_ids, save_original
from elmokit.inference.engine import contextualize_sentences, stream_layout
from elmokit.training.recurrence import forward_streams
from tests.conftest import SENTENCES, tiny_config
from tests.reference import read_weights, reference_bilm


def test_output_shapes_and_padding(tiny_model):
    char_ids = batch_to_ids(SENTENCES)
    output = tiny_model(char_ids)
    batch, n_tokens = len(SENTENCES), max(map(len, SENTENCES))
    assert len(output.layers) == 3
    for layer in output.layers:
        assert layer.shape == (batch, n_tokens + 2, 12)
    lengths = torch.tensor([len(s) for s in SENTENCES])
    assert output.mask.tolist() == (torch.arange(n_tokens + 2) < (lengths + 2)[:, None]).tolist()
    for layer in output.layers:
        assert (layer[~output.mask] == 0).all()
        assert (layer[output.mask].abs().sum(-1) > 0).all()
    first = output.layers[0]
    assert torch.equal(first[..., :6], first[..., 6:])  # the token layer, twice
    assert output.state.hidden.shape == (2, 2, batch, 6) and output.state.cell.shape == (2, 2, batch, 12)


def test_same_sentence_same_vectors_whatever_the_batch(tiny_model):
    with torch.no_grad():
        mixed = tiny_model(batch_to_ids(SENTENCES))
        for row, sentence in enumerate(SENTENCES):
            alone = tiny_model(batch_to_ids([sentence]))
            n = len(sentence) + 2
            for a, b in zip(alone.layers, mixed.layers):
                assert torch.allclose(a[0, :n], b[row, :n], atol=1e-5)


def test_deterministic_and_stateless(tiny_model):
    char_ids = batch_to_ids(SENTENCES)
    with torch.no_grad():
        first = tiny_model(char_ids)
        second = tiny_model(char_ids)
        carried = tiny_model(char_ids, first.state)
    for a, b, c in zip(first.layers, second.layers, carried.layers):
        assert torch.equal(a, b)
    assert torch.equal(first.layers[0], carried.layers[0])  # the token layer never sees state
    assert not torch.allclose(first.layers[2], carried.layers[2], atol=1e-3)


def test_gradients_reach_every_parameter():
    torch.manual_seed(0)
    model = BiLM(tiny_config(), dropout=0.1).train()
    output = model(batch_to_ids(SENTENCES))
    sum(layer.sum() for layer in output.layers).backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_streams_match_sentences(tiny_model):
    """forward_streams on full rows equals the packed forward of the same sentences."""
    sentences = [["a", "b", "c"], ["d", "e", "f"]]
    with torch.no_grad():
        output = tiny_model(batch_to_ids(sentences))
        tokens = output.layers[0][..., :6]  # (B, S, P)
        streams, _ = forward_streams(tiny_model.lstm, torch.stack([tokens, tokens.flip(1)]))
    for k, layer in enumerate(streams, start=1):
        assert torch.allclose(layer[0], output.layers[k][..., :6], atol=1e-6)
        assert torch.allclose(layer[1].flip(1), output.layers[k][..., 6:], atol=1e-6)


def test_matches_float64_reference_of_the_spec(tiny_model, tmp_path):
    save_original(tiny_model, tmp_path / "options.json", tmp_path / "weights.hdf5")
    weights = read_weights(tmp_path / "weights.hdf5")
    sentences = [["Hello", "wörld", "!"], ["x"]]
    with torch.no_grad():
        output = tiny_model(batch_to_ids(sentences))
    for row, sentence in enumerate(sentences):
        expected = reference_bilm(weights, tiny_model.config, sentence, 3.0, 3.0)
        for k, layer in enumerate(expected):
            got = output.layers[k][row, :len(sentence) + 2].double().numpy()
            np.testing.assert_allclose(got, layer, atol=1e-5)


def test_scalar_mix_formula():
    layers = [torch.randn(2, 4, 6) for _ in range(3)]
    mix = ScalarMix(3, initial_scalar_parameters=[1.0, 2.0, 3.0], trainable=False)
    weights = np.exp([1.0, 2.0, 3.0]) / np.exp([1.0, 2.0, 3.0]).sum()
    expected = sum(float(w) * layer for w, layer in zip(weights, layers))
    assert torch.allclose(mix(layers), expected, atol=1e-6)
    assert not mix.scalar_parameters.requires_grad and not mix.gamma.requires_grad


def test_scalar_mix_layer_norm_uses_masked_batch_statistics():
    layers = [torch.randn(2, 5, 4) for _ in range(3)]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    mixed = ScalarMix(3, do_layer_norm=True)(layers, mask)
    expected = 0
    for layer in layers:
        values = layer[mask]  # (N, 4): every unmasked element
        expected = expected + (layer - values.mean()) / torch.sqrt(values.var(unbiased=False) + 1e-13) / 3
    assert torch.allclose(mixed, expected, atol=1e-5)


def test_scalar_mix_rejects_wrong_number_of_parameters():
    with pytest.raises(ValueError, match="3 values"):
        ScalarMix(3, initial_scalar_parameters=[1.0, 2.0])
    with pytest.raises(ValueError, match="3 values .* got 0"):  # an empty list is no default
        ScalarMix(3, initial_scalar_parameters=[])


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 50])
def test_sentences_streamed_through_rows_match_one_at_a_time(tiny_model, rows):
    """`contextualize_sentences` packs many sentences into `rows` recurrent rows with a state
    reset at each sentence start: every position, boundaries included, must equal the sentence
    run alone from a zero state (clipping is on in the tiny config)."""
    torch.manual_seed(1)
    sizes = np.array([2, 3, 7, 12, 2, 30, 5, 9, 4])  # 2 = an empty sentence (<S> </S>)
    tokens = torch.randn(int(sizes.sum()), tiny_model.config.lstm.projection_dim) * 3
    with torch.no_grad():
        layers = contextualize_sentences(tiny_model, tokens, sizes, rows)
        start = 0
        for size in sizes:
            alone = tiny_model.contextualize(tokens[start:start + size], torch.ones(1, size, dtype=torch.bool))
            for streamed, reference in zip(layers, alone.layers):
                torch.testing.assert_close(streamed[start:start + size], reference[0], atol=1e-6, rtol=0)
            start += size


def test_stream_layout_places_every_position_once():

    sizes = np.array([5, 2, 9, 3, 3, 7])
    layout = stream_layout(sizes, rows=3)
    n_positions = int(sizes.sum())
    for index in (layout.forward_index, layout.backward_index):
        placed = index[index < n_positions]
        assert sorted(placed.tolist()) == list(range(n_positions))
    assert int(layout.starts.sum()) == len(sizes)
    assert layout.forward_index.shape[0] == 10  # longest first into the shortest stream: 9, 7+3, 5+3+2
    # each sentence starts a stream segment: forward at its first position, backward at its last
    firsts = (np.cumsum(sizes) - sizes).tolist()
    for step, row in layout.starts.nonzero().tolist():
        sentence = firsts.index(int(layout.forward_index[step, row]))
        assert layout.backward_index[step, row] == firsts[sentence] + sizes[sentence] - 1


def test_char_cnn_is_the_convolution_with_max_pool(tiny_model):
    """The window-matmul CharCNN against torch's conv1d, with and without gradients (the latter
    in chunks)."""
    cnn = tiny_model.token_encoder.char_cnn
    char_ids = torch.randint(0, 262, (40, 50))
    chars = cnn.char_embedding(char_ids).transpose(1, 2)
    reference = torch.relu(torch.cat([conv(chars).amax(dim=-1) for conv in cnn.convolutions], dim=-1))
    torch.testing.assert_close(cnn(char_ids), reference, atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(cnn(char_ids), reference, atol=1e-6, rtol=1e-6)


def test_inference_products_equal_the_plain_ones_and_take_the_path_they_should(monkeypatch):
    """elmokit.kernels against products written out here (einsum in float64): in float32 without
    gradients through oneDNN (where this torch has it), in float64 and with gradients through the
    plain torch path; `path_counts` says which path ran each product."""
    from elmokit import kernels
    from elmokit.kernels import PackedLinear, linear

    monkeypatch.delenv(kernels.KERNELS_VARIABLE, raising=False)
    kernels.reset()

    def expected(x, weight, bias=None, addend=None):  # (rows, out) in float64
        out = torch.einsum("ri,oi->ro", x.double(), weight.double())
        return out + (0 if bias is None else bias.double()) + (0 if addend is None else addend.double())

    torch.manual_seed(2)
    weight, bias = torch.randn(24, 10), torch.randn(24)
    fast = "onednn" if kernels.onednn_active() else "torch"
    with torch.no_grad():
        product = PackedLinear(weight, rows=5)
        for rows in (1, 5, 33):
            x, addend = torch.randn(rows, 10), torch.randn(rows, 24)
            before = dict(kernels.path_counts)
            results = [(linear(x, weight, bias), expected(x, weight, bias)),
                       (product(x, bias), expected(x, weight, bias)), (product(x), expected(x, weight)),
                       (product.add(addend, x), expected(x, weight, addend=addend))]
            for got, want in results:
                assert got.dtype == torch.float32
                torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
            assert kernels.path_counts[fast] - before.get(fast, 0) == 4  # every one of them the fast path
        assert linear(torch.randn(3, 4, 10), weight).shape == (3, 4, 24)

        before = dict(kernels.path_counts)  # float64: oneDNN is never asked, the plain product runs
        plain = PackedLinear(weight.double(), rows=5)
        x, addend = torch.randn(4, 10, dtype=torch.float64), torch.randn(4, 24, dtype=torch.float64)
        torch.testing.assert_close(plain(x, bias.double()), expected(x, weight, bias))
        torch.testing.assert_close(plain.add(addend, x), expected(x, weight, addend=addend))
        assert kernels.path_counts["torch"] - before.get("torch", 0) == 2
        assert kernels.path_counts["onednn"] == before.get("onednn", 0)

    # with gradients (training): the forward product and both gradient products on the fast path,
    # the gradients those of the float64 products; under autocast, F.linear (autocast picks the dtype)
    before = dict(kernels.path_counts)
    weight.requires_grad_(True)
    bias.requires_grad_(True)
    x = torch.randn(2, 5, 10, requires_grad=True)
    upstream = torch.randn(2, 5, 24)
    out = linear(x, weight, bias)
    torch.testing.assert_close(out.double(), expected(x.view(10, 10), weight, bias).view(2, 5, 24), atol=1e-5, rtol=1e-5)
    out.backward(upstream)
    flat_up = upstream.double().view(10, 24)
    torch.testing.assert_close(x.grad.double(), (flat_up @ weight.double()).view(2, 5, 10), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weight.grad.double(), flat_up.T @ x.double().view(10, 10), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bias.grad.double(), flat_up.sum(0), atol=1e-5, rtol=1e-5)
    assert kernels.path_counts[fast] - before.get(fast, 0) == 3
    before = dict(kernels.path_counts)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x, weight, bias).dtype == torch.bfloat16
    assert kernels.path_counts["torch"] - before.get("torch", 0) == 1
    kernels.reset()


def test_stream_follows_weights_changed_in_place(tiny_model):
    """The reordered weights are remade when a weight changes (e.g. loaded in place)."""
    from elmokit import ElmoEmbedder

    embedder = ElmoEmbedder(module=tiny_model, cache_tokens=False)
    before = embedder.embed_sentence(SENTENCES[0])
    with torch.no_grad():
        for layer in tiny_model.lstm.layers:
            layer.recurrent_weight.mul_(0.5)
    after = embedder.embed_sentence(SENTENCES[0])
    reference = tiny_model(batch_to_ids([SENTENCES[0]])).layers  # the differentiable path, no packing
    assert not np.allclose(before[1], after[1])
    np.testing.assert_allclose(after[1], reference[1][0, 1:-1].detach().numpy(), atol=1e-5)


def test_max_over_windows_is_the_max_and_its_first_window():
    """The char CNN's pooling (values and the window that holds them) against numpy's max and
    argmax (the first window among ties), with many ties (small integers) and a NaN."""
    from elmokit.model.encoder import max_over_windows

    generator = torch.Generator().manual_seed(0)
    products = torch.randint(-3, 4, (7, 12, 5), generator=generator).float()  # ties everywhere
    products[2, 4, 1] = float("nan")
    values, first = max_over_windows(products)
    array = products.numpy()
    finite = ~np.isnan(array).any(axis=1)
    np.testing.assert_array_equal(values.numpy()[finite], array.max(axis=1)[finite])
    np.testing.assert_array_equal(first.numpy()[finite], array.argmax(axis=1)[finite])
    assert first.dtype == torch.long and 0 <= int(first[2, 1]) < 12  # a NaN column still names a window


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("filters", [1, 32, 63, 64, 1024])
def test_window_max_is_numpys_max_in_the_products_dtype(dtype, filters):
    """The inference pooling (`window_max`; bfloat16's narrow convolutions widened first) gives
    numpy's max of the same values, in the products' dtype, infinities and NaN included."""
    from elmokit.model.encoder import window_max

    generator = torch.Generator().manual_seed(filters)
    products = (torch.randn(5, 9, filters, generator=generator) * 100).to(dtype)
    products[0, 3, 0], products[1, 0, -1], products[2, 8, 0] = float("inf"), float("-inf"), float("nan")
    pooled = window_max(products)
    assert pooled.dtype == dtype and pooled.shape == (5, filters)
    np.testing.assert_array_equal(pooled.float().numpy(), products.float().numpy().max(axis=1))


@pytest.mark.parametrize("cell_dim, projection_dim, n_highway, published", [
    (1024, 128, 1, 13_593_296), (4096, 512, 2, 93_600_848)])
def test_the_parameter_count_is_the_published_one(cell_dim, projection_dim, n_highway, published):
    """`BiLM.n_parameters` of the released shapes is the count the spec gives (the original files'
    weights): the char table's padding row, always zero, is not a weight."""
    config = ElmoConfig(char_cnn=CharCNNConfig(n_highway=n_highway),
                        lstm=LSTMConfig(cell_dim=cell_dim, projection_dim=projection_dim, n_layers=2))
    with torch.device("meta"):  # shapes only
        bilm = BiLM(config)
    assert bilm.n_parameters == published
