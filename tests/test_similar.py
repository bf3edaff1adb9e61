"""`elmo similar` on a tiny model: the printed ranking, layer 0 is context-free, the picture,
and bad input."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from elmokit import ElmoEmbedder
from elmokit.cli import main
from elmokit.inference.similar import LayerNeighbours, cue_labels, find_similar, kmeans, pca_2d

CORPUS = [
    "the children play in the park .",
    "we saw a play at the theatre .",
    "they play football on sunday .",
    "the play was long and the actors tired .",
    "",
    "no such word here .",
    "play play play",
]
QUERY = "a new play opened at the theatre"






@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(CORPUS) + "\n", encoding="utf-8")
    return path


def test_printed_ranking_per_layer(model_dir, corpus, capsys):
    assert main(["similar", str(corpus), "--query", QUERY, "--word", "play", "--top-k", "3",
                 "--model", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("query: a new [play] opened at the theatre\n")
    headers = re.findall(r"^layer (\d) \(.*\): 7 candidates, cosine (\S+) to (\S+)$", out, re.MULTILINE)
    assert [h[0] for h in headers] == ["0", "1", "2"]
    assert headers[0][1:] == ("1.0000", "1.0000")  # context-free
    rows = re.findall(r"^ +(\d)  (\d\.\d{4})  line (\d+): (.*)$", out, re.MULTILINE)
    assert len(rows) == 9 and all("[play]" in row[3] for row in rows)
    layer1 = [float(score) for _, score, _, _ in rows[3:6]]
    assert layer1 == sorted(layer1, reverse=True) and layer1[0] < 1.0
    assert "same layer-0 vector" in out


def test_layer_zero_is_context_free_and_any_word(tiny_model, corpus):
    embedder = ElmoEmbedder(module=tiny_model)
    query = QUERY.split()
    result = find_similar(embedder, query, 2, corpus, [0, 2], top_k=50, plot_layer=0)
    assert result.context_free and result.neighbours[0].n_seen == 7
    np.testing.assert_allclose(result.neighbours[0].scores, 1.0, atol=1e-6)
    np.testing.assert_array_equal(result.plot_vectors, np.broadcast_to(result.query_vectors[0], (7, 12)))
    assert result.neighbours[1].scores.max() < 1 - 1e-4  # the biLSTM layers see the context
    anything = find_similar(embedder, query, 2, corpus, [2], top_k=4, any_word=True)
    assert anything.neighbours[0].n_seen == sum(len(line.split()) for line in CORPUS)
    assert len(anything.neighbours[0].scores) == 4


def test_top_k_merge_keeps_the_best():
    neighbours = LayerNeighbours(layer=1)
    neighbours.add(np.array([0.1, 0.9, 0.5], np.float32), np.array([0, 1, 2]), np.array([0, 0, 0]), k=2)
    neighbours.add(np.array([0.7, 0.95], np.float32), np.array([3, 4]), np.array([1, 1]), k=2)
    assert neighbours.lines.tolist() == [4, 1] and neighbours.n_seen == 5
    assert neighbours.lowest == pytest.approx(0.1) and neighbours.highest == pytest.approx(0.95)


def test_plot_helpers():
    vectors = torch.cat([torch.randn(10, 5) + 5, torch.randn(10, 5) - 5]).double()
    _, axes, projections = pca_2d(vectors)
    assert axes.shape == (5, 2) and projections.shape == (20, 2)
    labels = kmeans(vectors, 2)
    assert len(set(labels[:10].tolist())) == 1 and labels[0] != labels[10]
    assert pca_2d(vectors[:1])[2].shape == (1, 2)
    assert cue_labels([["A", "Theatre"], ["x"], ["sport", "theatre"]], ["sport", "theatre"]) == [
        "theatre", "other", "sport"]


@pytest.mark.parametrize("colour", [["--colour-by", "theatre,football"], ["--clusters", "2"]])
def test_plot_is_a_png(model_dir, corpus, tmp_path, capsys, colour):
    picture = tmp_path / "play.png"
    assert main(["similar", str(corpus), "--query", QUERY, "--position", "2", "--plot", str(picture),
                 *colour, "--model", str(model_dir)]) == 0
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {picture}" in capsys.readouterr().err  # what it did: a message on stderr


def test_bad_input(model_dir, corpus, tmp_path, capsys):
    def fails(*argv: str, expect: str) -> None:
        assert main(["similar", *argv, "--model", str(model_dir)]) == 2
        err = capsys.readouterr().err.strip()
        assert expect in err and len(err.splitlines()) == 1, err

    fails(str(tmp_path / "missing.txt"), "--query", QUERY, "--word", "play", expect="missing.txt")
    fails(str(tmp_path), "--query", QUERY, "--word", "play", expect="is a directory")
    (tmp_path / "empty.txt").write_text("")
    fails(str(tmp_path / "empty.txt"), "--query", QUERY, "--word", "play", expect="empty")
    (tmp_path / "latin1.txt").write_bytes("play\ncaf\xe9 play\n".encode("latin-1"))
    fails(str(tmp_path / "latin1.txt"), "--query", QUERY, "--word", "play", expect="latin1.txt:2: invalid UTF-8")
    fails(str(corpus), "--query", QUERY, "--word", "opera", expect="not a token of the query")
    fails(str(corpus), "--query", QUERY, expect="--position")
    fails(str(corpus), "--query", QUERY, "--position", "99", expect="outside the query")
    fails(str(corpus), "--query", QUERY, "--word", "play", "--layer", "3", expect="layer 3 does not exist")
    fails(str(corpus), "--query", "opened", "--word", "opened", "--plot", str(tmp_path / "p.png"),
          expect="nothing to plot")
    assert not (tmp_path / "p.png").exists()
    (tmp_path / "p.png").write_text("keep me")
    fails(str(corpus), "--query", QUERY, "--word", "play", "--plot", str(tmp_path / "p.png"), expect="--overwrite")
    assert (tmp_path / "p.png").read_text() == "keep me"
