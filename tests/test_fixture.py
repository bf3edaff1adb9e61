"""Golden numbers of the original TensorFlow code (bilm-tf), replayed statefully (spec §9)."""

from __future__ import annotations

import json

import h5py
import numpy as np
import torch

from elmokit import ElmoEmbedder, batch_to_ids, load_original
from elmokit.model.chars import tokens_to_char_ids


def _fixture(fixture_dir):
    sentences = json.loads((fixture_dir / "sentences.json").read_text())
    expected = [h5py.File(fixture_dir / f"lm_embeddings_{k}.hdf5") for k in range(3)]
    return [[s.split() for s in group] for group in sentences], expected


def _top_layer_error(embed, fixture_dir):
    sentences, expected = _fixture(fixture_dir)
    error = 0.0
    for i in range(10):
        batch = [sentences[k][i] for k in range(3)]
        for k, layers in enumerate(embed(batch)):
            top = layers[2]  # (n, 2P): [forward | backward]
            got = np.stack([top[:, :16], top[:, 16:]])
            error = max(error, float(np.abs(got - expected[k][str(i)][...]).max()))
    return error


def test_stateful_replay_matches_the_original(fixture_dir):
    embedder = ElmoEmbedder(fixture_dir / "options.json", fixture_dir / "lm_weights.hdf5", stateful=True)
    assert _top_layer_error(embedder.embed_batch, fixture_dir) <= 1e-5


def test_stateful_replay_with_explicit_state(fixture_dir):
    model = load_original(fixture_dir / "options.json", fixture_dir / "lm_weights.hdf5")
    state = None

    def embed(batch):
        nonlocal state
        with torch.no_grad():
            output = model(batch_to_ids(batch), state)
        state = output.state
        return [torch.stack(output.layers)[:, row, 1:len(s) + 1].numpy() for row, s in enumerate(batch)]

    assert _top_layer_error(embed, fixture_dir) <= 1e-5


def test_fresh_state_is_not_what_the_fixture_holds(fixture_dir):
    embedder = ElmoEmbedder(fixture_dir / "options.json", fixture_dir / "lm_weights.hdf5")
    assert _top_layer_error(embedder.embed_batch, fixture_dir) > 0.1


def test_token_embeddings_match_the_original(fixture_dir):
    model = load_original(fixture_dir / "options.json", fixture_dir / "lm_weights.hdf5")
    vocab = (fixture_dir / "vocab_test.txt").read_text(encoding="utf-8").split("\n")
    with h5py.File(fixture_dir / "elmo_token_embeddings.hdf5") as file:
        expected = file["embedding"][...]
    with torch.no_grad():
        got = model.encode_tokens(torch.from_numpy(tokens_to_char_ids(vocab))).numpy()
    assert got.shape == expected.shape == (458, 16)
    assert np.abs(got - expected).max() <= 1e-5
