"""Smoke runs of the command line on a tiny model: every subcommand, its help, and bad input."""

from __future__ import annotations

import subprocess
import sys

import h5py
import torch

from elmokit.cli import build_parser, main
from elmokit.model.weights import read_safetensors


def test_every_subcommand_has_complete_help(capsys):
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices
    assert set(subcommands) == {"demo", "prepare", "vocab", "train", "perplexity", "export", "embed",
                                "similar", "info", "convert", "download", "cache", "serve", "task"}
    for name, sub in subcommands.items():
        text = sub.format_help()
        assert sub.description, f"{name} has no description"
        for action in sub._actions:
            if action.dest != "help" and action.option_strings:
                assert action.help, f"{name} {action.option_strings} has no help"
        assert "usage" in text


def test_python_dash_m_runs():
    result = subprocess.run([sys.executable, "-m", "elmokit", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "embed" in result.stdout


def test_demo_embeds_the_samples_and_ranks_play_per_layer(model_dir, capsys):
    assert main(["demo", "--model", str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert "embedded 24 sentences, 301 tokens" in out
    # the token layer is context-free: all 24 occurrences of "play" share the query's vector
    assert "layer 0 (context-free token layer): 24 candidates, cosine 1.0000 to 1.0000" in out
    assert "layer 2 (biLSTM layer 2): 24 candidates" in out
    assert "query: They [play] football on Sundays ." in out


def test_embed_writes_hdf5(model_dir, tmp_path, capsys):
    source = tmp_path / "in.txt"
    source.write_text("a b c\n\nd\n", encoding="utf-8")
    assert main(["embed", str(source), str(tmp_path / "o.hdf5"), "--top", "--model", str(model_dir)]) == 0
    with h5py.File(tmp_path / "o.hdf5") as file:
        assert file["0"].shape == (3, 12) and file["1"].shape == (0, 12)


def test_embed_bad_input(model_dir, tmp_path, capsys):
    out = tmp_path / "o.hdf5"
    assert main(["embed", str(tmp_path / "missing.txt"), str(out), "--model", str(model_dir)]) == 2
    assert "missing.txt" in capsys.readouterr().err
    (tmp_path / "folder").mkdir()  # a folder given as the input file (the output outside it)
    assert main(["embed", str(tmp_path / "folder"), str(out), "--model", str(model_dir)]) == 2
    assert "directory" in capsys.readouterr().err
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9\n".encode("latin-1"))
    assert main(["embed", str(bad), str(out), "--model", str(model_dir)]) == 2
    assert not out.exists()
    good = tmp_path / "good.txt"
    good.write_text("x\n", encoding="utf-8")
    out.write_text("keep me")
    assert main(["embed", str(good), str(out), "--model", str(model_dir)]) == 2
    assert "--overwrite" in capsys.readouterr().err and out.read_text() == "keep me"


def test_info_and_convert_round_trip(model_dir, tmp_path, capsys):
    assert main(["info", "--model", str(model_dir)]) == 0
    assert "parameters" in capsys.readouterr().out
    options, weights = tmp_path / "o.json", tmp_path / "w.hdf5"
    assert main(["convert", "--model", str(model_dir), "--to-original", str(options), str(weights)]) == 0
    assert main(["convert", "--options-file", str(options), "--weight-file", str(weights),
                 "--to-native", str(tmp_path / "back")]) == 0
    back = read_safetensors(tmp_path / "back" / "model.safetensors")
    original = read_safetensors(model_dir / "model.safetensors")
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in back)
    assert main(["convert", "--model", str(model_dir), "--to-native", str(tmp_path / "back")]) == 2


def test_demo_top_k_below_one_is_refused(capsys):
    for value in ("0", "-1"):
        assert main(["demo", "--top-k", value]) == 2
        assert "--top-k must be >= 1" in capsys.readouterr().err


def test_to_native_overwrite_drops_the_replaced_models_record(model_dir, tmp_path):
    """provenance.json and README.md of the model a --to-native --overwrite replaces are not this one's."""
    out = tmp_path / "native"
    assert main(["convert", "--model", str(model_dir), "--to-native", str(out)]) == 0
    (out / "provenance.json").write_text('{"tokens": 53600000, "source": "another model"}')
    (out / "README.md").write_text("# another model")
    assert main(["convert", "--model", str(model_dir), "--to-native", str(out), "--overwrite"]) == 0
    assert not (out / "provenance.json").exists() and not (out / "README.md").exists()
    assert (out / "model.safetensors").is_file()
