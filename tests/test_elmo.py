"""Elmo, ElmoEmbedder and HubElmo on a tiny model: shapes, semantics, statelessness, files."""

from __future__ import annotations

import copy
import json

import h5py
import numpy as np
import pytest
import torch

from elmokit import Elmo, ElmoEmbedder, HubElmo, batch_to_ids
from tests.conftest import SENTENCES


def _elmo(model, **kwargs):
    return Elmo(module=model, **{"num_output_representations": 1, "dropout": 0.0, **kwargs}).eval()


def test_elmo_shapes_and_mask(tiny_model):
    out = _elmo(tiny_model, num_output_representations=2)(batch_to_ids(SENTENCES))
    assert len(out["elmo_representations"]) == 2
    for rep in out["elmo_representations"]:
        assert rep.shape == (5, 7, 12)
        assert (rep[~out["mask"]] == 0).all()
    assert out["mask"].sum(1).tolist() == [len(s) for s in SENTENCES]


def test_fixed_mix_is_the_layer_mean_without_boundaries(tiny_model):
    rep = _elmo(tiny_model, scalar_mix_parameters=[1.0, 1.0, 1.0])(batch_to_ids(SENTENCES))["elmo_representations"][0]
    with torch.no_grad():
        layers = ElmoEmbedder(module=tiny_model).embed_batch(SENTENCES)
    for row, sentence in enumerate(SENTENCES):
        np.testing.assert_allclose(rep[row, :len(sentence)].detach().numpy(), layers[row].mean(0), atol=1e-6)


def test_keep_boundaries_and_rank_four_inputs(tiny_model):
    elmo = _elmo(tiny_model, keep_sentence_boundaries=True)
    ids = batch_to_ids(SENTENCES)
    out = elmo(ids)
    assert out["elmo_representations"][0].shape == (5, 9, 12) and out["mask"].shape == (5, 9)
    stacked = _elmo(tiny_model)(torch.stack([ids, ids]))
    assert stacked["elmo_representations"][0].shape == (2, 5, 7, 12) and stacked["mask"].shape == (2, 5, 7)


def test_trainable_mix_and_frozen_bilm(tiny_model):
    elmo = Elmo(module=tiny_model, num_output_representations=1, dropout=0.5)
    trainable = {name for name, p in elmo.named_parameters() if p.requires_grad}
    assert trainable == {"scalar_mixes.0.scalar_parameters", "scalar_mixes.0.gamma"}
    elmo(batch_to_ids(SENTENCES))["elmo_representations"][0].sum().backward()
    assert elmo.scalar_mixes[0].gamma.grad is not None
    assert elmo.training  # as in AllenNLP: dropout is active until .eval()


@pytest.mark.parametrize("raw_weights", [None, [0.3, -1.0, 2.0]])
def test_layer_norm_follows_the_spec_formula(tiny_model, raw_weights):
    """Spec §8: each layer normalised with ONE mean and ONE biased variance over every element of
    the batch where the with-boundaries mask is true (BOS/EOS included, times all 2P features),
    eps 1e-13, no affine; then softmax(w)-weighted, times gamma; then the boundaries removed.
    Computed here in float64 from the biLM's layers, position by position."""
    ids = batch_to_ids(SENTENCES)
    with torch.no_grad():
        output = tiny_model(ids)
        mixed = _elmo(tiny_model, do_layer_norm=True, scalar_mix_parameters=raw_weights)(ids)["elmo_representations"][0]
    mask = output.mask.numpy()  # (B, S) with boundaries
    w = np.zeros(3) if raw_weights is None else np.array(raw_weights)
    s = np.exp(w) / np.exp(w).sum()
    expected = np.zeros((len(SENTENCES), mask.shape[1], 12))
    for k, layer in enumerate(output.layers):
        act = layer.double().numpy()  # (B, S, 2P)
        values = [act[b, t, f] for b in range(act.shape[0]) for t in range(act.shape[1]) if mask[b, t]
                  for f in range(act.shape[2])]
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / len(values)
        expected += s[k] * (act - mean) / np.sqrt(var + 1e-13)
    for b, sentence in enumerate(SENTENCES):  # gamma = 1; boundaries removed, padding zero
        np.testing.assert_allclose(mixed[b, :len(sentence)].numpy(), expected[b, 1:len(sentence) + 1], atol=1e-5,
                                   rtol=1e-4)  # normalised: float32 rounding of the layers over their std
        assert (mixed[b, len(sentence):] == 0).all()
    # the statistics are the batch's: the same sentence alone is normalised differently
    with torch.no_grad():
        alone = _elmo(tiny_model, do_layer_norm=True)(batch_to_ids(SENTENCES[:1]))["elmo_representations"][0]
    if raw_weights is None:
        assert not torch.allclose(alone[0], mixed[0, :len(SENTENCES[0])], atol=1e-3)


def test_vocab_to_cache_equals_char_inputs(tiny_model):
    vocab = ["@@PADDING@@", *sorted({t for s in SENTENCES for t in s})]
    index = {word: i for i, word in enumerate(vocab)}
    word_ids = torch.tensor([[index[t] for t in s] + [0] * (7 - len(s)) for s in SENTENCES])
    elmo = _elmo(tiny_model, vocab_to_cache=vocab)
    cached = elmo(word_inputs=word_ids)["elmo_representations"][0]
    direct = elmo(batch_to_ids(SENTENCES))["elmo_representations"][0]
    assert torch.allclose(cached, direct, atol=1e-6)


def _word_ids(vocab):
    index = {word: i for i, word in enumerate(vocab)}
    return torch.tensor([[index[t] for t in s] + [0] * (7 - len(s)) for s in SENTENCES])


def test_vocab_to_cache_follows_the_encoders_weights(tiny_model):
    """After `load_state_dict` of other weights, and after an in-place edit (an optimizer's step),
    `word_inputs` give what char ids give: the cached table is computed again, never stale."""
    vocab = ["@@PADDING@@", *sorted({t for s in SENTENCES for t in s})]
    word_ids = _word_ids(vocab)
    elmo = _elmo(copy.deepcopy(tiny_model), vocab_to_cache=vocab)
    elmo(word_inputs=word_ids)  # the table in use
    other = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for parameter in other.token_encoder.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    elmo.bilm.load_state_dict(other.state_dict())
    for _ in range(2):  # reloaded; then edited in place
        cached = elmo(word_inputs=word_ids)["elmo_representations"][0]
        direct = elmo(batch_to_ids(SENTENCES))["elmo_representations"][0]
        torch.testing.assert_close(cached, direct, atol=1e-6, rtol=0)
        with torch.no_grad():
            elmo.bilm.token_encoder.char_cnn.char_embedding.weight.mul_(1.5)


def test_vocab_to_cache_fine_tunes_the_token_encoder_as_char_ids_do(tiny_model):
    """With requires_grad, `word_inputs` send gradients into the token encoder: the same ones as
    char ids of the same words."""
    vocab = ["@@PADDING@@", *sorted({t for s in SENTENCES for t in s})]
    grads = []
    for by_words in (True, False):
        elmo = _elmo(copy.deepcopy(tiny_model), vocab_to_cache=vocab, requires_grad=True)
        inputs = {"word_inputs": _word_ids(vocab)} if by_words else {"inputs": batch_to_ids(SENTENCES)}
        elmo(**inputs)["elmo_representations"][0].square().sum().backward()
        grads.append({name: p.grad for name, p in elmo.bilm.token_encoder.named_parameters()})
    assert grads[0].keys() == grads[1].keys() and all(g is not None for g in grads[0].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], atol=1e-5, rtol=1e-4)


def test_bad_word_ids_and_char_id_shapes_say_what_was_expected(tiny_model):
    elmo = _elmo(tiny_model, vocab_to_cache=["@@PADDING@@", "a", "b"])
    with pytest.raises(ValueError, match=r"ids into vocab_to_cache, 0 \(padding\) to 2, got ids from 1 to 3"):
        elmo(word_inputs=torch.tensor([[1, 3]]))
    for shape in [(1, 4, 49), (2, 3), (1, 4, 51)]:
        with pytest.raises(ValueError, match=r"expected char ids \(B, T, 50\)") as error:
            elmo(torch.ones(shape, dtype=torch.long))
        assert f"got shape {shape}" in str(error.value)


def test_numpy_arrays_of_tokens_are_taken_as_lists(tiny_model):
    embedder = ElmoEmbedder(module=tiny_model)
    expected = embedder.embed_batch([list(s) for s in SENTENCES[:2]])
    np.testing.assert_array_equal(embedder.embed_sentence(np.array(SENTENCES[0])),
                                  embedder.embed_sentence(list(SENTENCES[0])))
    got = embedder.embed_batch([np.array(s) for s in SENTENCES[:2]])
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    same_length = [s[:2] for s in SENTENCES[:2]]
    torch.testing.assert_close(batch_to_ids(np.array(same_length)), batch_to_ids(same_length))


def test_stateful_elmo_carries_and_resets(tiny_model):
    elmo = _elmo(tiny_model, stateful=True)
    ids = batch_to_ids(SENTENCES)
    first = elmo(ids)["elmo_representations"][0]
    second = elmo(ids)["elmo_representations"][0]
    assert not torch.allclose(first, second, atol=1e-4)
    elmo.reset_states()
    assert torch.equal(elmo(ids)["elmo_representations"][0], first)


def test_embedder_arrays_and_empty_sentences(tiny_model):
    embedder = ElmoEmbedder(module=tiny_model)
    arrays = embedder.embed_batch(SENTENCES)
    for array, sentence in zip(arrays, SENTENCES):
        assert array.shape == (3, len(sentence), 12) and array.dtype == np.float32
    assert embedder.embed_sentence([]).shape == (3, 0, 12)
    assert [a.shape for a in embedder.embed_batch([[], []])] == [(3, 0, 12)] * 2


def test_embedder_is_batch_and_order_invariant(tiny_model):
    embedder = ElmoEmbedder(module=tiny_model)
    together = embedder.embed_batch(SENTENCES)
    for sentence, array in zip(SENTENCES, together):
        np.testing.assert_allclose(embedder.embed_sentence(sentence), array, atol=1e-5)
    streamed = list(embedder.embed_sentences(iter(SENTENCES[::-1]), batch_size=2))
    for a, b in zip(streamed, together[::-1]):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("cache_tokens", [True, False])
@pytest.mark.parametrize("rows, position_budget", [(1, 16_384), (2, 16_384), (64, 16_384), (3, 7)])
def test_embed_many_matches_sentence_by_sentence(tiny_model, cache_tokens, rows, position_budget):
    embedder = ElmoEmbedder(module=tiny_model, cache_tokens=cache_tokens)
    embedder.POSITION_BUDGET = position_budget  # 7: groups of one or two sentences
    sentences = SENTENCES * 3
    for many, sentence in zip(embedder.embed_many(sentences, rows=rows), sentences):
        alone = embedder.embed_sentence(sentence)
        assert many.shape == alone.shape
        np.testing.assert_allclose(many, alone, atol=1e-6)
    assert embedder.embed_many([], rows=rows) == []
    with pytest.raises(ValueError, match="stateless"):
        ElmoEmbedder(module=tiny_model, stateful=True).embed_many(SENTENCES)


def test_token_cache_is_exact(tiny_model):
    cached, plain = ElmoEmbedder(module=tiny_model), ElmoEmbedder(module=tiny_model, cache_tokens=False)
    for _ in range(2):  # the second pass is served from the cache
        for a, b in zip(cached.embed_batch(SENTENCES), plain.embed_batch(SENTENCES)):
            np.testing.assert_allclose(a, b, atol=1e-6)
    assert len(cached.cache.index) == len({t for s in SENTENCES for t in s}) + 2


def test_token_cache_stays_within_its_bound_and_exact(tiny_model):
    from elmokit import TokenCache

    plain = ElmoEmbedder(module=tiny_model, cache_tokens=False)
    cached = ElmoEmbedder(module=tiny_model)
    projection = tiny_model.config.lstm.projection_dim
    cached.cache = TokenCache(tiny_model, max_bytes=1024 * 4 * projection)  # 1,024 words
    sentences = [[f"w{i}x{j}" for j in range(40)] for i in range(100)]  # 4,000 distinct words
    sizes = []
    for sentence in sentences:
        np.testing.assert_allclose(cached.embed_sentence(sentence), plain.embed_sentence(sentence), atol=1e-6)
        sizes.append(len(cached.cache.index))
    assert max(sizes) <= 1024 and any(b < a for a, b in zip(sizes, sizes[1:]))  # full, then started over
    wide = ["a"] * 1500 + [f"z{k}" for k in range(1500)]  # one call with more words than it holds
    np.testing.assert_allclose(cached.embed_sentence(wide), plain.embed_sentence(wide), atol=1e-6)
    assert cached.cache.max_size == 1503  # 1,500 + "a" + the two boundary tokens


def test_stateful_embedder_depends_on_history(tiny_model):
    embedder = ElmoEmbedder(module=tiny_model, stateful=True)
    first = embedder.embed_batch(SENTENCES)
    second = embedder.embed_batch(SENTENCES)
    assert not np.allclose(first[0][2], second[0][2], atol=1e-4)
    np.testing.assert_array_equal(first[0][0], second[0][0])
    embedder.reset_states()
    np.testing.assert_allclose(embedder.embed_batch(SENTENCES)[0], first[0], atol=1e-6)


@pytest.mark.parametrize("output_format, shape", [("all", (3, 2, 12)), ("top", (2, 12)), ("average", (2, 12))])
def test_embed_file_layout(tiny_model, tmp_path, output_format, shape):
    source = tmp_path / "in.txt"
    source.write_text("hello world\n\nthe end\n", encoding="utf-8")
    embedder = ElmoEmbedder(module=tiny_model)
    embedder.embed_file(source, tmp_path / "out.hdf5", output_format)
    with h5py.File(tmp_path / "out.hdf5") as file:
        assert set(file) == {"0", "1", "2", "sentence_to_index"}
        assert file["0"].shape == shape and file["0"].dtype == np.float32
        assert file["1"].shape[-2] == 0  # a blank line is an empty sentence, its key kept
        index = json.loads(file["sentence_to_index"][0])
    assert index == {"hello world": "0", "": "1", "the end": "2"}
    full = embedder.embed_sentence(["hello", "world"])
    expected = {"all": full, "top": full[-1], "average": full.mean(0)}[output_format]
    with h5py.File(tmp_path / "out.hdf5") as file:
        np.testing.assert_allclose(file["0"][...], expected, atol=1e-6)


def test_embed_file_sentence_keys(tiny_model, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("a b\nc\n", encoding="utf-8")
    ElmoEmbedder(module=tiny_model).embed_file(source, tmp_path / "o.hdf5", "top",
                                               use_sentence_keys=True, forget_sentences=True)
    with h5py.File(tmp_path / "o.hdf5") as file:
        assert set(file) == {"a b", "c"}


def test_hub_outputs(tiny_model):
    hub = HubElmo(module=tiny_model)
    out = hub([["a", "b", "c"], ["d"]])
    assert out["word_emb"].shape == (2, 3, 6)
    assert out["lstm_outputs1"].shape == out["lstm_outputs2"].shape == out["elmo"].shape == (2, 3, 12)
    assert out["sequence_len"].tolist() == [3, 1]
    assert torch.allclose(out["default"][1], out["elmo"][1, 0])
    assert torch.allclose(out["default"][0], out["elmo"][0].mean(0))
    assert out["elmo"].requires_grad  # the mix is trainable


def test_embedder_sentence_vectors_are_token_means_of_its_layers(tiny_model):
    embedder = ElmoEmbedder(module=tiny_model)
    per_token = [embedder.embed_sentence(sentence) for sentence in SENTENCES]  # (3, n, 12) each
    for output_format in ("average", "top", "all"):
        vectors = embedder.sentence_vectors(SENTENCES, batch_size=2, output_format=output_format)
        for sentence, layers, vector in zip(SENTENCES, per_token, vectors):
            chosen = {"all": layers, "top": layers[2], "average": (layers[0] + layers[1] + layers[2]) / 3}[output_format]
            tokens = [np.take(chosen, i, axis=-2) for i in range(len(sentence))]
            want = sum(tokens) / len(tokens) if tokens else np.zeros(vector.shape, np.float32)
            np.testing.assert_allclose(vector, want, atol=1e-6, err_msg=f"{output_format} {sentence}")
    assert embedder.sentence_vectors([]).shape == (0, 12)
    with pytest.raises(ValueError, match="output format must be one of all, top, average"):
        embedder.sentence_vectors(SENTENCES, output_format="mean")


def test_hub_default_before_training_is_the_embedders_sentence_vector(tiny_model):
    """One definition: TF-Hub's `default` with the untrained (equal-weight) mix is the vector that
    `ElmoEmbedder.sentence_vectors` and `elmo embed --sentence-vectors --average` give."""
    hub_default = HubElmo(module=tiny_model)(SENTENCES)["default"]  # (B, 12), an empty sentence among them
    vectors = ElmoEmbedder(module=tiny_model).sentence_vectors(SENTENCES)
    np.testing.assert_allclose(hub_default.detach().numpy(), vectors, atol=1e-5)
    assert not hub_default[SENTENCES.index([])].any()


def test_hub_module_default_signature_is_the_sentence_vector(model_dir, tiny_model):
    """`hub.Module(...)(strings)` (TF-Hub's `default` output) before training: the token mean of
    the equal-weight layer average, each sentence's own (padding never counted)."""
    from elmokit import hub

    strings = ["the cat sat on the mat", "a", "colorless green ideas sleep"]
    default = hub.Module(str(model_dir))(strings)  # (3, 12)
    embedder = ElmoEmbedder(module=tiny_model)
    for row, text in enumerate(strings):
        layers = embedder.embed_sentence(text.split())  # (3, n, 12)
        want = sum(layers[k, i] for k in range(3) for i in range(layers.shape[1])) / (3 * layers.shape[1])
        np.testing.assert_allclose(default[row].detach().numpy(), want, atol=1e-5)
