"""The character-id scheme, checked against a per-token reference written from spec §3."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elmokit.model.chars import BOS_IDS, EOS_IDS, add_boundaries, batch_to_ids, tokens_to_char_ids


def reference_ids(token: str) -> list[int]:
    """Spec §3, one token at a time: BOW, first 48 bytes, EOW, padding 260; then +1 everywhere."""
    if token == "<S>":
        return [259, 257, 260] + [261] * 47
    if token == "</S>":
        return [259, 258, 260] + [261] * 47
    raw = list(token.encode("utf-8", errors="ignore")[:48])
    slots = [258] + raw + [259] + [260] * (48 - len(raw))
    return [value + 1 for value in slots]


def test_hand_computed_ids():
    ids = tokens_to_char_ids(["", "é", "<S>", "</S>", "a" * 48, "b" * 60])
    assert ids[0].tolist() == [259, 260] + [261] * 48
    assert ids[1].tolist()[:4] == [259, 196, 170, 260]
    assert ids[2].tolist() == BOS_IDS.tolist() == [259, 257, 260] + [261] * 47
    assert ids[3].tolist() == EOS_IDS.tolist() == [259, 258, 260] + [261] * 47
    assert ids[4, 49] == 260 and (ids[4, 1:49] == ord("a") + 1).all()  # EOW in the last slot
    assert ids[5, 49] == 260 and (ids[5, 1:49] == ord("b") + 1).all()  # cut at 48 bytes


def test_batch_shape_and_padding():
    ids = batch_to_ids([["a", "bb"], [], ["c"]])
    assert ids.shape == (3, 2, 50) and ids.dtype == torch.int64
    assert (ids[1] == 0).all() and (ids[2, 1] == 0).all()
    assert ids[2, 0].tolist() == reference_ids("c")


def test_all_empty_batch_is_three_dimensional():
    assert batch_to_ids([[], []]).shape == (2, 0, 50)


@pytest.mark.parametrize("bad", ["a sentence", [["ok"], "not a list"], [["ok", 3]]])
def test_bad_input_names_the_problem(bad):
    with pytest.raises(TypeError, match="sentences|tokens must be str"):
        batch_to_ids(bad)


def test_add_boundaries_places_bos_and_eos():
    ids, mask = add_boundaries(batch_to_ids([["a", "b"], ["c"]]))
    assert ids.shape == (2, 4, 50)
    assert mask.tolist() == [[True] * 4, [True, True, True, False]]
    assert ids[0, 0].tolist() == BOS_IDS.tolist() and ids[0, 3].tolist() == EOS_IDS.tolist()
    assert ids[1, 2].tolist() == EOS_IDS.tolist() and (ids[1, 3] == 0).all()


edge_tokens = st.one_of(
    st.text(max_size=60),
    st.sampled_from(["", "<S>", "</S>", "a" * 47, "a" * 48, "a" * 49, "a" * 50, "é" * 24, "x" + "é" * 24,
                     "😀" * 13, "東京大学" * 5, "\ud800", "a\udfffb", "👩‍👩‍👧‍👦"]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(edge_tokens, max_size=6), max_size=5))
def test_any_unicode_gives_valid_ids(sentences):
    ids = batch_to_ids(sentences)
    longest = max((len(s) for s in sentences), default=0)
    assert ids.shape == (len(sentences), longest, 50)
    assert ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) <= 261)
    for row, sentence in enumerate(sentences):
        for position, token in enumerate(sentence):
            assert ids[row, position].tolist() == reference_ids(token)
        assert (ids[row, len(sentence):] == 0).all()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(edge_tokens, max_size=4), min_size=1, max_size=3))
def test_model_never_crashes_on_any_tokens(sentences):
    from tests.conftest import tiny_config
    from elmokit import BiLM

    torch.manual_seed(0)
    model = BiLM(tiny_config()).eval()
    with torch.no_grad():
        output = model(batch_to_ids(sentences))
    assert all(np.isfinite(layer.numpy()).all() for layer in output.layers)
