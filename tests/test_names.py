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
