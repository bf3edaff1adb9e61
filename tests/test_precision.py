"""bfloat16 inference: Elmo / ElmoEmbedder / HubElmo(dtype=torch.bfloat16), `elmo embed --dtype
bfloat16`, `elmo task train --bilm-dtype bfloat16`. The weights and their products in bfloat16,
the activations, the LSTM state and the outputs in float32, close to float32's vectors; float32
stays the default and stays exact; what bfloat16 cannot do (carry the state, fine-tune) is refused."""

from __future__ import annotations

import copy

import h5py
import numpy as np
import pytest
import torch

from elmokit.inference.engine import bilm_forward
from elmokit import Elmo, ElmoEmbedder, HubElmo, batch_to_ids, kernels
from elmokit.cli import main
from elmokit.tasks.features import cached_layers
from tests.conftest import SENTENCES

TOLERANCE = 0.05  # of the largest |value| of a layer: bfloat16 keeps 8 bits of mantissa (~0.4 %)


def _close(low: np.ndarray, full: np.ndarray) -> None:
    assert low.shape == full.shape
    if full.size == 0:
        return
    scale = max(float(np.abs(full).max()), 1e-6)
    assert np.abs(low - full).max() <= TOLERANCE * scale, (np.abs(low - full).max(), scale)


def test_embedder_in_bfloat16_is_close_and_float32_stays_exact(tiny_model):
    full = ElmoEmbedder(module=copy.deepcopy(tiny_model))
    explicit = ElmoEmbedder(module=copy.deepcopy(tiny_model), dtype=torch.float32)
    low = ElmoEmbedder(module=copy.deepcopy(tiny_model), dtype="bfloat16")
    assert next(full.bilm.parameters()).dtype == torch.float32
    assert {p.dtype for p in low.bilm.parameters()} == {torch.bfloat16}
    reference = full.embed_batch(SENTENCES)
    for got, want in zip(explicit.embed_batch(SENTENCES), reference):
        np.testing.assert_array_equal(got, want)
    different = False
    for vectors in (low.embed_batch(SENTENCES), list(low.embed_sentences(SENTENCES, batch_size=2)),
                    low.embed_many(SENTENCES, rows=3)):  # padded batch, streams, another row count
        for got, want in zip(vectors, reference):
            assert got.dtype == np.float32 and got.shape == want.shape
            for layer in range(len(want)):
                _close(got[layer], want[layer])
            different |= not np.array_equal(got, want)
    assert different  # the products did run in bfloat16
    if torch.bfloat16 in kernels._ONEDNN_DTYPES and kernels.onednn_active():
        assert ("packed", torch.bfloat16) in kernels._verified  # through oneDNN's bfloat16 kernels


def test_elmo_and_hub_elmo_in_bfloat16(tiny_model):
    ids = batch_to_ids(SENTENCES)
    mix = [0.0, 1.0, 2.0]
    full = Elmo(module=copy.deepcopy(tiny_model), dropout=0.0, scalar_mix_parameters=mix)(ids)
    low = Elmo(module=copy.deepcopy(tiny_model), dropout=0.0, scalar_mix_parameters=mix, dtype=torch.bfloat16)(ids)
    got, want = low["elmo_representations"][0], full["elmo_representations"][0]
    assert got.dtype == torch.float32 and torch.equal(low["mask"], full["mask"])
    _close(got.detach().numpy(), want.detach().numpy())
    hub = HubElmo(module=copy.deepcopy(tiny_model), dtype=torch.bfloat16)(SENTENCES)
    assert hub["elmo"].dtype == torch.float32 and hub["sequence_len"].tolist() == [len(s) for s in SENTENCES]


def test_what_bfloat16_cannot_do_is_refused(tiny_model):
    with pytest.raises(ValueError, match="stateless inference"):
        Elmo(module=copy.deepcopy(tiny_model), stateful=True, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="stateless inference"):
        Elmo(module=copy.deepcopy(tiny_model), requires_grad=True, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="stateless inference"):
        ElmoEmbedder(module=copy.deepcopy(tiny_model), stateful=True, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="stateless inference"):
        HubElmo(module=copy.deepcopy(tiny_model), trainable=True, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype must be"):
        ElmoEmbedder(module=copy.deepcopy(tiny_model), dtype=torch.float16)
    low = copy.deepcopy(tiny_model).to(torch.bfloat16)
    with pytest.raises(ValueError, match="zero state only"):
        bilm_forward(low, batch_to_ids(SENTENCES), state=copy.deepcopy(tiny_model)(batch_to_ids(SENTENCES)).state)
    with pytest.raises(ValueError, match="run in elmokit.inference.engine"):  # BiLM.forward is float32's
        low(batch_to_ids(SENTENCES))


def test_embed_command_in_bfloat16(model_dir, tmp_path):
    corpus = tmp_path / "in.txt"
    corpus.write_text("the cat sat on the mat .\n\ncolorless green ideas sleep furiously\n", encoding="utf-8")
    for dtype in ("float32", "bfloat16"):
        assert main(["embed", str(corpus), str(tmp_path / f"{dtype}.h5"), "--model", str(model_dir),
                     "--dtype", dtype, "--quiet"]) == 0
    with h5py.File(tmp_path / "float32.h5") as full, h5py.File(tmp_path / "bfloat16.h5") as low:
        for key in ("0", "1", "2"):
            assert low[key].dtype == np.float32 and low[key].shape == full[key].shape
            for layer in range(full[key].shape[0]):
                _close(low[key][layer], full[key][layer])


def test_task_features_in_bfloat16_are_cached_apart(tiny_model, tmp_path):
    full = cached_layers(tiny_model, SENTENCES, tmp_path, progress=False)
    low = cached_layers(tiny_model, SENTENCES, tmp_path, progress=False, bilm_dtype="bfloat16")
    assert len(list(tmp_path.glob("*-bfloat16-*.safetensors"))) == 1 and len(list(tmp_path.iterdir())) == 2
    assert next(tiny_model.parameters()).dtype == torch.float32  # the caller's biLM is left as it is
    for got, want in zip(low, full):
        for layer in range(len(want)):
            _close(got[layer].float().numpy(), want[layer].float().numpy())
    assert any(not torch.equal(got, want) for got, want in zip(low, full))
    again = cached_layers(tiny_model, SENTENCES, tmp_path, progress=False, bilm_dtype="bfloat16")
    assert all(torch.equal(a, b) for a, b in zip(again, low))
