"""Bad input of every kind gives one clear line on stderr and a non-zero exit, never a
traceback, and leaves no half-made output behind (issue 17, point 9)."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elmokit.cli import main
from tests.conftest import REPO, tiny_config

WORDS = "the cat sat on a mat dog ran to house big small".split()


def fails_in_one_line(argv: list[str], capsys, *expected: str, status: int = 2) -> str:
    """Run `elmo argv` in-process: exit `status` (2: the request is wrong; 1: the machine failed
    it) and one error line on stderr, its last line (what a command reported before, e.g. the data
    it read, may come above), naming all of `expected`."""
    capsys.readouterr()
    assert main(argv) == status
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "\r" not in line]  # no progress bars
    errors = [line for line in lines if line.startswith("elmo") and ": error: " in line]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert "Traceback" not in err
    for text in expected:
        assert text in errors[0], (text, errors[0])
    return errors[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("errors")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))) for _ in range(40)]
    (root / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    good = gzip.compress(("\n".join(lines) + "\n").encode())
    (root / "truncated.gz").write_bytes(good[: len(good) // 2])
    (root / "fake.gz").write_text("the cat sat\n", encoding="utf-8")  # plain text named .gz
    (root / "corrupt.gz").write_bytes(good[:12] + bytes(20) + good[32:])
    assert main(["vocab", str(root / "train.txt"), "-o", str(root / "vocab.txt")]) == 0
    (root / "other_vocab.txt").write_text("<S>\n</S>\n<UNK>\nzebra\n", encoding="utf-8")
    tiny_config().save(root / "model.json")
    base = {"train_files": [str(root / "train.txt")], "vocab": str(root / "vocab.txt"),
            "model": str(root / "model.json"), "batch_size": 2, "unroll_steps": 4, "epochs": 1,
            "log_every": 1, "checkpoint_every": 5, "n_samples": 4, "threads": 1, "progress": False,
            "device": "cpu"}
    (root / "train.json").write_text(json.dumps(base), encoding="utf-8")
    torch.manual_seed(0)
    from elmokit import BiLM, save_pretrained

    save_pretrained(BiLM(tiny_config()).eval(), root / "model")
    return {"root": root, "base": base, "model": root / "model", "train": root / "train.txt",
            "vocab": root / "vocab.txt", "train_json": root / "train.json"}


@pytest.fixture(scope="module")
def trained_run(files) -> Path:
    run = files["root"] / "run"
    assert main(["train", "--config", str(files["train_json"]), "--output-dir", str(run)]) == 0
    return run


# ---------------------------------------------------------------------------------------------
# Input files: truncated or fake gzip, pipes and devices
# ---------------------------------------------------------------------------------------------
GZ_COMMANDS = {
    "embed": lambda f, src, out: ["embed", str(src), str(out / "o.h5"), "--model", str(f["model"]), "--quiet"],
    "vocab": lambda f, src, out: ["vocab", str(src), "-o", str(out / "vocab.txt")],
    "prepare": lambda f, src, out: ["prepare", str(src), "-o", str(out / "shards"), "--workers", "1", "--quiet"],
    "similar": lambda f, src, out: ["similar", str(src), "--query", "the cat", "--word", "cat",
                                    "--model", str(f["model"])],
    "train": lambda f, src, out: ["train", "--config", str(f["train_json"]), "--train", str(src),
                                  "--output-dir", str(out / "run")],
}


@pytest.mark.parametrize("name", ["truncated.gz", "fake.gz", "corrupt.gz"])
@pytest.mark.parametrize("command", sorted(GZ_COMMANDS))
def test_a_bad_gzip_input_is_one_line_naming_the_file(files, tmp_path, capsys, command, name):
    source = files["root"] / name
    fails_in_one_line(GZ_COMMANDS[command](files, source, tmp_path), capsys, str(source), "gzip")
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a run directory


def test_perplexity_of_a_bad_gzip_file(files, trained_run, capsys):
    source = files["root"] / "truncated.gz"
    fails_in_one_line(["perplexity", str(trained_run), str(source)], capsys, str(source), "truncated")


@pytest.mark.parametrize("command", ["embed", "vocab", "train"])
def test_a_pipe_as_input_is_refused_with_the_reason(files, tmp_path, capsys, command):
    read_end, write_end = os.pipe()
    os.write(write_end, b"the cat sat\n")
    os.close(write_end)
    try:
        pipe = Path(f"/dev/fd/{read_end}")
        fails_in_one_line(GZ_COMMANDS[command](files, pipe, tmp_path), capsys, str(pipe), "not a regular file",
                          "save it to a file first")
    finally:
        os.close(read_end)
    assert list(tmp_path.iterdir()) == []


def test_dev_stdin_from_a_pipe_is_refused_in_a_real_process(files, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "elmokit", "embed", "/dev/stdin", str(tmp_path / "o.h5"),
                             "--model", str(files["model"])], input="the cat\n", capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "/dev/stdin is not a regular file" in result.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Files of the wrong structure: options.json, config.json, HDF5
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("edit, expected", [
    (lambda o: o["char_cnn"].update(filters="abc"), "char_cnn.filters"),
    (lambda o: o["char_cnn"].update(filters=[1, 2]), "char_cnn.filters"),
    (lambda o: o["char_cnn"].update(filters=[[1, 2, 3]]), "char_cnn.filters"),
    (lambda o: o["char_cnn"].update(filters={"1": 32}), "char_cnn.filters"),
    (lambda o: o["char_cnn"].update(filters=[[1, "32"]]), "char_cnn.filters"),
    (lambda o: o.update(char_cnn=[1, 2]), "char_cnn"),
    (lambda o: o["char_cnn"].update(embedding=16), "char_cnn.embedding"),
    (lambda o: o.update(lstm="big"), "lstm"),
], ids=["string", "flat", "triple", "object", "string-count", "list-section", "int-section", "string-section"])
def test_malformed_options_name_the_file_and_key(files, tmp_path, capsys, edit, expected):
    from elmokit.model.weights import save_original
    from elmokit import load_pretrained

    save_original(load_pretrained(files["model"]), tmp_path / "options.json", tmp_path / "weights.hdf5")
    options = json.loads((tmp_path / "options.json").read_text())
    edit(options)
    (tmp_path / "options.json").write_text(json.dumps(options))
    fails_in_one_line(["info", "--options-file", str(tmp_path / "options.json"), "--weight-file",
                       str(tmp_path / "weights.hdf5")], capsys, str(tmp_path / "options.json"), expected)


def test_a_compound_hdf5_dataset_is_named(files, tmp_path, capsys):
    import h5py
    import numpy as np

    from elmokit import load_pretrained
    from elmokit.model.weights import save_original

    save_original(load_pretrained(files["model"]), tmp_path / "options.json", tmp_path / "weights.hdf5")
    with h5py.File(tmp_path / "weights.hdf5", "a") as file:
        shape = file["CNN_proj/b_proj"].shape
        del file["CNN_proj/b_proj"]
        file.create_dataset("CNN_proj/b_proj", shape=shape, dtype=np.dtype([("w", "<f4"), ("n", "<i4")]))
    fails_in_one_line(["convert", "--options-file", str(tmp_path / "options.json"), "--weight-file",
                       str(tmp_path / "weights.hdf5"), "--to-native", str(tmp_path / "native")], capsys,
                      "weights.hdf5", "'CNN_proj/b_proj'", "expected floating point")
    assert not (tmp_path / "native").exists()


# ---------------------------------------------------------------------------------------------
# elmo train: values of the wrong type, devices, the vocabulary of a resumed run
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, value, expected", [
    ("batch_size", "8", 'batch_size must be an integer, got "8"'),
    ("lr", None, "lr must be a finite number, got null"),
    ("lr", "0.1", 'lr must be a finite number, got "0.1"'),
    ("batch_size", -4, "batch_size must be > 0, got -4"),
    ("batch_size", 0, "batch_size must be > 0, got 0"),
    ("unroll_steps", 0, "unroll_steps must be > 0"),
    ("eval_batch_size", -1, "eval_batch_size must be > 0"),
    ("n_samples", -5, "n_samples must be >= 0"),
    ("epochs", 1.5, "epochs must be an integer, got 1.5"),
    ("epochs", True, "epochs must be an integer, got true"),
    ("epochs", 0, "epochs must be > 0"),
    ("dropout", 1.5, "dropout must be in [0, 1)"),
    ("progress", "no", 'progress must be true or false, got "no"'),
    ("train_files", "train.txt", 'train_files must be a list of strings, got "train.txt"'),
    ("valid_files", [1, 2], "valid_files must be a list of strings, got [1, 2]"),
    ("model", 3, "model must be a string, got 3"),
    ("device", "tpu", "got 'tpu'"),
    ("device", "cuda:x", "device must be cpu, cuda, cuda:N or auto"),
    ("device", "meta", "got 'meta'"),
])
def test_training_config_values_of_the_wrong_type(files, tmp_path, capsys, key, value, expected):
    config = {**files["base"], key: value, "output_dir": str(tmp_path / "run")}
    (tmp_path / "train.json").write_text(json.dumps(config))
    fails_in_one_line(["train", "--config", str(tmp_path / "train.json")], capsys, str(tmp_path / "train.json"),
                      expected)
    assert not (tmp_path / "run").exists()


def test_a_training_config_that_is_not_an_object(files, tmp_path, capsys):
    (tmp_path / "train.json").write_text("[1, 2]")
    fails_in_one_line(["train", "--config", str(tmp_path / "train.json")], capsys, "train.json", "JSON object")


def test_an_unknown_device_on_the_command_line_is_not_blamed_on_the_file(files, tmp_path, capsys):
    line = fails_in_one_line(["train", "--config", str(files["train_json"]), "--output-dir", str(tmp_path / "run"),
                              "--device", "bogus"], capsys, "device must be cpu, cuda, cuda:N or auto", "got 'bogus'")
    assert str(files["train_json"]) not in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("device, expected", [("meta", "got 'meta'"), ("tpu", "got 'tpu'"), ("cuda:x", "got 'cuda:x'"),
                                              ("cuda:99", "cuda:99 asked for")])
@pytest.mark.parametrize("command", ["train", "perplexity", "embed", "similar"])
def test_an_unknown_or_absent_device_on_every_command(files, trained_run, tmp_path, capsys, command, device, expected):
    argv = {"train": ["train", "--config", str(files["train_json"]), "--output-dir", str(tmp_path / "run")],
            "perplexity": ["perplexity", str(trained_run), str(files["train"])],
            "embed": ["embed", str(files["train"]), str(tmp_path / "out.h5"), "--model", str(files["model"])],
            "similar": ["similar", str(files["train"]), "--query", "the cat", "--word", "cat", "--model",
                        str(files["model"])]}[command]
    fails_in_one_line(argv + ["--device", device], capsys, expected)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("vocab", ["other_vocab.txt", "shuffled"])
def test_resume_with_another_vocabulary_is_refused_and_the_run_kept(files, trained_run, tmp_path, capsys, vocab):
    if vocab == "shuffled":  # the same size, other tokens: only the digest tells
        tokens = files["vocab"].read_text().splitlines()
        (tmp_path / "vocab.txt").write_text("\n".join(tokens[:3] + tokens[3:][::-1]) + "\n")
        path = tmp_path / "vocab.txt"
    else:
        path = files["root"] / vocab
    before = {p.name: p.stat().st_mtime_ns for p in trained_run.iterdir()}
    fails_in_one_line(["train", "--resume", "--output-dir", str(trained_run), "--vocab", str(path), "--epochs", "2"],
                      capsys, "--resume", str(path), "trained with the vocabulary")
    assert {p.name: p.stat().st_mtime_ns for p in trained_run.iterdir()} == before


# ---------------------------------------------------------------------------------------------
# elmo similar, elmo task train
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_length", ["0", "-3", "2", "64"])
def test_similar_max_length_too_short_for_its_windows(files, tmp_path, capsys, max_length):
    long_line = " ".join(random.Random(1).choice(WORDS) for _ in range(150)) + " cat"
    (tmp_path / "corpus.txt").write_text(long_line + "\n")
    fails_in_one_line(["similar", str(tmp_path / "corpus.txt"), "--query", "the cat", "--word", "cat",
                       "--max-length", max_length, "--model", str(files["model"])], capsys,
                      f"--max-length must be more than 64", f"got {max_length}")


def test_similar_windows_a_sentence_longer_than_max_length(files, tmp_path, capsys):
    long_line = " ".join(random.Random(1).choice(WORDS) for _ in range(150)) + " cat"
    (tmp_path / "corpus.txt").write_text(long_line + "\n")
    assert main(["similar", str(tmp_path / "corpus.txt"), "--query", "the cat", "--word", "cat",
                 "--max-length", "65", "--model", str(files["model"])]) == 0


@pytest.mark.parametrize("extra, expected", [
    (["--max-train-sentences", "0"], "--max-train-sentences must be >= 1, got 0"),
    (["--max-eval-sentences", "-2"], "--max-eval-sentences must be >= 1, got -2"),
    (["--lr", "-0.1"], "--lr must be a number > 0, got -0.1"),
    (["--lr", "nan"], "--lr must be a number > 0, got nan"),
    (["--bilm-lr", "0"], "--bilm-lr must be a number > 0, got 0.0"),
    (["--dropout", "1"], "--dropout must be in [0, 1), got 1.0"),
    (["--elmo-l2", "-1"], "--elmo-l2 must be a number >= 0"),
])
def test_task_train_values_out_of_range(files, tmp_path, capsys, extra, expected):
    tagged = _tagged_file(tmp_path)
    fails_in_one_line(["task", "train", "--task", "pos", "--model", "none", "--train", str(tagged), "--dev",
                       str(tagged), "--out", str(tmp_path / "run"), "--no-progress", *extra], capsys, expected)
    assert not (tmp_path / "run").exists()


def test_task_train_out_is_a_file(files, tmp_path, capsys):
    tagged = _tagged_file(tmp_path)
    (tmp_path / "run").write_text("a file")
    fails_in_one_line(["task", "train", "--task", "pos", "--model", "none", "--train", str(tagged), "--dev",
                       str(tagged), "--out", str(tmp_path / "run"), "--no-progress"], capsys,
                      f"--out {tmp_path / 'run'} is a file")
    assert (tmp_path / "run").read_text() == "a file"


@pytest.mark.parametrize("damage", ["truncated", "missing-dev"])
def test_a_task_run_that_fails_leaves_no_run_directory(files, tmp_path, capsys, damage):
    tagged = _tagged_file(tmp_path)
    train, dev = tagged, tmp_path / "no-dev.txt"
    if damage == "truncated":
        packed = gzip.compress(tagged.read_bytes())
        (tmp_path / "dev.txt.gz").write_bytes(packed[: len(packed) // 2])
        dev = tmp_path / "dev.txt.gz"
    fails_in_one_line(["task", "train", "--task", "pos", "--model", "none", "--train", str(train), "--dev", str(dev),
                       "--out", str(tmp_path / "run"), "--no-progress", "--max-epochs", "1"], capsys, str(dev))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("damage, expected", [
    ({"task_config.json": "[1, 2]"}, "not a task run's config"),
    ({"task_config.json": "{}"}, "not a task run's config"),
    ({"task_config.json": '{"config": [1], "vocab": [], "labels": []}'}, "not a task run's config"),
    ({"task_config.json": '{"config": {"colour": 1}, "vocab": [], "labels": []}'}, "not a task run's config"),
    ({"task_config.json": "\udcff"}, "not valid JSON"),
    ({"task_model.safetensors": "junk"}, "not a readable safetensors file"),
])
def test_a_damaged_task_run_is_named(files, tmp_path, capsys, damage, expected):
    tagged = _tagged_file(tmp_path)
    run = tmp_path / "run"
    assert main(["task", "train", "--task", "pos", "--model", "none", "--train", str(tagged), "--dev", str(tagged),
                 "--out", str(run), "--max-epochs", "1", "--no-progress"]) == 0
    for name, text in damage.items():
        (run / name).write_bytes(text.encode("utf-8", "surrogateescape"))
    fails_in_one_line(["task", "eval", str(run), str(tagged), "--no-progress"], capsys, str(run / name), expected)


def test_task_weights_that_do_not_match_their_config(files, tmp_path, capsys):
    from safetensors.torch import save_file

    tagged = _tagged_file(tmp_path)
    run = tmp_path / "run"
    assert main(["task", "train", "--task", "pos", "--model", "none", "--train", str(tagged), "--dev", str(tagged),
                 "--out", str(run), "--max-epochs", "1", "--no-progress"]) == 0
    save_file({"tag_scores.bias": torch.zeros(3)}, str(run / "task_model.safetensors"))
    fails_in_one_line(["task", "eval", str(run), str(tagged), "--no-progress"], capsys, "task_model.safetensors",
                      "does not match task_config.json")
    save_file({"tag_scores.bias": torch.zeros(3, dtype=torch.int32)}, str(run / "task_model.safetensors"))
    fails_in_one_line(["task", "eval", str(run), str(tagged), "--no-progress"], capsys,
                      "'tag_scores.bias' has dtype I32, expected floating point")


def _tagged_file(folder: Path) -> Path:
    lines = ["the DET", "cat NOUN", "sat VERB", "", "a DET", "dog NOUN", "ran VERB", ""]
    (folder / "tagged.txt").write_text("\n".join(lines * 3) + "\n", encoding="utf-8")
    return folder / "tagged.txt"


# ---------------------------------------------------------------------------------------------
# Outputs the format cannot hold, memory, messages of other libraries
# ---------------------------------------------------------------------------------------------
def test_a_sentence_too_long_for_an_npz_key(files, tmp_path, capsys):
    (tmp_path / "in.txt").write_text("a b\n" + " ".join(["wörd"] * 14_000) + "\n", encoding="utf-8")
    fails_in_one_line(["embed", str(tmp_path / "in.txt"), str(tmp_path / "out.npz"), "--use-sentence-keys",
                       "--model", str(files["model"]), "--quiet"], capsys, "in.txt:2", "too long to be a key of a .npz",
                      "--format hdf5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]
    assert main(["embed", str(tmp_path / "in.txt"), str(tmp_path / "out.h5"), "--use-sentence-keys",
                 "--model", str(files["model"]), "--quiet"]) == 0  # HDF5 names have no such limit


def test_a_batch_too_large_for_memory_is_one_line(files, trained_run, capsys):
    fails_in_one_line(["perplexity", str(trained_run), str(files["train"]), "--batch-size", "10000000000000"],
                      capsys, "out of memory", "--batch-size", status=1)


def test_a_multi_line_library_message_is_one_line(files, tmp_path, capsys):
    (tmp_path / "checkpoint.pt").write_bytes(b"0")  # torch.load's refusal spans several lines
    fails_in_one_line(["export", str(tmp_path / "checkpoint.pt"), "--native", str(tmp_path / "out")], capsys,
                      "not a readable elmokit checkpoint")


# ---------------------------------------------------------------------------------------------
# Elmo on empty batches: empty outputs of the right shape
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("keep_boundaries", [False, True])
@pytest.mark.parametrize("sentences, batch", [([], 0), ([[]], 1), ([[], []], 2)])
def test_elmo_on_empty_batches(files, sentences, batch, keep_boundaries):
    from elmokit import Elmo, ElmoEmbedder, batch_to_ids, load_pretrained

    bilm = load_pretrained(files["model"])
    elmo = Elmo(module=bilm, num_output_representations=2, dropout=0.0,
                keep_sentence_boundaries=keep_boundaries).eval()
    out = elmo(batch_to_ids(sentences))
    positions = 2 if keep_boundaries else 0
    assert [tuple(r.shape) for r in out["elmo_representations"]] == [(batch, positions, 12)] * 2
    assert out["mask"].shape == (batch, positions) and out["mask"].dtype == torch.bool
    assert int(out["mask"].sum()) == batch * positions
    assert all(r.dtype == torch.float32 for r in out["elmo_representations"])
    # as the embedder: nothing for no sentence, (L+1, 0, 2P) for an empty one
    assert [a.shape for a in ElmoEmbedder(module=bilm).embed_batch(sentences)] == [(3, 0, 12)] * batch


def test_elmo_on_empty_cached_word_inputs(files):
    from elmokit import Elmo, load_pretrained

    elmo = Elmo(module=load_pretrained(files["model"]), dropout=0.0, vocab_to_cache=["@@PADDING@@", "cat"]).eval()
    for word_ids, shape in ((torch.zeros(0, 0, dtype=torch.long), (0, 0)), (torch.zeros(1, 0, dtype=torch.long), (1, 0)),
                            (torch.zeros(2, 0, 4, dtype=torch.long), (2, 0, 4))):
        out = elmo(word_inputs=word_ids)
        assert out["elmo_representations"][0].shape == (*shape, 12) and out["mask"].shape == shape


def test_sigterm_stops_any_command_as_ctrl_c_does(monkeypatch, capsys):
    """SIGTERM (a batch scheduler, kill) is Ctrl-C for every command: exit 130, one line, and
    what Ctrl-C cleans up is cleaned up; the handler before the command is back after it."""
    import os
    import signal
    import time

    from elmokit.commands import info

    def terminated(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the signal arrives first
        return 0

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(info, "run", terminated)
    assert main(["info"]) == 130
    assert capsys.readouterr().err.strip() == "elmo info: interrupted: SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("lang", ["", "  "])
def test_embed_tokenize_with_an_empty_lang_is_one_error(files, tmp_path, capsys, lang):
    """Not a TypeError's traceback from the tokenizer once the first line is read."""
    (tmp_path / "in.txt").write_text("a b\n")
    fails_in_one_line(["embed", str(tmp_path / "in.txt"), str(tmp_path / "o.h5"), "--tokenize", "--lang", lang,
                       "--model", str(files["model"])], capsys, f"--lang {lang!r} is not a language Moses knows")
