"""Light installs: without an optional extra, what needs it says which extra to install, and
nothing else breaks. A package is made absent by `sys.modules[name] = None` (import fails)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from elmokit.cli import main
from elmokit.model.config import CharCNNConfig, ElmoConfig, LSTMConfig
from elmokit.extras import EXTRAS, MissingExtraError, require

REPO = Path(__file__).resolve().parents[1]


def absent(monkeypatch, *names: str) -> None:
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def test_extras_match_pyproject():
    """The extras the code names are the ones pyproject.toml declares, and the core has none of them."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    optional = project["optional-dependencies"]

    def names(requirements: list[str]) -> set[str]:
        return {r.split("[")[0].split(">")[0].split("=")[0].split("<")[0].split(";")[0].strip().lower()
                .replace("-", "_") for r in requirements if not r.startswith("elmokit")}

    for extra, packages in EXTRAS.items():
        assert names(optional[extra]) == {package.replace(".", "_") for package in packages}, extra
    every = set().union(*EXTRAS.values())
    assert names(project["dependencies"]) == {"torch", "numpy", "h5py", "safetensors", "tqdm",  # embedding
                                              "requests", "urllib3", "filelock", "platformdirs"}  # models by name or URL
    assert set(optional["all"]) == {f"elmokit[{extra}]" for extra in EXTRAS}
    assert "elmokit[all]" in optional["test"] and "elmokit[docs]" in optional["test"]
    assert every.isdisjoint(names(project["dependencies"]))


@pytest.mark.parametrize("missing", ["sacremoses", "sentencex"])
def test_require_names_the_extra(monkeypatch, missing):
    require("prepare", "elmo prepare")  # installed here: nothing to say
    absent(monkeypatch, missing)
    with pytest.raises(MissingExtraError) as caught:
        require("prepare", "elmo prepare")
    assert str(caught.value) == "elmo prepare needs sacremoses and sentencex: pip install 'elmokit[prepare]'"
    assert isinstance(caught.value, ImportError) and caught.value.name == missing
    with pytest.raises(ValueError, match="matplotlib"):
        require("prepare", "x", ("matplotlib",))


def test_prepare_without_the_prepare_extra(monkeypatch, tmp_path, capsys):
    (tmp_path / "raw.txt").write_text("One sentence here. And a second one!\n", encoding="utf-8")
    (tmp_path / "ptb.txt").write_text("a b c\nd e\n", encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard-00000.txt").write_text("kept\n", encoding="utf-8")
    absent(monkeypatch, "sacremoses", "sentencex")
    assert main(["prepare", str(tmp_path / "raw.txt"), "-o", str(out), "--quiet", "--workers", "1",
                 "--overwrite"]) == 2
    assert capsys.readouterr().err.strip() == (
        "elmo prepare: error: elmo prepare needs sacremoses and sentencex: pip install 'elmokit[prepare]'")
    assert sorted(p.name for p in out.iterdir()) == ["shard-00000.txt"]  # old shards not removed
    # pre-tokenized text needs neither
    assert main(["prepare", str(tmp_path / "ptb.txt"), "-o", str(out), "--quiet", "--workers", "1",
                 "--overwrite", "--plain"]) == 0
    assert (out / "shard-00000.txt").read_text(encoding="utf-8") == "a b c\nd e\n"


def test_embed_tokenize_without_sacremoses(monkeypatch, model_dir, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("Hello, world.\n", encoding="utf-8")
    absent(monkeypatch, "sacremoses")
    assert main(["embed", str(tmp_path / "in.txt"), str(tmp_path / "out.hdf5"), "--model", str(model_dir),
                 "--tokenize"]) == 2
    assert "needs sacremoses: pip install 'elmokit[prepare]'" in capsys.readouterr().err
    assert not (tmp_path / "out.hdf5").exists()
    # without --tokenize, embedding needs no extra
    assert main(["embed", str(tmp_path / "in.txt"), str(tmp_path / "out.hdf5"), "--model", str(model_dir)]) == 0


def test_plots_without_matplotlib(monkeypatch, tmp_path):
    from elmokit.training.metrics import plot_curves
    from elmokit.inference.similar import plot_occurrences
    from elmokit.tasks.report import plot_layer_weights, plot_probes

    absent(monkeypatch, "matplotlib", "matplotlib.figure")
    (tmp_path / "metrics.jsonl").write_text('{"tokens": 1, "loss": 2.0}\n', encoding="utf-8")
    calls = [lambda path: plot_curves(tmp_path / "metrics.jsonl", path),
             lambda path: plot_occurrences(path, np.zeros((1, 2)), ["a"], np.zeros(2), "t"),
             lambda path: plot_layer_weights([[[0.5, 0.5]]], "t", path),
             lambda path: plot_probes({}, path)]
    for call in calls:
        with pytest.raises(MissingExtraError, match=r"needs matplotlib: pip install 'elmokit\[plot\]'$"):
            call(tmp_path / "x.png")
        assert not (tmp_path / "x.png").exists()


def test_similar_plot_without_matplotlib_stops_before_embedding(monkeypatch, model_dir, tmp_path, capsys):
    (tmp_path / "corpus.txt").write_text("they play football\n", encoding="utf-8")
    absent(monkeypatch, "matplotlib")
    import elmokit.commands.similar as command

    def never(*args, **kwargs):
        raise AssertionError("the corpus was embedded")

    monkeypatch.setattr(command, "find_similar", never)
    assert main(["similar", str(tmp_path / "corpus.txt"), "--query", "they play football", "--word", "play",
                 "--model", str(model_dir), "--plot", str(tmp_path / "p.png")]) == 2
    assert capsys.readouterr().err.strip() == (
        "elmo similar: error: elmo similar --plot needs matplotlib: pip install 'elmokit[plot]'")


def test_training_goes_on_without_matplotlib(monkeypatch, tmp_path):
    rng = random.Random(0)
    words = "the cat sat on a mat dog ran to house big small".split()
    for name, n_lines in (("train.txt", 40), ("valid.txt", 8)):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 8))) for _ in range(n_lines)]
        (tmp_path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["vocab", str(tmp_path / "train.txt"), "-o", str(tmp_path / "vocab.txt")]) == 0
    ElmoConfig(CharCNNConfig(embedding_dim=4, filters=((1, 4), (2, 4)), n_highway=1),
               LSTMConfig(cell_dim=8, projection_dim=4, n_layers=1)).save(tmp_path / "model.json")
    config = {"train_files": [str(tmp_path / "train.txt")], "valid_files": [str(tmp_path / "valid.txt")],
              "vocab": str(tmp_path / "vocab.txt"), "model": str(tmp_path / "model.json"), "batch_size": 4,
              "unroll_steps": 5, "epochs": 1, "threads": 1, "progress": False, "device": "cpu"}
    (tmp_path / "train.json").write_text(json.dumps(config), encoding="utf-8")
    absent(monkeypatch, "matplotlib")
    run = tmp_path / "run"
    with pytest.warns(UserWarning, match=r"curves.png of elmo train needs matplotlib: "
                                         r"pip install 'elmokit\[plot\]'; training goes on without it"):
        assert main(["train", "--config", str(tmp_path / "train.json"), "--output-dir", str(run)]) == 0
    assert (run / "checkpoint.pt").is_file() and (run / "best" / "model.safetensors").is_file()
    assert not (run / "curves.png").exists()
