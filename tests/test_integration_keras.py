"""Keras 3 (torch backend): elmokit.integrations.keras.ElmoEmbedding gives hub.Module's outputs,
trains the mix's scalars only, works in Sequential and functional models, fit/predict, and a
saved .keras model refers to the biLM instead of copying it."""

from __future__ import annotations

import csv
import json
import os
import zipfile

import numpy as np
import pytest
import torch

os.environ.setdefault("KERAS_BACKEND", "torch")
keras = pytest.importorskip("keras", reason="the keras extra: pip install 'elmokit[keras]'")

from elmokit import hub  # noqa: E402
from elmokit.integrations.keras import ElmoEmbedding, texts_to_ids  # noqa: E402
from tests.conftest import DATA, REPO, require_shared  # noqa: E402

MODULE = REPO / "tests" / "fixtures" / "tfhub" / "elmo-module"  # its own mix: weights (0.3, -0.5, 0.9), scaling 1.7
TEXTS = ["the cat is on the mat", "dogs are in the fog", "a"]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ELMOKIT_CACHE", str(tmp_path / "cache"))
    keras.utils.set_random_seed(0)


def test_texts_to_ids_split_on_spaces_as_tfhub():
    ids = texts_to_ids(["a  b", "c", ""])
    assert ids.shape == (3, 2, 50) and ids.dtype == np.int32
    assert (ids[0] > 0).any(axis=1).all()  # "a" and "b": the double space is no token
    assert (ids[1, 0] > 0).any() and not ids[1, 1].any() and not ids[2].any()
    with pytest.raises(TypeError, match="one string"):
        texts_to_ids("a b")
    with pytest.raises(TypeError, match=r"inputs\[1\] is None"):
        texts_to_ids(["a", None])


@pytest.mark.parametrize("output", ["word_emb", "lstm_outputs1", "lstm_outputs2", "elmo", "default"])
def test_outputs_are_hub_modules(output):
    expected = hub.Module(str(MODULE))(TEXTS, as_dict=True)[output]
    got = ElmoEmbedding(model=str(MODULE), output=output)(texts_to_ids(TEXTS))
    assert tuple(got.shape) == tuple(expected.shape)
    torch.testing.assert_close(torch.as_tensor(got), expected, rtol=0, atol=1e-6)


def test_unknown_output_is_refused():
    with pytest.raises(ValueError, match="output must be one of word_emb, lstm_outputs1"):
        ElmoEmbedding(model=str(MODULE), output="lstm_outputs3")


def test_trainable_trains_the_mix_only_and_saves_by_reference(tmp_path):
    inputs = keras.Input(shape=(None, 50), dtype="int32")
    layer = ElmoEmbedding(model=str(MODULE), output="default", trainable=True)
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(layer(inputs)))
    model.compile(loss="binary_crossentropy", optimizer=keras.optimizers.Adam(0.1))
    assert sorted(w.path.split("/")[-1] for w in model.trainable_weights) == [
        "aggregation_scaling", "aggregation_weights", "bias", "kernel"]
    assert np.allclose(layer.mix_weights.numpy(), [0.3, -0.5, 0.9]) and np.isclose(layer.mix_scaling.numpy(), 1.7)
    bilm = layer._frozen.elmo.bilm
    before = {name: tensor.clone() for name, tensor in bilm.state_dict().items()}
    model.fit(texts_to_ids(TEXTS), np.array([1, 0, 1]), epochs=2, batch_size=2, verbose=0)
    assert not np.allclose(layer.mix_weights.numpy(), [0.3, -0.5, 0.9])  # the mix learned
    assert all(torch.equal(before[name], tensor) for name, tensor in bilm.state_dict().items())  # the biLM did not
    model.save(tmp_path / "classifier.keras")
    with zipfile.ZipFile(tmp_path / "classifier.keras") as saved:
        config = json.loads(saved.read("config.json"))
        weights_bytes = saved.getinfo("model.weights.h5").file_size
    assert str(MODULE.resolve()) in json.dumps(config)  # the model by its absolute path
    assert weights_bytes < 100_000 < 4 * sum(t.numel() for t in before.values())  # no biLM weights inside
    loaded = keras.models.load_model(tmp_path / "classifier.keras")
    ids = texts_to_ids(TEXTS)
    np.testing.assert_allclose(loaded.predict(ids, verbose=0), model.predict(ids, verbose=0), atol=1e-6)


def test_frozen_layer_in_a_sequential_model():
    layer = ElmoEmbedding(model=str(MODULE), output="elmo")
    model = keras.Sequential([keras.Input(shape=(None, 50), dtype="int32"), layer,
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
    assert not layer.trainable_weights and len(layer.non_trainable_weights) == 2
    assert model.predict(texts_to_ids(TEXTS), verbose=0).shape == (3, 2)


def read_sst2(name: str, limit: int) -> tuple[list[str], np.ndarray]:
    with open(require_shared(DATA / "sst" / name), encoding="utf-8", newline="") as handle:
        rows = list(csv.DictReader(handle))[:limit]
    return [row["sentence"] for row in rows], np.array([int(row["label"]) for row in rows])


def test_a_classifier_on_sst2_learns_in_an_epoch():
    """The seeds' Keras tutorial, rewritten (docs/integrations.md): ELMo's `default` vector with
    the built-in model -> Dense(64, relu) -> Dense(1, sigmoid), one epoch on 3,000 SST-2 training
    sentences (Moses tokens), scored on 400 dev sentences."""
    train_texts, train_labels = read_sst2("sst2_binary_sent_train.csv", 3000)
    dev_texts, dev_labels = read_sst2("sst2_binary_sent_dev.csv", 400)
    inputs = keras.Input(shape=(None, 50), dtype="int32")
    vectors = ElmoEmbedding(output="default", trainable=True)(inputs)
    hidden = keras.layers.Dense(64, activation="relu")(vectors)
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden))
    model.compile(loss="binary_crossentropy", optimizer=keras.optimizers.Adam(3e-3), metrics=["accuracy"])
    history = model.fit(texts_to_ids(train_texts, tokenize=True), train_labels, epochs=1, batch_size=32, verbose=0)
    accuracy = model.evaluate(texts_to_ids(dev_texts, tokenize=True), dev_labels, verbose=0)[1]
    majority = max(dev_labels.mean(), 1 - dev_labels.mean())
    assert np.isfinite(history.history["loss"][0])
    assert accuracy > majority + 0.1, (accuracy, majority)
