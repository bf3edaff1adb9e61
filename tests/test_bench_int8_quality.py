"""bench/int8_quality.py scores what `elmo perplexity --per-sentence` scores: its per-sentence NLL
through the inference engine (boundaries added by the biLM, each position predicting its
neighbours) equals the training recurrence's stateless scoring (`sentence_scores`), on a tiny
language model; and int8 products move it only a little."""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import pytest
import torch

from elmokit.inference.embedder import ElmoEmbedder
from elmokit.model.int8 import int8_native
from elmokit.model.chars import BOS_TOKEN, EOS_TOKEN
from elmokit.training.lm import LanguageModel
from elmokit.training.vocab import UNK_TOKEN, Vocabulary
from tests.test_lm import tiny_config

REPO = Path(__file__).resolve().parents[1]
WORDS = ["the", "cat", "sat", "on", "a", "mat", ".", "dog", "ran", "far"]


@pytest.fixture(scope="module")
def int8_quality():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(REPO / "bench"))
        yield importlib.import_module("int8_quality")


def scoring_setup():
    torch.manual_seed(0)
    vocab = Vocabulary([BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, *WORDS[:-2]])  # "ran", "far": <UNK> targets
    model = LanguageModel(tiny_config(), len(vocab)).eval()
    generator = torch.Generator().manual_seed(1)
    sentences = [[WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=generator)]
                 for n in (1, 7, 3, 12, 5)]
    return model, vocab, sentences


def test_engine_scores_equal_the_training_recurrence_scores(int8_quality):
    model, vocab, sentences = scoring_setup()
    bilm = ElmoEmbedder(module=copy.deepcopy(model.bilm), device="cpu", dtype="float32").bilm
    forward, backward, n_targets = int8_quality.nll_sums(model, bilm, vocab, sentences, batch_size=2, score_rows=7)
    expected = int8_quality.training_driver_sums(model, vocab, sentences)
    assert n_targets == expected[2] == sum(len(s) + 1 for s in sentences)
    assert forward == pytest.approx(expected[0], rel=1e-5) and backward == pytest.approx(expected[1], rel=1e-5)
    assert forward != pytest.approx(backward, rel=1e-4)  # the two directions differ: a swap would fail above
    ppl = int8_quality.perplexities(forward, backward, n_targets)
    assert ppl["ppl"] == pytest.approx((ppl["forward_ppl"] * ppl["backward_ppl"]) ** 0.5)


@pytest.mark.skipif(not int8_native(), reason="int8 needs a CPU with VNNI or AMX-INT8")
def test_int8_scores_are_close_to_float32s(int8_quality):
    model, vocab, sentences = scoring_setup()
    sums = {dtype: int8_quality.nll_sums(model, ElmoEmbedder(module=copy.deepcopy(model.bilm), device="cpu",
                                                             dtype=dtype).bilm, vocab, sentences)
            for dtype in ("float32", "int8")}
    assert sums["int8"] != sums["float32"]  # the int8 products did run
    for exact, low in zip(sums["float32"][:2], sums["int8"][:2]):
        assert low == pytest.approx(exact, rel=0.02)
