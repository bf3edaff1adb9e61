"""TF-Hub's ELMo module (`elmokit.hub`): which parameters each handle trains, and its inputs
refused by name where TF-Hub's string tensors could not hold them."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from elmokit import hub

MIX = {"elmo.mix.scalar_parameters", "elmo.mix.gamma"}  # TF-Hub's 3 layer weights and gamma


def trainable_names(module: torch.nn.Module) -> set[str]:
    return {name for name, parameter in module.named_parameters() if parameter.requires_grad}


@pytest.fixture
def handles_load_tiny(monkeypatch, tiny_model):
    """Every handle (a TF-Hub URL included) loads the tiny model: no download."""
    monkeypatch.setattr(hub, "load_handle", lambda handle: (tiny_model, None))
    return tiny_model


@pytest.mark.parametrize("handle", ["https://tfhub.dev/google/elmo/1", "https://tfhub.dev/google/elmo/2",
                                    "https://tfhub.dev/google/elmo/3", None])
def test_trainable_false_trains_nothing(handles_load_tiny, handle):
    module = hub.Module(handle, trainable=False)
    assert trainable_names(module) == set() and len(list(module.parameters())) > 2


@pytest.mark.parametrize("handle", ["https://tfhub.dev/google/elmo/2", "https://tfhub.dev/google/elmo/3/", None])
def test_trainable_true_trains_the_mix_only(handles_load_tiny, handle):
    """google/elmo/2 and 3 (and every other handle): the 4 scalars of the mix, as TF-Hub's v2 and v3."""
    module = hub.Module(handle, trainable=True)
    assert trainable_names(module) == MIX
    assert sum(p.numel() for p in module.parameters() if p.requires_grad) == 4


def test_google_elmo_1_trains_the_lstm_cells_and_the_mix_not_the_char_cnn(handles_load_tiny):
    """TF-Hub's google/elmo/1 with trainable=True trains all variables of the LSTM cells (and the
    mix); the char CNN, highway and token projection stay fixed (docs/loading.md)."""
    module = hub.Module("https://tfhub.dev/google/elmo/1", trainable=True)
    lstm = {f"elmo.bilm.{name}" for name, _ in handles_load_tiny.named_parameters() if name.startswith("lstm.")}
    assert len(lstm) == 8 and trainable_names(module) == lstm | MIX
    assert not any(p.requires_grad for p in module.elmo.bilm.token_encoder.parameters())


@pytest.mark.parametrize("inputs, named", [
    (["a b", None], "inputs[1] is None (NoneType): expected a string"),
    ([3, "a"], "inputs[0] is 3 (int): expected a string"),
    (np.array(["a", None], dtype=object), "inputs[1] is None"),
])
def test_default_signature_refuses_what_is_not_a_string(handles_load_tiny, inputs, named):
    """[None] was embedded as the token "None"."""
    with pytest.raises(TypeError, match=re.escape(named)):
        hub.Module()(inputs)


@pytest.mark.parametrize("tokens, lengths, error, named", [
    ([["a", "b"], ["c", ""]], [2.0, 1.0], TypeError, "sequence_len must hold integers"),
    ([["a", "b"], ["c", ""]], np.array([1.5, 1.0]), TypeError, "sequence_len must hold integers"),
    ([["a", "b"], ["c", ""]], torch.tensor([2.0, 1.0]), TypeError, "sequence_len must hold integers"),
    ([["a", "b"], ["c", ""]], [True, True], TypeError, "sequence_len must hold integers"),
    ([["a", None], ["c", ""]], [2, 1], TypeError, r"tokens\[0\]\[1\] is None"),
    ([["a", "b"], ["c", ""]], [2, 3], ValueError, r"sequence_len\[1\] = 3"),
])
def test_tokens_signature_refuses_by_name(handles_load_tiny, tokens, lengths, error, named):
    with pytest.raises(error, match=named):
        hub.Module()(inputs={"tokens": tokens, "sequence_len": lengths}, signature="tokens")


def test_strings_bytes_and_numpy_arrays_still_work(handles_load_tiny):
    module = hub.Module()
    expected = module(["a b", "c"], signature="default", as_dict=True)["elmo"]
    for inputs in (np.array(["a b", "c"]), [b"a b", b"c"], np.array([b"a b", b"c"])):
        torch.testing.assert_close(module(inputs, signature="default", as_dict=True)["elmo"], expected)
    tokens = module(inputs={"tokens": np.array([["a", "b"], ["c", ""]]), "sequence_len": np.array([2, 1])},
                    signature="tokens", as_dict=True)["elmo"]
    torch.testing.assert_close(tokens, expected)


def test_signatures_belong_to_the_module_and_its_copies(handles_load_tiny, tmp_path):
    """`hub.load(...).signatures` run the module they are read from: a copy's, after its mix
    changed, give the copy's numbers; the module pickles (torch.save) with them."""
    import copy

    module = hub.load()
    twin = copy.deepcopy(module)
    with torch.no_grad():
        twin.elmo.mix.gamma.mul_(3.0)
    strings = ["a b", "c"]
    torch.testing.assert_close(twin.signatures["default"](strings)["elmo"], twin(strings, as_dict=True)["elmo"])
    torch.testing.assert_close(module.signatures["default"](strings)["elmo"] * 3, twin.signatures["default"](strings)["elmo"])
    torch.save(module, tmp_path / "hub.pt")
    loaded = torch.load(tmp_path / "hub.pt", weights_only=False)
    torch.testing.assert_close(loaded.signatures["tokens"](tokens=np.array([["a", "b"], ["c", ""]]),
                                                           sequence_len=np.array([2, 1]))["elmo"],
                               module.signatures["default"](strings)["elmo"])
