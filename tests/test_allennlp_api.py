"""AllenNLP 0.9.0's ELMo API (the last release with `ElmoEmbedder`), argument by argument.

The signatures below are written from AllenNLP 0.9.0's documentation of
`allennlp.modules.elmo.Elmo`, `allennlp.modules.elmo.batch_to_ids` and
`allennlp.commands.elmo.ElmoEmbedder`: every parameter, in order, with its default. elmokit's
must take the same arguments in the same positions with the same defaults (batch_size: see ROWS; a default where
AllenNLP requires the argument is allowed; extra parameters only after AllenNLP's, keyword-only).
AllenNLP's `ElmoEmbedder` defaults to the published `original` files; elmokit's to its built-in model.
"""

from __future__ import annotations

import inspect
import json

import h5py
import numpy as np
import pytest
import torch

from elmokit import Elmo, ElmoEmbedder, batch_to_ids

REQUIRED = inspect.Parameter.empty
ANY = object()  # AllenNLP's default is a URL of the original model: elmokit's default differs on purpose
ROWS = object()  # AllenNLP's 64, a speed knob: elmokit's None lets the engine choose the rows (the same vectors
# whatever the rows); a stateful embedder's None is AllenNLP's 64 consecutive sentences (tests/test_rows.py)

ALLENNLP_0_9 = {
    (None, batch_to_ids): [("batch", REQUIRED)],
    (Elmo, "__init__"): [("options_file", REQUIRED), ("weight_file", REQUIRED), ("num_output_representations", REQUIRED),
                         ("requires_grad", False), ("do_layer_norm", False), ("dropout", 0.5), ("vocab_to_cache", None),
                         ("keep_sentence_boundaries", False), ("scalar_mix_parameters", None), ("module", None)],
    (Elmo, "forward"): [("inputs", REQUIRED), ("word_inputs", None)],
    (Elmo, "get_output_dim"): [],
    (Elmo, "from_params"): [("params", REQUIRED)],
    (ElmoEmbedder, "__init__"): [("options_file", ANY), ("weight_file", ANY), ("cuda_device", -1)],
    (ElmoEmbedder, "batch_to_embeddings"): [("batch", REQUIRED)],
    (ElmoEmbedder, "embed_sentence"): [("sentence", REQUIRED)],
    (ElmoEmbedder, "embed_batch"): [("batch", REQUIRED)],
    (ElmoEmbedder, "embed_sentences"): [("sentences", REQUIRED), ("batch_size", ROWS)],
    (ElmoEmbedder, "embed_file"): [("input_file", REQUIRED), ("output_file_path", REQUIRED), ("output_format", "all"),
                                   ("batch_size", ROWS), ("forget_sentences", False), ("use_sentence_keys", False)],
}


@pytest.mark.parametrize("owner, name", list(ALLENNLP_0_9), ids=lambda x: getattr(x, "__name__", str(x)))
def test_signature_matches_allennlp(owner, name):
    function = name if owner is None else getattr(owner, name)
    parameters = [p for p in inspect.signature(function).parameters.values() if p.name not in ("self", "cls")]
    expected = ALLENNLP_0_9[(owner, name)]
    assert [p.name for p in parameters[:len(expected)]] == [n for n, _ in expected]
    for parameter, (_, default) in zip(parameters, expected):
        assert parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.POSITIONAL_ONLY), parameter
        if default is ROWS:
            assert parameter.default is None, (parameter.name, parameter.default)
        elif default is not REQUIRED and default is not ANY:
            assert parameter.default == default, (parameter.name, parameter.default, default)
    for extra in parameters[len(expected):]:  # elmokit's own arguments never shift AllenNLP's positions
        assert extra.kind in (extra.KEYWORD_ONLY, extra.VAR_KEYWORD), (name, extra.name)


def test_batch_to_embeddings_as_allennlp_returns_it(model_dir):
    embedder = ElmoEmbedder(str(model_dir))
    batch = [["a", "b", "c"], ["d"], []]
    activations, mask = embedder.batch_to_embeddings(batch)
    assert activations.shape == (3, 3, 3, embedder.output_dim) and activations.dtype == torch.float32
    assert mask.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    for row, sentence in enumerate(batch):
        np.testing.assert_allclose(activations[row, :, :len(sentence)].numpy(), embedder.embed_sentence(sentence), atol=1e-6)
    assert (activations[1, :, 1:] == 0).all() and (activations[2] == 0).all()
    activations, mask = embedder.batch_to_embeddings([])  # no sentences: empty, of the same layout
    assert activations.shape == (0, 3, 0, embedder.output_dim) and mask.shape == (0, 0) and mask.dtype == torch.bool


@pytest.mark.parametrize("mode", ["r", "rb"])
def test_embed_file_takes_an_open_file_as_allennlp_does(model_dir, tmp_path, mode):
    text = "The cat sat .\nnaïve café\n"
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    embedder = ElmoEmbedder(str(model_dir))
    handle = open(tmp_path / "in.txt", mode, **({"encoding": "utf-8"} if mode == "r" else {}))
    embedder.embed_file(handle, tmp_path / "out.hdf5", output_format="top", batch_size=1)
    assert handle.closed
    with h5py.File(tmp_path / "out.hdf5") as file:
        assert json.loads(file["sentence_to_index"][0]) == {"The cat sat .": "0", "naïve café": "1"}
        np.testing.assert_allclose(file["1"][...], embedder.embed_sentence(["naïve", "café"])[-1], atol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["in.txt", "out.hdf5"]  # no copy left


def test_elmo_from_params_builds_the_same_module(model_dir):
    params = {"options_file": str(model_dir), "weight_file": None, "num_output_representations": 2,
              "dropout": 0.0, "do_layer_norm": False}
    elmo = Elmo.from_params(params)
    assert len(elmo.scalar_mixes) == 2 and elmo.dropout.p == 0.0
    with pytest.raises(ValueError, match="unknown keys \\['dropuot'\\]"):
        Elmo.from_params({**params, "dropuot": 0.1})


def test_reprs_say_what_the_object_is(model_dir):
    assert "stateless" in repr(ElmoEmbedder(str(model_dir))) and "cells" in repr(Elmo(str(model_dir)))
