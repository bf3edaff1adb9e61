"""Issue 54, audit round 5: no output is, holds or sits inside an input (refused before anything is
read, by every command, with one message: `elmokit.io.refuse_output_over_input`); a symbolic link
as a replaced output folder is refused before the run; `--max-output-gb inf` is no limit; -q hides
the stale-lock note; `--lang` must be a language sacremoses knows; bfloat16 on a CPU without native
bfloat16 products warns; leftovers of killed writes of the same output are removed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elmokit.cli import main
from elmokit import io
from elmokit.io import atomic_write_text
from tests.conftest import one_error_line

SENTENCES = "the cat sat\na dog ran home\n"


def _text(path: Path, text: str = SENTENCES) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# 1. No output may be, hold or sit inside an input
# ---------------------------------------------------------------------------------------------
def test_the_rule_itself_same_file_link_holder_and_inside(tmp_path):
    corpus = _text(tmp_path / "data" / "in.txt")
    link = tmp_path / "link.txt"
    link.symlink_to(corpus)
    for output, said in [(corpus, "is the input"), (link, "is the input"), (tmp_path / "data", "holds the input"),
                         (tmp_path, "holds the input")]:
        with pytest.raises(ValueError, match=said):
            io.refuse_output_over_input([corpus], [output])
    model = tmp_path / "m"
    model.mkdir()
    with pytest.raises(ValueError, match="is inside the input folder"):
        io.refuse_output_over_input([model], [model / "model.onnx"])
    io.refuse_output_over_input([corpus], [tmp_path / "data" / "out.h5", tmp_path / "data2"])  # beside it: fine


def test_embed_into_its_own_input_is_refused(model_dir, tmp_path, capsys):
    corpus = _text(tmp_path / "in.txt")
    assert main(["embed", str(corpus), str(corpus), "--overwrite", "--model", str(model_dir)]) == 2
    one_error_line(capsys, str(corpus), "is the input")
    assert corpus.read_text(encoding="utf-8") == SENTENCES


def test_embed_through_a_link_to_its_input_is_refused(model_dir, tmp_path, capsys):
    corpus = _text(tmp_path / "in.txt")
    (tmp_path / "out.h5").symlink_to(corpus)
    assert main(["embed", str(corpus), str(tmp_path / "out.h5"), "--overwrite", "--model", str(model_dir)]) == 2
    one_error_line(capsys, "is the input")
    assert corpus.read_text(encoding="utf-8") == SENTENCES


def test_embed_on_ray_into_the_folder_of_its_input_is_refused_before_ray(model_dir, tmp_path, capsys, monkeypatch):
    import elmokit.ray

    def reached(*args, **kwargs):
        raise AssertionError("Ray was reached: the folder holding the input would have been replaced")

    monkeypatch.setattr(elmokit.ray, "embed_files", reached)
    folder = tmp_path / "in_dir"
    part = _text(folder / "part.txt")
    assert main(["embed", "--ray", "local", str(part), str(folder), "--overwrite", "--model", str(model_dir)]) == 2
    one_error_line(capsys, str(folder), "holds the input")
    assert part.read_text(encoding="utf-8") == SENTENCES


def test_vocab_onto_its_input_is_refused(tmp_path, capsys):
    corpus = _text(tmp_path / "in.txt")
    assert main(["vocab", str(corpus), "-o", str(corpus), "--overwrite"]) == 2
    one_error_line(capsys, "is the input")
    assert corpus.read_text(encoding="utf-8") == SENTENCES


def test_similar_plot_onto_its_corpus_is_refused(model_dir, tmp_path, capsys):
    corpus = _text(tmp_path / "corpus.txt")
    assert main(["similar", str(corpus), "--query", "the cat sat", "--word", "cat", "--plot", str(corpus),
                 "--overwrite", "--model", str(model_dir)]) == 2
    one_error_line(capsys, "is the input")
    assert corpus.read_text(encoding="utf-8") == SENTENCES


def test_convert_into_the_model_folder_is_refused(model_dir, capsys):
    weights = model_dir / "model.safetensors"
    before = weights.read_bytes()
    assert main(["convert", "--model", str(model_dir), "--to-onnx", str(weights), "--overwrite"]) == 2
    one_error_line(capsys, "is the input", str(weights))  # a model folder is its files
    assert weights.read_bytes() == before


def test_export_into_the_run_it_reads_is_refused(model_dir, capsys):
    """The run folder (here a model folder: refused before it is read) is an input of elmo export."""
    config = (model_dir / "config.json").read_text()
    assert main(["export", str(model_dir), "--native", str(model_dir), "--overwrite"]) == 2
    one_error_line(capsys, "is inside the input folder")
    assert (model_dir / "config.json").read_text() == config


# ---------------------------------------------------------------------------------------------
# 2. A symbolic link as the output folder: refused before any work
# ---------------------------------------------------------------------------------------------
def test_a_linked_output_folder_is_refused_before_the_run(model_dir, tmp_path, capsys, monkeypatch):
    import elmokit.ray

    def connect(*args, **kwargs):
        raise AssertionError("the run started: the link is said only once every file is written")

    monkeypatch.setattr(elmokit.ray, "connect", connect)
    corpus = _text(tmp_path / "in.txt")
    target = tmp_path / "vectors"
    target.mkdir()
    (target / "old.parquet").write_bytes(b"old")
    (tmp_path / "out").symlink_to(target)
    assert main(["embed", "--ray", "local", str(corpus), str(tmp_path / "out"), "--overwrite",
                 "--model", str(model_dir)]) == 2
    one_error_line(capsys, str(tmp_path / "out"), "symbolic link", str(target))
    assert (target / "old.parquet").read_bytes() == b"old"


# ---------------------------------------------------------------------------------------------
# 3. --max-output-gb inf: no limit
# ---------------------------------------------------------------------------------------------
def test_max_output_gb_inf_is_no_limit(model_dir, tmp_path, capsys):
    corpus = _text(tmp_path / "in.txt")
    out = tmp_path / "out.npz"
    assert main(["embed", str(corpus), str(out), "--max-output-gb", "inf", "--model", str(model_dir),
                 "--no-progress"]) == 0
    assert out.is_file()
    capsys.readouterr()
    assert main(["embed", str(corpus), str(tmp_path / "o2.npz"), "--max-output-gb", "nan",
                 "--model", str(model_dir)]) == 2
    one_error_line(capsys, "--max-output-gb", "inf: no limit")


# ---------------------------------------------------------------------------------------------
# 4. -q: no stale-lock note
# ---------------------------------------------------------------------------------------------
def _stale_lock(output: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {"pid": int(dead.stdout), "host": "here", "started": "2020-01-01 00:00:00", "command": "elmo embed"}
    output.with_name(output.name + ".lock").write_text(json.dumps(record))


def test_quiet_hides_the_stale_lock_note(model_dir, tmp_path, capsys):
    corpus = _text(tmp_path / "in.txt")
    out = tmp_path / "out.npz"
    _stale_lock(out)
    assert main(["-q", "embed", str(corpus), str(out), "--model", str(model_dir)]) == 0
    assert capsys.readouterr().err == ""
    _stale_lock(out)
    assert main(["embed", str(corpus), str(out), "--overwrite", "--model", str(model_dir), "--no-progress"]) == 0
    assert "stale lock" in capsys.readouterr().err  # said without -q


# ---------------------------------------------------------------------------------------------
# 5. --lang: a language sacremoses knows
# ---------------------------------------------------------------------------------------------
def test_an_unknown_lang_is_refused_naming_the_known_ones(model_dir, tmp_path, capsys):
    corpus = _text(tmp_path / "in.txt")
    assert main(["embed", str(corpus), str(tmp_path / "o.npz"), "--tokenize", "--lang", "xx",
                 "--model", str(model_dir)]) == 2
    one_error_line(capsys, "--lang", "'xx'", "de", "fr")
    assert not (tmp_path / "o.npz").exists()
    assert main(["prepare", str(corpus), "-o", str(tmp_path / "shards"), "--lang", "xx", "--raw"]) == 2
    one_error_line(capsys, "--lang", "'xx'")
    assert not (tmp_path / "shards").exists()


def test_known_langs_still_tokenize(model_dir, tmp_path):
    from elmokit.tokenizer import tokenize

    assert tokenize("l'homme", lang="fr") == ["l'", "homme"]
    assert tokenize("It's", lang="en") == ["It", "'s"]
    corpus = _text(tmp_path / "in.txt", "Der Hund lief.\n")
    assert main(["embed", str(corpus), str(tmp_path / "o.npz"), "--tokenize", "--lang", "de",
                 "--model", str(model_dir), "--no-progress"]) == 0


# ---------------------------------------------------------------------------------------------
# 6. bfloat16 on a CPU without native bfloat16 products: one warning line
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("native", [False, True])
def test_bfloat16_without_native_products_warns(model_dir, tmp_path, capsys, monkeypatch, native):
    import elmokit.kernels

    monkeypatch.setattr(elmokit.kernels, "bf16_native", lambda: native)
    corpus = _text(tmp_path / "in.txt")
    assert main(["embed", str(corpus), str(tmp_path / "o.npz"), "--dtype", "bfloat16", "--device", "cpu",
                 "--model", str(model_dir), "--no-progress"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "slower than float32" in line]
    assert len(warned) == (0 if native else 1), warned
    assert native or "--dtype float32" in warned[0]


# ---------------------------------------------------------------------------------------------
# 7. The temporary files of killed writes are removed by the next write of the same output
# ---------------------------------------------------------------------------------------------
def _dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def test_a_later_convert_removes_the_leftovers_of_its_own_output(model_dir, tmp_path):
    out = tmp_path / "original"
    out.mkdir()
    options, weights = out / "options.json", out / "weights.hdf5"
    killed = out / f".weights.hdf5.{_dead_pid()}_abcd1234.tmp"  # a convert killed while writing
    living = out / f".weights.hdf5.{os.getpid()}_abcd1234.tmp"  # a write in progress, this process's
    old = out / ".weights.hdf5.x1y2z3w4.tmp"  # an older elmokit's name, no pid: by age
    young = out / ".weights.hdf5.q1y2z3w4.tmp"
    other = out / f".options.json.{_dead_pid()}_abcd1234.tmp"  # another output's: left to its own write
    for path in (killed, living, old, young, other):
        path.write_bytes(b"half")
    day_ago = time.time() - 2 * 86400
    os.utime(old, (day_ago, day_ago))
    assert main(["convert", "--model", str(model_dir), "--to-original", str(options), str(weights)]) == 0
    assert weights.is_file() and not killed.exists() and not old.exists()
    assert living.exists() and young.exists()
    assert not other.exists()  # options.json was written too: its own leftover went then


def test_atomic_write_names_its_temporary_file_with_its_pid(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (seen.append(Path(src).name), real_replace(src, dst)))
    atomic_write_text(tmp_path / "a.txt", "x")
    assert seen and seen[0].startswith(f".a.txt.{os.getpid()}_") and seen[0].endswith(".tmp"), seen


def test_prepare_over_its_own_shards_is_refused(tmp_path, capsys):
    shards = tmp_path / "shards"
    shard = _text(shards / "shard-00000.txt")
    assert main(["prepare", str(shard), "-o", str(shards), "--overwrite", "--plain", "--pretokenized"]) == 2
    one_error_line(capsys, "is the input")
    assert shard.read_text(encoding="utf-8") == SENTENCES


def test_perplexity_and_predict_onto_an_input_are_refused(tmp_path, capsys):
    corpus = _text(tmp_path / "in.txt")
    assert main(["perplexity", str(corpus), "--per-sentence", str(corpus), "--overwrite"]) == 2
    one_error_line(capsys, "is the input")
    run = tmp_path / "run"
    run.mkdir()
    assert main(["task", "predict", str(run), str(corpus), "-o", str(run / "labels.txt")]) == 2
    one_error_line(capsys, "is inside the input folder")
    assert corpus.read_text(encoding="utf-8") == SENTENCES


def test_the_ray_library_call_refuses_an_output_over_its_input(tmp_path, model_dir):
    """elmokit.ray.embed_files itself (not only elmo embed) refuses, before Ray starts, an output
    folder that holds its input, and leaves the input as it was."""
    pytest.importorskip("ray", reason="the ray extra: pip install 'elmokit[ray]'")
    from elmokit.ray import embed_files

    folder = tmp_path / "corpus"
    folder.mkdir()
    source = _text(folder / "part.txt")
    before = source.read_bytes()
    with pytest.raises(ValueError, match="holds the input"):
        embed_files([source], folder, model=str(model_dir), overwrite=True, progress=False)
    assert source.read_bytes() == before
