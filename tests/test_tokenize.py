"""`elmokit.tokenize`: the Moses tokens `elmo serve` and `elmo embed --tokenize` embed, in the API."""

from __future__ import annotations

import sys

import h5py
import numpy as np
import pytest

import elmokit
from elmokit import ElmoEmbedder
from elmokit.cli import main
from elmokit.extras import MissingExtraError
from elmokit.inference.files import make_tokenizer

# Written by hand from the Moses rules (not by running the code under test): English splits "'s"
# and "n't" off, keeps decimals and abbreviations whole; French keeps the elided "l'" whole; nothing
# is HTML-escaped (escape=False, as `elmo prepare` writes a corpus).
GOLDEN = [
    ("en", "It's 3.5 km, isn't it?", ["It", "'s", "3.5", "km", ",", "isn", "'t", "it", "?"]),
    ("en", 'Tom & "Jerry" <3 the U.S.A.', ["Tom", "&", '"', "Jerry", '"', "<", "3", "the", "U.S.A."]),
    ("en", "  spaced\u00a0out\ttext  ", ["spaced", "out", "text"]),
    ("fr", "L'homme qu'on voit.", ["L'", "homme", "qu'", "on", "voit", "."]),
    ("en", "", []),
    ("en", " \n ", []),
]


@pytest.mark.parametrize("lang, text, tokens", GOLDEN)
def test_tokenize_gives_the_moses_tokens(lang, text, tokens):
    assert elmokit.tokenize(text, lang=lang) == tokens


def test_every_tokenize_flag_uses_it():
    """`elmo serve` and `--tokenize` tokenize through make_tokenizer: the same tokens, per language."""
    for lang, text, tokens in GOLDEN:
        assert make_tokenizer(True, lang)(text) == tokens
    assert make_tokenizer(False)("It's  done.") == ["It's", "done."]


def test_embed_tokenize_equals_the_api(model_dir, tmp_path):
    """`elmo embed --tokenize` stores the vectors of `elmokit.tokenize`'s tokens: a Python user who
    tokenizes with it gets the command's numbers."""
    lines = ["Hello, world!", "It's 3.5 km, isn't it?"]
    (tmp_path / "raw.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["embed", str(tmp_path / "raw.txt"), str(tmp_path / "out.hdf5"), "--tokenize", "--all",
                 "--model", str(model_dir), "--quiet"]) == 0
    embedder = ElmoEmbedder(options_file=str(model_dir))
    with h5py.File(tmp_path / "out.hdf5", "r") as stored:
        for key, line in enumerate(lines):
            want = embedder.embed_sentence(elmokit.tokenize(line))  # (L+1, n, 2P)
            assert stored[str(key)].shape == want.shape
            np.testing.assert_allclose(stored[str(key)][()], want, atol=1e-6)


def test_tokenize_without_sacremoses(monkeypatch):
    elmokit.tokenize("warm the cache")  # a tokenizer built before must not hide the missing package
    monkeypatch.setitem(sys.modules, "sacremoses", None)
    with pytest.raises(MissingExtraError, match=r"needs sacremoses: pip install 'elmokit\[prepare\]'$"):
        elmokit.tokenize("Hello, world.")


@pytest.mark.parametrize("text, lang, what", [(["a", "list"], "en", "text must be a str, got list"),
                                              (b"bytes", "en", "text must be a str, got bytes"),
                                              ("text", "", "lang must be a language code"),
                                              ("text", None, "lang must be a language code")])
def test_tokenize_refuses_what_is_not_text(text, lang, what):
    with pytest.raises(TypeError, match=what):
        elmokit.tokenize(text, lang=lang)
