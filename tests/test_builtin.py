"""The built-in English model (src/elmokit/models/gutenberg-en): what ships, that every model
argument defaults to it, and that its vectors tell the senses of "play" apart as the paper shows."""

from __future__ import annotations

import gzip
import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open

from elmokit import ElmoEmbedder
from elmokit.model.builtin import MODELS_DIR, BUILTIN_MODEL, builtin_model_dir
from elmokit.cli import main
from elmokit.commands.demo import SAMPLES

MODEL_DIR = MODELS_DIR / BUILTIN_MODEL
pytestmark = pytest.mark.skipif(not (MODEL_DIR / "model.safetensors").is_file(),
                                reason=f"the built-in model is not in this checkout ({MODEL_DIR})")

# The senses of "play" in demo/play.txt, line by line: 8 of sport and games, 8 of theatre, 5 of
# music, 3 others (light playing on water, a smile, foul play).
SENSES = ["sport"] * 8 + ["theatre"] * 8 + ["music"] * 5 + ["other"] * 3


@pytest.fixture(scope="module")
def embedder() -> ElmoEmbedder:
    return ElmoEmbedder()  # no model argument: the built-in model


def _card() -> dict:
    return json.loads((MODEL_DIR / "provenance.json").read_text())


def _ships_softmax() -> bool:
    """v1 shipped its embedding part only; from v2 on the softmax ships (card `version`)."""
    return _card().get("version", "v1") != "v1"


def test_the_package_holds_the_model_its_vocabulary_and_its_record():
    assert builtin_model_dir() == MODEL_DIR
    size = sum(path.stat().st_size for path in MODEL_DIR.rglob("*") if path.is_file())
    limit_mb = 36 if _ships_softmax() else 30  # the wheel holding it: at most 40 MB (scripts/build_builtin.sh)
    assert size <= limit_mb * 2 ** 20, f"{size / 2 ** 20:.1f} MB"
    with safe_open(MODEL_DIR / "model.safetensors", "pt") as weights:
        names = list(weights.keys())
        assert {str(weights.get_tensor(name).dtype) for name in names} == {"torch.float16"}
        softmax = {name: weights.get_slice(name).get_shape() for name in names if name.startswith("softmax.")}
    vocab = (MODEL_DIR / "vocab.txt").read_text(encoding="utf-8").split("\n")
    assert vocab[:3] == ["<S>", "</S>", "<UNK>"] and len([w for w in vocab if w]) == 100_000
    if _ships_softmax():  # a row per vocabulary entry
        assert softmax == {"softmax.weight": [100_000, 128], "softmax.bias": [100_000]}
    else:
        assert softmax == {}
    card = _card()
    for split in ("valid", "test"):
        scores = next(value for key, value in card.items() if key.startswith(split + "_first_"))
        assert 1 < scores["ppl"] < 1000 and scores["n_tokens"] > 50_000
    for name in ("curves.png", "metrics.jsonl", "train_gutenberg.sh", "gutenberg-cpu.json", "config.json"):
        assert (MODEL_DIR / name).is_file(), name


def test_vectors_are_float32_and_do_not_depend_on_the_batch(embedder):
    alone = embedder.embed_sentence(["The", "play", "was", "a", "success", "."])
    batch = embedder.embed_batch([["I", "play", "the", "violin"], ["The", "play", "was", "a", "success", "."], []])
    dim = 2 * embedder.bilm.config.lstm.projection_dim
    assert alone.dtype == np.float32 and alone.shape == (3, 6, dim)
    assert batch[2].shape == (3, 0, dim)
    np.testing.assert_allclose(batch[1], alone, rtol=0, atol=2e-6)  # float32 rounding only: the README's bound


def test_every_command_defaults_to_the_builtin_model(tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("They play football .\n\nThe play was long .\n", encoding="utf-8")
    assert main(["embed", str(source), str(tmp_path / "out.hdf5"), "--top", "--quiet"]) == 0
    assert main(["info"]) == 0
    assert "gutenberg" in capsys.readouterr().out.lower()
    options, weights = tmp_path / "options.json", tmp_path / "weights.hdf5"
    assert main(["convert", "--to-original", str(options), str(weights)]) == 0
    sentence = ["They", "play", "football", "."]
    np.testing.assert_array_equal(ElmoEmbedder(options, weights).embed_sentence(sentence),
                                  ElmoEmbedder().embed_sentence(sentence))


def test_elmo_module_defaults_to_the_builtin_model():
    from elmokit import Elmo, batch_to_ids

    elmo = Elmo(num_output_representations=2, dropout=0.0)
    out = elmo(batch_to_ids([["They", "play", "football"], ["A", "play"]]))
    assert len(out["elmo_representations"]) == 2
    assert out["elmo_representations"][0].shape == (2, 3, elmo.get_output_dim())
    assert out["mask"].tolist() == [[True, True, True], [True, True, False]]


def _play_vectors(embedder) -> np.ndarray:
    """(L+1, 24, 2P): the vector of "play" in each demo sentence."""
    sentences = [line.split() for line in SAMPLES.read_text(encoding="utf-8").splitlines() if line.strip()]
    positions = [[word.lower() for word in sentence].index("play") for sentence in sentences]
    vectors = embedder.embed_batch(sentences)
    return np.stack([layers[:, position] for layers, position in zip(vectors, positions)], axis=1)


def test_contextual_layers_tell_the_senses_of_play_apart(embedder):
    """Hand-labelled senses (independent of the model): at layer 0 every "play" is the same vector;
    at layers 1 and 2 occurrences of the same sense are closer than occurrences of different senses,
    and the nearest other occurrence shares the sense above the majority-class rate (8/24), well
    above it at the top layer, where the paper finds word sense (v3: 0.46 at layer 1, 0.50 at
    layer 2; v2: 0.42 and 0.58; v1: 0.71 at layer 1)."""
    vectors = _play_vectors(embedder)
    labels = np.array(SENSES)
    assert len(labels) == vectors.shape[1]
    np.testing.assert_allclose(vectors[0], np.broadcast_to(vectors[0, :1], vectors[0].shape), atol=1e-5)
    for layer in (1, 2):
        unit = vectors[layer] / np.linalg.norm(vectors[layer], axis=1, keepdims=True)
        cosine = unit @ unit.T
        np.fill_diagonal(cosine, -np.inf)
        nearest_agrees = (labels[cosine.argmax(axis=1)] == labels).mean()
        assert nearest_agrees >= (0.45 if layer == 2 else 0.4), (layer, nearest_agrees)
        known = labels != "other"
        same = (labels[:, None] == labels[None]) & known[:, None] & ~np.eye(len(labels), dtype=bool)
        different = (labels[:, None] != labels[None]) & known[:, None] & known[None]
        assert cosine[same].mean() > cosine[different].mean() + 0.05, layer


def test_the_readme_perplexity_is_what_a_user_gets_from_the_installed_package(tmp_path):
    """The README's test perplexity (the card's, first 5,000 sentences of the test split) by the
    user's commands, each a process of its own as the user runs them: `elmo prepare` of the raw
    test text, then `elmo perplexity FILES --max-sentences 5000` with no model argument. The first
    3,000 raw lines (one paragraph a line, split line by line) hold more than 5,000 sentences, so
    they give the same first 5,000."""
    from tests.conftest import DATA, require_shared

    if not _ships_softmax():
        pytest.skip("the built-in model v1 ships without its softmax: nothing to score with")
    raw = require_shared(DATA / "gutenberg-en" / "test.txt.gz")
    head = tmp_path / "test-head.txt"
    with gzip.open(raw, "rt", encoding="utf-8") as lines:
        head.write_text("".join(itertools.islice(lines, 3000)), encoding="utf-8")

    def elmo(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "elmokit", *args], capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    elmo("prepare", str(head), "-o", str(tmp_path / "test"), "--quiet")
    scores = json.loads(elmo("perplexity", str(tmp_path / "test" / "*.txt.gz"), "--max-sentences", "5000", "--json",
                             "--no-progress"))
    expected = _card()["test_first_5000_sentences"]
    assert scores["n_tokens"] == expected["n_tokens"]
    for key in ("forward_ppl", "backward_ppl", "ppl"):
        assert scores[key] == pytest.approx(expected[key], rel=1e-4), key
