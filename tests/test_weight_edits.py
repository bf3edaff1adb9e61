"""Copies made from the weights follow them (`elmokit.kernels.weights_key`): the engine's reordered
or int8 products, int8's bfloat16 copies of the token encoder's weights and the embedder's token
cache. After a weight is edited in place (under `torch.no_grad()`) or replaced by `load_state_dict`,
an embedder that has already run gives what a fresh embedder of the edited model gives, in float32,
bfloat16 and int8."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from elmokit import ElmoEmbedder
from elmokit.model.int8 import int8_native
from elmokit.kernels import bf16_native
from tests.conftest import SENTENCES

DTYPES = [None,
          pytest.param("bfloat16", marks=pytest.mark.skipif(not bf16_native(), reason="no bfloat16 products")),
          pytest.param("int8", marks=pytest.mark.skipif(not int8_native(), reason="no VNNI or AMX-INT8"))]


def layers(embedder: ElmoEmbedder) -> list[np.ndarray]:
    return list(embedder.embed_sentences([list(sentence) for sentence in SENTENCES]))


def assert_same(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


def edit_in_place(bilm) -> None:
    with torch.no_grad():
        bilm.token_encoder.projection.weight.mul_(1.5)  # the token layer (the cache, int8's bfloat16 copy)
        bilm.lstm.layers[0].input_weight.mul_(1.5)  # the engine's products
        bilm.lstm.layers[-1].projection.mul_(0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_edit_in_place_is_seen_by_an_embedder_that_ran(tiny_model, dtype):
    embedder = ElmoEmbedder(module=tiny_model, dtype=dtype)
    before = layers(embedder)
    edit_in_place(embedder.bilm)
    after = layers(embedder)
    fresh = layers(ElmoEmbedder(module=copy.deepcopy(embedder.bilm), dtype=dtype))
    assert not np.allclose(after[0], before[0])
    assert_same(after, fresh)


@pytest.mark.parametrize("dtype", DTYPES)
def test_load_state_dict_is_seen_by_an_embedder_that_ran(tiny_model, dtype):
    edited = copy.deepcopy(tiny_model)
    edit_in_place(edited)
    embedder = ElmoEmbedder(module=tiny_model, dtype=dtype)
    layers(embedder)
    embedder.bilm.load_state_dict(edited.state_dict())
    assert_same(layers(embedder), layers(ElmoEmbedder(module=edited, dtype=dtype)))
