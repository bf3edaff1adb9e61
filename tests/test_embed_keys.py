"""`elmo embed --use-sentence-keys` with sentences that are not safe names (slashes, dots, the
index's own name, unicode, NUL, blank, repeated, very long): every sentence maps to its own
vectors, and `read_embeddings` reads the output back."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from elmokit import ElmoEmbedder, read_embeddings
from elmokit.cli import main
from elmokit.inference.files import embed_sentences
from elmokit.inference.segments import key_sentence, sentence_key

HOSTILE = [
    "a/b", "a", "a/b/c", "a / b", "/", "//", "/a", "a/", ".", "..", "./a", "a/.", "%", "%2F", "%25",
    "a%2Fb", "", "sentence_to_index", "sentence_to_index x", "naïve café 😀 東京", "tab\tseparated",
    "nul\x00inside", "x.npy", "a/b",  # the last one repeats the first
    " ".join(f"w{i % 97}" for i in range(3000)),  # 3,000 tokens: longer than --max-length
]


@given(st.text())
def test_sentence_key_is_a_safe_name_and_inverts(sentence):
    key = sentence_key(sentence)
    assert key_sentence(key) == sentence
    assert key and "/" not in key and "\x00" not in key and key not in (".", "sentence_to_index")


def test_sentence_keys_are_distinct_for_distinct_sentences():
    keys = [sentence_key(s) for s in dict.fromkeys(HOSTILE)]
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("suffix", [".h5", ".npz"])
@pytest.mark.parametrize("sentence_vectors", [False, True])
def test_hostile_sentences_round_trip(model_dir, tiny_model, tmp_path, suffix, sentence_vectors):
    source = tmp_path / "in.txt"
    source.write_text("".join(line + "\n" for line in HOSTILE), encoding="utf-8")
    out = tmp_path / f"out{suffix}"
    extra = ["--sentence-vectors"] if sentence_vectors else []
    assert main(["embed", str(source), str(out), "--use-sentence-keys", "--model", str(model_dir), "--quiet",
                 "--checkpoint-every", "7", *extra]) == 0

    vectors = read_embeddings(out)
    sentences = list(dict.fromkeys(line.strip() for line in HOSTILE))  # the lines as `elmo embed` reads them
    assert sorted(vectors) == sorted(sentences)
    embedder = ElmoEmbedder(module=tiny_model)
    expected = embed_sentences(embedder, [s.split() for s in sentences])  # windows for the long one
    for sentence, layers in zip(sentences, expected):
        n_tokens = layers.shape[1]  # (3, n, 12) -> with sentence vectors the token mean (3, 12), zeros for none
        want = layers.sum(axis=1) / max(n_tokens, 1) if sentence_vectors else layers
        assert vectors[sentence].shape == want.shape, sentence[:40]
        np.testing.assert_allclose(vectors[sentence], want, atol=1e-5, err_msg=sentence[:40])

    # sentence_to_index: every sentence -> the name its array is stored under
    if suffix == ".h5":
        with h5py.File(out) as file:
            assert all(isinstance(file[name], h5py.Dataset) for name in file)  # no groups
            index = json.loads(file["sentence_to_index"][0])
            for sentence in sentences:
                np.testing.assert_array_equal(file[index[sentence]][()], vectors[sentence])
    else:
        with np.load(out) as archive:
            index = json.loads(str(archive["sentence_to_index"]))
            for sentence in sentences:
                np.testing.assert_array_equal(archive[index[sentence]], vectors[sentence])
    assert sorted(index) == sorted(sentences)


def test_read_embeddings_by_line_number(model_dir, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("a/b c\n\na/b c\n", encoding="utf-8")
    for name in ("o.h5", "o.npz"):
        assert main(["embed", str(source), str(tmp_path / name), "--top", "--model", str(model_dir), "--quiet"]) == 0
        vectors = read_embeddings(tmp_path / name)
        assert sorted(vectors) == ["0", "1", "2"]
        assert vectors["0"].shape == (2, 12) and vectors["1"].shape == (0, 12)
        np.testing.assert_array_equal(vectors["0"], vectors["2"])
