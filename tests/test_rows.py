"""The rows of the recurrence when the caller leaves the choice to the engine (batch_size=None):
`streams.default_rows` from its budgets, what ElmoEmbedder, embed_file and `elmo embed` run with it,
and the same vectors whatever the rows."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from elmokit import ElmoConfig, ElmoEmbedder
from elmokit.cli import main
from elmokit.inference import embedder as embedder_module
from elmokit.inference import streams
from elmokit.inference import files

WORDS = ["The", "cat", "sat", ".", "A", "dog", "Colorless", "green", "ideas", "sleep", "furiously", "x", "!"]
RNG = np.random.default_rng(0)
SENTENCES = [[WORDS[i] for i in RNG.integers(0, len(WORDS), RNG.integers(0, 12))] for _ in range(300)]


@pytest.mark.parametrize("shape, positions, expected", [
    ("original", 16_384, 128),  # ElmoEmbedder's budget: 128 positions a stream
    ("original", 1 << 20, 256),  # memory: 2 x 256 x 4 x 4096 floats = 2^23, the gate budget
    ("small", 1 << 20, 1024),  # memory: 2 x 1024 x 4 x 1024 = 2^23
    ("small", 1 << 30, 1024),
    ("small", 200 * 128, 256),  # 200 streams of 128 positions: the nearest power of two
    ("small", 180 * 128, 128),
    ("original", 16_380, 128),  # a window a sentence short of the budget: still 128
    ("small", 100, 32),  # a short call: never fewer than 32 rows
    ("small", 40 * 128, 32),
    ("small", 70 * 128, 64),
])
def test_default_rows_follows_its_budgets(shape, positions, expected):
    assert streams.default_rows(ElmoConfig.from_name(shape).lstm.cell_dim, positions) == expected


def test_default_rows_within_the_gate_budget_and_its_ceiling(tiny_model):
    assert streams.default_rows(tiny_model.lstm.cell_dim, 1 << 40) == streams.MAX_DEFAULT_ROWS
    assert streams.default_rows(1 << 16, 1 << 20) == 16  # the gate budget under the floor of 32: the budget wins


def recorded_rows(monkeypatch, groups: list[int] | None = None) -> list[int]:
    """The rows every call of the engine runs with, from here on (and into `groups`, the
    sentences of each call)."""
    seen: list[int] = []
    real = embedder_module.contextualize_sentences

    def recording(bilm, token_embeddings, sizes, rows):
        seen.append(rows)
        if groups is not None:
            groups.append(len(sizes))
        return real(bilm, token_embeddings, sizes, rows)

    monkeypatch.setattr(embedder_module, "contextualize_sentences", recording)
    return seen


def same_vectors(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=0, atol=2e-6)


def test_no_batch_size_runs_the_engines_rows_and_the_same_vectors(tiny_model, monkeypatch):
    embedder = ElmoEmbedder(module=tiny_model)
    explicit = list(embedder.embed_sentences(SENTENCES, batch_size=3))
    groups: list[int] = []
    seen = recorded_rows(monkeypatch, groups)
    same_vectors(explicit, list(embedder.embed_sentences(SENTENCES)))
    assert seen == [32]  # one call of ~2,000 positions: 15 streams of 128, so the floor of 32 rows
    seen.clear()
    monkeypatch.setattr(embedder, "POSITION_BUDGET", 1_000)  # calls of <= 1,000 positions: still 32
    embedder.embed_many(SENTENCES)
    assert len(seen) > 1 and set(seen) == {32}
    seen.clear()
    groups.clear()
    many = SENTENCES * 10  # 3,000 sentences, ~22,000 positions: a full window of 16,384 runs 128 rows...
    monkeypatch.setattr(embedder, "POSITION_BUDGET", ElmoEmbedder.POSITION_BUDGET)
    vectors = embedder.sentence_vectors(many)
    assert seen == [128, 128]  # ...and so does the short last window: one row count a stream
    assert groups[0] > 128 * ElmoEmbedder.STREAM_WINDOW  # the positions close a window, not 16 batches of 128
    np.testing.assert_allclose(vectors, embedder.sentence_vectors(many, batch_size=7), rtol=0, atol=2e-6)
    seen.clear()
    list(embedder.embed_sentences(SENTENCES, batch_size=5))  # given: honoured
    assert set(seen) == {5}


def test_every_row_count_gives_the_same_numbers(tiny_model):
    """The choice changes the speed only: 1 to 256 streams give one set of vectors (each sentence
    from a zero state; 300 sentences, so 256 rows are 256 streams)."""
    embedder = ElmoEmbedder(module=tiny_model, cache_tokens=False)
    reference = embedder.embed_many(SENTENCES, rows=1)
    for rows in (7, 32, 128, 256):
        same_vectors(reference, embedder.embed_many(SENTENCES, rows=rows))


def test_weights_reordered_for_many_rows_serve_calls_of_fewer(tiny_model):
    """Calls of few and of many sentences in turn (32 and 128 rows) reorder the weights once, for
    the most rows yet; fewer rows run on them with the same numbers; more rows reorder again."""
    from elmokit.inference import engine

    embedder = ElmoEmbedder(module=tiny_model, cache_tokens=False)
    layer = tiny_model.lstm.layers[0]
    big = embedder.embed_many(SENTENCES, rows=128)
    products = layer.__dict__[engine.PACKED_KEY][1]
    small = embedder.embed_many(SENTENCES[:40], rows=32)
    assert layer.__dict__[engine.PACKED_KEY][1] is products  # not reordered for 32 rows
    same_vectors(small, ElmoEmbedder(module=copy.deepcopy(tiny_model), cache_tokens=False)
                 .embed_many(SENTENCES[:40], rows=32))
    same_vectors(big, embedder.embed_many(SENTENCES, rows=128))
    assert layer.__dict__[engine.PACKED_KEY][1] is products
    embedder.embed_many(SENTENCES, rows=256)
    assert layer.__dict__[engine.PACKED_KEY][1] is not products  # more rows than reordered for: again


def test_a_stateful_embedder_keeps_allennlps_batches_of_64(tiny_model):
    """Stateful, the batches are consecutive sentences that share the carried state (the
    original's semantics), so None means AllenNLP's 64, not the engine's rows."""
    runs = {}
    for batch_size in (None, 64, 32):
        embedder = ElmoEmbedder(module=tiny_model, stateful=True)
        runs[batch_size] = list(embedder.embed_sentences(SENTENCES[:105], batch_size=batch_size))
    for a, b in zip(runs[None], runs[64], strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(runs[None], runs[32]))  # the batching does matter here


@pytest.mark.parametrize("bad", [0, -3])
def test_a_batch_size_below_one_is_refused(tiny_model, bad):
    embedder = ElmoEmbedder(module=tiny_model)
    with pytest.raises(ValueError, match=rf"^batch_size must be >= 1 \(or None: the engine's choice\), got {bad}$"):
        list(embedder.embed_sentences(SENTENCES, batch_size=bad))
    with pytest.raises(ValueError, match=rf"^rows must be >= 1 \(or None: the engine's choice\), got {bad}$"):
        embedder.embed_many(SENTENCES, rows=bad)
    with pytest.raises(ValueError, match=rf"^batch_size \(--batch-size\) must be >= 1, got {bad}$"):
        files.EmbedOptions(batch_size=bad)


@pytest.mark.parametrize("bad", [2.5, True, "8"])
def test_a_batch_size_that_is_no_int_is_refused(tiny_model, bad):
    with pytest.raises(TypeError, match=r"^batch_size must be an int >= 1 or None \(the engine's choice\), got "):
        list(ElmoEmbedder(module=tiny_model).embed_sentences(SENTENCES, batch_size=bad))


def test_embed_file_and_the_cli_leave_the_rows_to_the_engine(model_dir, tiny_model, tmp_path, monkeypatch):
    """No --batch-size: the engine's rows, and the progress kept for a resume says so (None)."""
    text = tmp_path / "in.txt"
    text.write_text("\n".join(" ".join(s) for s in SENTENCES) + "\n")
    seen = recorded_rows(monkeypatch)
    identities = []
    start_progress = files.start_progress

    def recording(partial, rank, identity, resume):
        identities.append(identity)
        return start_progress(partial, rank, identity, resume)

    monkeypatch.setattr(files, "start_progress", recording)
    assert main(["embed", str(text), str(tmp_path / "out.hdf5"), "--model", str(model_dir), "--no-progress"]) == 0
    assert seen == [32] and identities[0]["batch_size"] is None
    seen.clear()
    assert main(["embed", str(text), str(tmp_path / "b.hdf5"), "--model", str(model_dir), "--no-progress",
                 "--batch-size", "9"]) == 0
    assert set(seen) == {9} and identities[1]["batch_size"] == 9
    seen.clear()  # two windows in one segment: the second, short, runs the first's rows (weights reordered once)
    text.write_text("\n".join(" ".join(s) for s in SENTENCES * 10) + "\n")
    files.embed_file(ElmoEmbedder(module=tiny_model), text, tmp_path / "c.hdf5",
                     files.EmbedOptions(checkpoint_every=5000))
    assert seen == [128, 128]


def test_the_cli_on_ray_keeps_rays_batch_unless_given(model_dir, tmp_path, monkeypatch):
    """`elmo embed --ray` without --batch-size: Ray's own batch and rows (embed_files' defaults);
    --batch-size N is the rows of each actor's recurrence, as without --ray, in Ray batches of
    256 lines or N when N is more."""
    elmo_ray = pytest.importorskip("elmokit.ray")
    calls = []
    monkeypatch.setattr(elmo_ray, "embed_files", lambda *args, **kwargs: calls.append(kwargs) or
                        {"rows": 0, "tokens": 0, "files": 0, "seconds": 1.0})
    text = tmp_path / "in.txt"
    text.write_text("a b\n")
    for extra in ([], ["--batch-size", "16"], ["--batch-size", "300"]):
        assert main(["embed", str(text), str(tmp_path / f"out{len(calls)}"), "--model", str(model_dir), "--ray",
                     "local", "--no-progress", *extra]) == 0
    assert "batch_size" not in calls[0] and "forward_rows" not in calls[0]
    assert (calls[1]["forward_rows"], calls[1]["batch_size"]) == (16, 256)
    assert (calls[2]["forward_rows"], calls[2]["batch_size"]) == (300, 300)


def test_task_features_leave_the_rows_to_the_engine(tiny_model, monkeypatch):
    from elmokit.tasks.features import compute_layers

    explicit = compute_layers(tiny_model, SENTENCES, batch_size=5, progress=False, dtype=torch.float32)
    seen = recorded_rows(monkeypatch)
    chosen = compute_layers(tiny_model, SENTENCES, progress=False, dtype=torch.float32)
    assert seen == [32]  # ~2,000 positions: the floor
    same_vectors([t.numpy() for t in explicit], [t.numpy() for t in chosen])
