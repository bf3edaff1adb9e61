"""Where a dtype (float32, bfloat16, int8) meets the rest of the API: a module that carries an
earlier `dtype="int8"`'s marks, a module shared by several holders (and their token caches),
`elmo embed --resume` across dtypes, and the batch sizes the embed surfaces take."""

from __future__ import annotations

import copy
import json
import logging
import sys

import h5py
import numpy as np
import pytest
import torch

from elmokit import Elmo, ElmoEmbedder, batch_to_ids
from elmokit.model import int8
from elmokit.cli import main
from elmokit.inference import files
from elmokit.inference.elmo import bilm_precision
from elmokit.inference.files import EmbedOptions

needs_int8 = pytest.mark.skipif(not int8.int8_native(), reason="this CPU has neither VNNI nor AMX-INT8")
SENTENCES = [["The", "cat", "sat", "on", "the", "mat", "."], ["I", "ate", "an", "apple"], ["Hello"]]


def largest_difference(first: list[np.ndarray], second: list[np.ndarray]) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(first, second))


# ---------------------------------------------------------------------------------------------
# A module marked by an earlier dtype="int8"
# ---------------------------------------------------------------------------------------------
@needs_int8
def test_a_module_marked_int8_is_refused_for_state_or_gradients_at_construction(tiny_model):
    """The marks left on the module count as dtype="int8" does: refused where they are given,
    not a TypeError at the first forward."""
    marked = ElmoEmbedder(module=tiny_model, dtype="int8").bilm
    assert bilm_precision(marked) == "int8"
    for make in (lambda: ElmoEmbedder(module=marked, stateful=True),
                 lambda: Elmo(module=marked, stateful=True),
                 lambda: Elmo(module=marked, requires_grad=True)):
        with pytest.raises(ValueError, match="in int8 is for stateless inference.*dtype='float32' removes"):
            make()
    assert not any(parameter.requires_grad for parameter in marked.parameters())
    # dtype="float32" removes the marks: the stateful embedder then runs (exact float32)
    stateful = ElmoEmbedder(module=marked, stateful=True, dtype="float32")
    assert bilm_precision(marked) == "float32" and stateful.embed_sentence(["a", "b"]).shape == (3, 2, 12)


@needs_int8
def test_int8_refuses_a_module_already_in_bfloat16(tiny_model):
    """int8 quantizes float32 weights; from bfloat16 ones it would quantize a rounding."""
    narrowed = tiny_model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="int8 quantizes float32 weights, and this biLM's are in bfloat16.*"
                                         "load it in float32"):
        ElmoEmbedder(module=narrowed, dtype="int8")
    assert bilm_precision(narrowed) == "bfloat16"  # left as it was: not marked
    with pytest.raises(ValueError, match="load it in float32"):
        Elmo(module=narrowed, dtype="int8")


# ---------------------------------------------------------------------------------------------
# A module shared by several holders: one precision, the last given; the token cache follows it
# ---------------------------------------------------------------------------------------------
@needs_int8
def test_a_shared_module_runs_in_the_last_precision_given_and_the_token_cache_follows(tiny_model):
    exact = ElmoEmbedder(module=copy.deepcopy(tiny_model), cache_tokens=False).embed_batch(SENTENCES)
    quantized = ElmoEmbedder(module=copy.deepcopy(tiny_model), dtype="int8", cache_tokens=False).embed_batch(SENTENCES)
    assert largest_difference(exact, quantized) > 1e-4  # the two precisions differ visibly (4.7e-4)

    first = ElmoEmbedder(module=tiny_model)  # float32, its token cache filled
    np.testing.assert_array_equal(np.concatenate(first.embed_batch(SENTENCES), 1), np.concatenate(exact, 1))
    ElmoEmbedder(module=tiny_model, dtype="int8")  # another holder marks the shared module
    # the first embedder now runs int8 throughout: its cached float32 token vectors were dropped
    assert largest_difference(first.embed_batch(SENTENCES), quantized) < 1e-6
    # leaving dtype out keeps the module's precision (the docstring's "the biLM's own")
    assert bilm_precision(ElmoEmbedder(module=tiny_model).bilm) == "int8"
    # dtype="float32" undoes the marks: exact float32 again, for every holder and its cache
    again = ElmoEmbedder(module=tiny_model, dtype="float32")
    for embedder in (first, again):
        np.testing.assert_array_equal(np.concatenate(embedder.embed_batch(SENTENCES), 1), np.concatenate(exact, 1))


# ---------------------------------------------------------------------------------------------
# elmo embed --resume across dtypes
# ---------------------------------------------------------------------------------------------
def _interrupted_before_the_merge(monkeypatch, arguments: list[str]) -> None:
    """Run `elmo embed` until every segment is written, then stop it as a kill before the merge
    would: OUTPUT.partial/ holds the whole first run's work, ready to resume."""
    def stop(*args, **kwargs):
        raise KeyboardInterrupt("stopped before the merge")

    with monkeypatch.context() as patch:
        patch.setattr(files, "merge_segments", stop)
        assert main(arguments) != 0


@needs_int8
@pytest.mark.parametrize("suffix", [".h5", ".npz", ".parquet"])
def test_resume_refuses_a_partial_made_in_another_dtype(model_dir, tmp_path, monkeypatch, capsys, suffix):
    """int8 keeps the float32 weights (the model's digest is the same): the precision is recorded
    beside it, and a resume in another dtype is refused, naming both, in every output format."""
    source = tmp_path / "in.txt"
    source.write_text("".join(f"{' '.join(sentence)}\n" for sentence in SENTENCES * 3))
    output = tmp_path / f"out{suffix}"
    command = ["embed", str(source), str(output), "--model", str(model_dir), "--no-progress", "--device", "cpu",
               "--checkpoint-every", "4"]
    _interrupted_before_the_merge(monkeypatch, [*command, "--dtype", "int8"])
    progress = json.loads((tmp_path / f"out{suffix}.partial" / "progress-rank0.json").read_text())
    assert progress["identity"]["precision"] == "int8" and progress["done"]
    capsys.readouterr()
    for dtype in ([], ["--dtype", "float32"], ["--dtype", "bfloat16"]):
        assert main([*command, "--resume", *dtype]) == 2
        error = capsys.readouterr().err
        now = dtype[1] if dtype else "float32"
        assert "cannot resume" in error and f"the partial's vectors: int8; this run's: {now}" in error
        assert "made with a different precision (" in error and "--overwrite" in error  # not "model" for bf16
        assert not output.exists() and (tmp_path / f"out{suffix}.partial").is_dir()
    assert main([*command, "--resume", "--dtype", "int8"]) == 0  # the same dtype continues
    assert output.exists()


def test_resume_of_a_partial_without_a_recorded_precision_warns(tmp_path, caplog):
    """A partial from before the precision was recorded may hold int8 vectors under a float32
    model's digest: resumed (an upgrade keeps its unfinished runs), with a warning that says so;
    one that records another precision is refused."""
    partial = tmp_path / "o.h5.partial"
    partial.mkdir()
    made = {"input": {"size": 3}, "options": {}, "model": "m", "world_size": 1, "batch_size": None}
    files.start_progress(partial, 0, made, resume=False).save()
    with caplog.at_level(logging.WARNING, logger=files.log.name):
        files.start_progress(partial, 0, {**made, "precision": "float32"}, resume=True)
    assert "did not record its precision, in float32" in caplog.text
    files.start_progress(partial, 0, {**made, "precision": "int8"}, resume=False).save()
    with pytest.raises(ValueError, match=r"different precision \(the partial's vectors: int8; this run's: float32"):
        files.start_progress(partial, 0, {**made, "precision": "float32"}, resume=True)


@needs_int8
def test_elmos_vocabulary_cache_follows_the_precision_another_holder_gives_the_module(tiny_model):
    """Elmo(vocab_to_cache=...) computes its words' token layer once; where another holder then
    switches the shared module to int8 (whose token encoder runs in bfloat16), the word path runs
    the same numbers as the char path, not float32 token vectors into an int8 LSTM."""
    vocabulary = ["<pad>", "The", "cat", "sat", "on", "the", "mat", "."]
    elmo = Elmo(module=tiny_model, dropout=0.0, vocab_to_cache=vocabulary).eval()
    sentences = [SENTENCES[0], ["the", "cat"]]
    word_ids = torch.tensor([[vocabulary.index(word) for word in sentences[0]],
                             [vocabulary.index("the"), vocabulary.index("cat"), 0, 0, 0, 0, 0]])

    def both_paths() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return (elmo(word_inputs=word_ids)["elmo_representations"][0],
                    elmo(batch_to_ids(sentences))["elmo_representations"][0])

    by_words, by_chars = both_paths()
    torch.testing.assert_close(by_words, by_chars, atol=1e-5, rtol=0)
    ElmoEmbedder(module=tiny_model, dtype="int8")  # another holder: the module is int8 from now on
    by_words_int8, by_chars_int8 = both_paths()
    assert (by_chars_int8 - by_chars).abs().max() > 1e-4  # the char path did change precision
    torch.testing.assert_close(by_words_int8, by_chars_int8, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# batch sizes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["3", 2.5, True])
def test_embed_file_names_a_batch_size_that_is_not_an_int(tiny_model, tmp_path, bad):
    source = tmp_path / "in.txt"
    source.write_text("a b\nc\n")
    with pytest.raises(TypeError, match=rf"batch_size must be an int or None \(the engine's choice\), got {bad!r}"):
        ElmoEmbedder(module=tiny_model).embed_file(source, tmp_path / "o.h5", batch_size=bad)
    assert not (tmp_path / "o.h5").exists()


@pytest.mark.parametrize("name", ["checkpoint_every", "max_length", "overlap"])
def test_embed_options_name_an_integer_option_that_is_not_an_int(name):
    with pytest.raises(TypeError, match=f"{name} must be an int, got '9'"):
        EmbedOptions(**{name: "9"})


def test_embed_options_take_numpy_integers_and_record_them_as_json():
    options = EmbedOptions(batch_size=np.int64(8), checkpoint_every=np.int32(5), max_length=np.int64(100))
    assert json.loads(json.dumps(options.identity()))["max_length"] == 100 and options.batch_size == 8


def test_a_huge_batch_size_is_one_batch_stateful_as_stateless(tiny_model):
    """Stateless embed_sentences took 10**20; stateful it met islice's limit. More sentences a
    batch than any input holds is one batch of them all, in both."""
    stateful = ElmoEmbedder(module=copy.deepcopy(tiny_model), stateful=True)
    huge = list(stateful.embed_sentences(SENTENCES, batch_size=10**20))
    stateful.reset_states()
    one_batch = stateful.embed_batch(SENTENCES)
    assert len(huge) == len(SENTENCES)
    for got, expected in zip(huge, one_batch):
        np.testing.assert_array_equal(got, expected)
    stateless = ElmoEmbedder(module=copy.deepcopy(tiny_model))
    assert stateless.rows_for(10**20) == sys.maxsize
    assert largest_difference(list(stateless.embed_sentences(SENTENCES, batch_size=10**20)),
                              stateless.embed_batch(SENTENCES)) < 1e-6


# ---------------------------------------------------------------------------------------------
# what the docstrings and `elmo embed --help` say of the dtypes
# ---------------------------------------------------------------------------------------------
def test_every_surface_that_takes_int8_says_so():
    from elmokit.commands.embed import DESCRIPTION
    from elmokit.inference import elmo

    assert "int8" in elmo.__doc__ and '"int8"' in Elmo.__doc__ and "--dtype int8" in DESCRIPTION
    assert "another --dtype" in DESCRIPTION  # what --resume does with one


def test_the_embedder_points_to_its_speed_page_without_quoting_it():
    """A speed measured on one CPU lives in its bench page, which anyone may rerun elsewhere: the
    docstring names the page and carries no figure of it."""
    import re

    doc = " ".join(ElmoEmbedder.__doc__.split())
    assert "bench/results/embed.md" in doc
    assert not re.search(r"\d+(\.\d+)?(-\d+(\.\d+)?)?x float32|tokens/s", doc), doc


def test_resume_keeps_the_partials_segment_size(model_dir, tmp_path, monkeypatch, caplog):
    """Begun with --checkpoint-every 4, resumed without it (2000): the partial's size is kept (the
    merge reads its segments by it), said in a warning, and the output is the uninterrupted run's."""
    source = tmp_path / "in.txt"
    source.write_text("".join(f"{' '.join(sentence)}\n" for sentence in SENTENCES * 3))
    command = ["embed", str(source), str(tmp_path / "out.h5"), "--model", str(model_dir), "--no-progress"]
    _interrupted_before_the_merge(monkeypatch, [*command, "--checkpoint-every", "4"])
    with caplog.at_level("WARNING", logger="elmokit"):
        assert main([*command, "--resume"]) == 0
    assert "segments of 4 sentences (--checkpoint-every), as it was begun" in caplog.text
    whole = tmp_path / "whole.h5"
    assert main(["embed", str(source), str(whole), "--model", str(model_dir), "--no-progress"]) == 0
    with h5py.File(tmp_path / "out.h5") as resumed, h5py.File(whole) as expected:
        assert resumed.keys() == expected.keys()
        for key in expected:
            if key != "sentence_to_index":
                np.testing.assert_array_equal(resumed[key][()], expected[key][()])


def test_a_placement_that_changes_a_shared_modules_precision_says_so(tiny_model, caplog):
    """The precision is the module's own: an embedder made with another dtype on a module an
    earlier one placed changes it for both, and says so once; the same dtype, or none, is silent;
    a deep copy keeps each its own."""
    module = copy.deepcopy(tiny_model)
    with caplog.at_level(logging.WARNING, logger="elmokit.inference.elmo"):
        first = ElmoEmbedder(module=module, dtype=torch.bfloat16)
        ElmoEmbedder(module=module, dtype=torch.bfloat16)
        ElmoEmbedder(module=module)
        assert not caplog.records
        ElmoEmbedder(module=module, dtype="float32")
        assert len(caplog.records) == 1 and "placed in bfloat16 before and now runs in float32" in caplog.text
        assert first.bilm.lstm.layers[0].input_weight.dtype == torch.float32  # the first holder's too
        ElmoEmbedder(module=copy.deepcopy(module), dtype=torch.bfloat16)
        assert len(caplog.records) == 1 and module.lstm.layers[0].input_weight.dtype == torch.float32
