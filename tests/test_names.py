"""The built-in model's name and the `gutenberg-cpu` training preset: every model argument takes
`gutenberg-en`, and `elmo train --model gutenberg-cpu` builds the built-in model's shape."""

from __future__ import annotations

import numpy as np

from elmokit import ElmoConfig, ElmoEmbedder, load_model
from elmokit.model.builtin import builtin_model_dir
from elmokit.model.config import PRESETS
from tests.conftest import REPO


def test_the_builtin_name_is_accepted_everywhere_a_model_is_named(capsys):
    from elmokit.cli import main

    sentence = ["They", "play", "football", "."]
    np.testing.assert_array_equal(ElmoEmbedder("gutenberg-en").embed_sentence(sentence),
                                  ElmoEmbedder().embed_sentence(sentence))
    assert load_model("gutenberg-en").config == load_model().config
    assert main(["info", "gutenberg-en", "--json"]) == 0 and main(["info", "--model", "gutenberg-en", "--json"]) == 0
    first, second = capsys.readouterr().out.split("\n}\n")[:2]
    assert first == second and str(builtin_model_dir()) in first


def test_the_gutenberg_cpu_preset_is_the_builtin_shape():
    builtin = ElmoConfig.load(builtin_model_dir() / "config.json")
    assert PRESETS["gutenberg-cpu"] == builtin == ElmoConfig.load(REPO / "scripts" / "gutenberg-cpu.json")
    assert ElmoConfig.from_name("gutenberg-cpu") == builtin


def test_a_native_model_directory_records_the_elmokit_version(tiny_model, tmp_path):
    """config.json says which elmokit wrote it (a record for the reader, ignored when loading)."""
    import json

    import elmokit
    from elmokit import load_pretrained, save_pretrained

    save_pretrained(tiny_model, tmp_path / "model")
    saved = json.loads((tmp_path / "model" / "config.json").read_text(encoding="utf-8"))
    assert saved["elmokit_version"] == elmokit.__version__
    assert load_pretrained(tmp_path / "model").config == tiny_model.config


def test_the_same_model_saved_twice_gives_the_same_bytes(tiny_model, tmp_path):
    """A model's file is a function of its weights: saved eight times, eight identical files (a
    checksum users compare; safetensors orders several metadata keys at random)."""
    from elmokit import save_pretrained

    files = set()
    for copy in range(8):
        save_pretrained(tiny_model, tmp_path / str(copy))
        files.add((tmp_path / str(copy) / "model.safetensors").read_bytes())
    assert len(files) == 1


def test_a_model_directory_is_given_the_same_way_to_perplexity_and_export(tmp_path, capsys):
    """--model DIR means what the positional MODEL / SOURCE means, in elmo perplexity and elmo export
    (as in every command that takes a model); both at once must agree."""
    import json

    from elmokit.cli import main

    model = str(builtin_model_dir())
    text = tmp_path / "text.txt"
    text.write_text("The cat sat on the mat .\nThey play football on Sundays .\n", encoding="utf-8")
    assert main(["perplexity", model, str(text), "--json", "--device", "cpu", "--no-progress"]) == 0
    positional = json.loads(capsys.readouterr().out)
    assert main(["perplexity", "--model", model, str(text), "--json", "--device", "cpu", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out) == positional
    assert main(["export", "--model", model, "--native", str(tmp_path / "a"), "--no-softmax"]) == 0
    assert main(["export", model, "--native", str(tmp_path / "b"), "--no-softmax"]) == 0
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert main(["export", model, "--model", str(tmp_path), "--native", str(tmp_path / "c")]) == 2
    assert "give the model once" in capsys.readouterr().err
