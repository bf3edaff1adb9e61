"""elmokit.inference.layers: the layer selection and the sentence vector, in numpy and torch,
checked against sums written out element by element (not numpy's or torch's mean)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elmokit.inference.layers import (
    OUTPUT_FORMATS,
    select_layers,
    sentence_vector,
    shape_output,
    token_mean,
)


def random_layers(n_layers: int = 3, n_tokens: int = 4, dim: int = 6, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n_layers, n_tokens, dim)).astype(np.float32)


def expected_vector(layers: np.ndarray) -> np.ndarray:
    """(L+1, n, D) -> (D,): sum every layer at every token, divide by their count (float64)."""
    total = np.zeros(layers.shape[-1])
    for layer in layers:
        for token in layer:
            total += token
    return total / max(1, layers.shape[0] * layers.shape[1])


@pytest.mark.parametrize("backend", [np.asarray, torch.from_numpy])
def test_sentence_vector_is_the_token_mean_of_the_layer_average(backend):
    layers = random_layers()
    got = sentence_vector(backend(layers))
    assert type(got) is type(backend(layers)) and got.shape == (6,) and str(got.dtype).endswith("float32")
    np.testing.assert_allclose(np.asarray(got), expected_vector(layers), atol=1e-6)


@pytest.mark.parametrize("backend", [np.asarray, torch.from_numpy])
def test_empty_sentence_gives_zeros(backend):
    empty = random_layers(n_tokens=0)
    assert np.array_equal(np.asarray(sentence_vector(backend(empty))), np.zeros(6, np.float32))
    assert np.array_equal(np.asarray(shape_output(backend(empty), "all", True)), np.zeros((3, 6), np.float32))


def test_batch_with_lengths_is_each_sentence_alone():
    """A zero-padded batch (B, L+1, T, D) with lengths gives each row's own sentence vector."""
    sentences = [random_layers(n_tokens=n, seed=n) for n in (4, 1, 0)]
    batch = np.zeros((3, 3, 4, 6), np.float32)
    for row, layers in enumerate(sentences):
        batch[row, :, :layers.shape[1]] = layers
    lengths = np.array([4, 1, 0])
    for backend in (np.asarray, torch.from_numpy):
        got = np.asarray(sentence_vector(backend(batch), backend(lengths)))
        for row, layers in enumerate(sentences):
            np.testing.assert_allclose(got[row], expected_vector(layers), atol=1e-6)


def test_token_mean_divides_by_the_count_not_the_width():
    values = np.zeros((2, 5, 1), np.float32)
    values[0, :2, 0] = [1.0, 3.0]  # mean 2 over 2 tokens, not 4/5
    assert token_mean(values, np.array([2, 0]))[:, 0].tolist() == [2.0, 0.0]


def test_select_layers_each_format():
    layers = random_layers()
    assert select_layers(layers, "all") is layers
    np.testing.assert_array_equal(select_layers(layers, "top"), layers[2])
    np.testing.assert_allclose(select_layers(layers, "average"), (layers[0] + layers[1] + layers[2]) / 3, atol=1e-6)
    batch = torch.from_numpy(np.stack([layers, layers + 1]))  # (B, L+1, T, D): the layer axis is -3
    np.testing.assert_array_equal(select_layers(batch, "top")[1].numpy(), layers[2] + 1)
    with pytest.raises(ValueError, match="output format must be one of all, top, average, got 'mean'"):
        select_layers(layers, "mean")


@pytest.mark.parametrize("output_format", OUTPUT_FORMATS)
def test_shape_output_shapes_and_values(output_format):
    layers = random_layers()
    per_token = shape_output(layers, output_format, False)
    vectors = shape_output(layers, output_format, True)
    want_tokens = {"all": layers, "top": layers[2], "average": (layers[0] + layers[1] + layers[2]) / 3}[output_format]
    np.testing.assert_allclose(per_token, want_tokens, atol=1e-6)
    want_vector = sum(want_tokens[..., i, :] for i in range(4)) / 4  # the 4 tokens summed one by one
    np.testing.assert_allclose(vectors, want_vector, atol=1e-6)
    assert vectors.dtype == np.float32
