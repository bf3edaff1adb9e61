"""The hostile audit's defects in task models, training options and run files (issue 32): each
case is the audit's reproduction, made small, through the command line."""

from __future__ import annotations

import json

import pytest

from elmokit.cli import main
from tests.conftest import one_error_line

TINY = ["--max-epochs", "1", "--min-word-count", "1", "--word-dim", "8", "--hidden-dim", "12", "--no-progress"]


@pytest.fixture(scope="module")
def pos_run(tmp_path_factory):
    """A tiny POS run without ELMo, trained once for the module (tests copy it before editing it)."""
    folder = tmp_path_factory.mktemp("posrun")
    data = folder / "train.txt"
    data.write_text("I PRON\nlike VERB\ncats NOUN\n\nYou PRON\nhate VERB\ndogs NOUN\n\n", encoding="utf-8")
    run = folder / "run"
    assert main(["task", "train", "--task", "pos", "--train", str(data), "--dev", str(data), "--out", str(run),
                 "--model", "none", *TINY]) == 0
    return run


def predict(capsys, run, path, *args) -> str:
    capsys.readouterr()
    assert main(["task", "predict", str(run), str(path), "--no-progress", *args]) == 0
    return capsys.readouterr().out


# 6: lines of text with the same number of words are text, not a column file
def test_predict_reads_equal_word_counts_as_text(pos_run, tmp_path, capsys):
    text = tmp_path / "s.txt"
    text.write_text("I like cats\nYou hate dogs\n", encoding="utf-8")
    blocks = predict(capsys, pos_run, text).strip("\n").split("\n\n")
    assert [[line.split("\t")[0] for line in block.splitlines()] for block in blocks] == [
        ["I", "like", "cats"], ["You", "hate", "dogs"]]
    # a one-sentence column file whose last column holds the run's labels stays a column file
    columns = tmp_path / "c.txt"
    columns.write_text("I PRON\nlike VERB\n", encoding="utf-8")
    assert [line.split("\t")[0] for line in predict(capsys, pos_run, columns).split()[::2]] == ["I", "like"]


# 7: one process at a time writes a run, and a run being written is not read
def test_task_train_and_predict_refuse_a_run_being_written(pos_run, tmp_path, capsys):
    from elmokit.io import output_lock

    text = tmp_path / "s.txt"
    text.write_text("I like cats\n", encoding="utf-8")
    data = pos_run.parent / "train.txt"
    with output_lock(pos_run / "task.lock", "a test holding the run"):
        capsys.readouterr()
        assert main(["task", "train", "--task", "pos", "--train", str(data), "--dev", str(data), "--out", str(pos_run),
                     "--model", "none", "--overwrite", *TINY]) != 0
        one_error_line(capsys, "being written by another process", "task.lock")
        assert main(["task", "predict", str(pos_run), str(text), "--no-progress"]) != 0
        one_error_line(capsys, "being written by another process", "task.lock")
    assert (pos_run / "task_model.safetensors").is_file()  # the run the lock kept safe
    assert not (pos_run / "task.lock").exists()
    predict(capsys, pos_run, text)


# 8: a label with a tab or a line break would break the lines predict writes: refused in training
@pytest.mark.parametrize("label", ["X\tY", "X\nY", "X\u2028Y"])
def test_train_refuses_labels_with_tabs_or_line_breaks(tmp_path, capsys, label):
    data = tmp_path / "train.jsonl"
    lines = [{"tokens": ["I", "like", "cats"], "labels": ["PRON", "VERB", "NOUN"]},
             {"tokens": ["You", "hate", "dogs"], "labels": ["PRON", label, "NOUN"]}]
    data.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    capsys.readouterr()
    assert main(["task", "train", "--task", "pos", "--train", str(data), "--dev", str(data), "--out",
                 str(tmp_path / "run"), "--model", "none", *TINY]) != 0
    one_error_line(capsys, f"{data}:2:", "tab or a line break")
    assert not (tmp_path / "run").exists()


def edited_run(pos_run, tmp_path, edit) -> object:
    """A copy of the tiny run whose task_config.json `edit` changes (a dict in, the dict out)."""
    import shutil

    run = tmp_path / "edited"
    shutil.copytree(pos_run, run)
    path = run / "task_config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text(encoding="utf-8")))), encoding="utf-8")
    return run


# 3: an edited size is checked against task_model.safetensors before anything is allocated
def test_edited_sizes_are_checked_before_building(pos_run, tmp_path, capsys, monkeypatch):
    import torch

    from elmokit.tasks import run as run_module

    def bigger(saved):
        saved["config"]["hidden_dim"] = 300  # the audit's 30000 would allocate 23.5 GB were it built
        return saved

    builds = []
    real_build = run_module.build_task_model

    def spy(*args):
        builds.append(str(torch.get_default_device()))
        return real_build(*args)

    monkeypatch.setattr(run_module, "build_task_model", spy)
    text = tmp_path / "s.txt"
    text.write_text("I like cats\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["task", "predict", str(edited_run(pos_run, tmp_path, bigger)), str(text), "--no-progress"]) != 0
    one_error_line(capsys, "task_model.safetensors: does not match task_config.json", "[1200] in the config")
    assert builds == ["meta"]  # a skeleton, never the model itself


# 14: every hand-edited value of a run file is one error naming the file and the key
@pytest.mark.parametrize("edit, expected", [
    (lambda saved: saved | {"labels": [1, 2, 3]}, "labels must be a list"),
    (lambda saved: saved | {"vocab": []}, "vocab must be a list"),
    (lambda saved: saved | {"vocab": [[1], [2], *saved["vocab"][2:]]}, "vocab must be a list"),
    (lambda saved: saved | {"chars": [1]}, "chars must be a list"),
    (lambda saved: saved | {"labels": ["A\tB", *saved["labels"]]}, "labels must not hold a tab"),
    (lambda saved: saved | {"config": saved["config"] | {"hidden_dim": 16.5}}, "config.hidden_dim must be int"),
    (lambda saved: saved | {"config": saved["config"] | {"hidden_dim": True}}, "config.hidden_dim must be int"),
    (lambda saved: saved | {"config": saved["config"] | {"hidden_dim": 10 ** 40}}, "sizes no task model can have"),
    (lambda saved: saved | {"config": saved["config"] | {"seed": "x"}}, "config.seed must be int"),
    (lambda saved: saved | {"bilm": {"path": 5, "fingerprint": None}}, "bilm.path must be a string"),
])
def test_hand_edited_run_files_are_one_error(pos_run, tmp_path, capsys, edit, expected):
    text = tmp_path / "s.txt"
    text.write_text("I like cats\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["task", "predict", str(edited_run(pos_run, tmp_path, edit)), str(text), "--no-progress"]) != 0
    one_error_line(capsys, "task_config.json", expected)


def test_info_refuses_a_provenance_that_is_not_an_object(model_dir, capsys):
    (model_dir / "provenance.json").write_text("[1, 2]\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["info", str(model_dir)]) != 0
    one_error_line(capsys, "provenance.json: not a provenance record")


# 17: errors that say where (file:line) and what a path is (a directory, a pipe, a loop of links)
def test_task_data_that_is_not_utf8_is_named_with_its_line(pos_run, tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"I PRON\nl\xffike VERB\n\n")
    good = pos_run.parent / "train.txt"
    capsys.readouterr()
    assert main(["task", "train", "--task", "pos", "--train", str(bad), "--dev", str(good), "--out",
                 str(tmp_path / "run"), "--model", "none", *TINY]) != 0
    one_error_line(capsys, f"{bad}:2: invalid UTF-8 byte 0xff")
    text = tmp_path / "bad-text.txt"
    text.write_bytes(b"I like cats\nYou \xffhate dogs\n")
    assert main(["task", "predict", str(pos_run), str(text), "--no-progress"]) != 0
    one_error_line(capsys, f"{text}:2: invalid UTF-8 byte 0xff")


def test_task_paths_that_are_not_files_are_said_as_what_they_are(pos_run, tmp_path, capsys):
    import os

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    good = pos_run.parent / "train.txt"
    for name, expected in (("", "is a directory"), ("fifo", "not a regular file"), ("loop1", "loop of links")):
        capsys.readouterr()
        assert main(["task", "predict", str(pos_run), str(tmp_path / name), "--no-progress"]) != 0
        assert "not found" not in one_error_line(capsys, expected)
        assert main(["task", "train", "--task", "pos", "--train", str(tmp_path / name), "--dev", str(good), "--out",
                     str(tmp_path / "run"), "--model", "none", *TINY]) != 0
        assert "not found" not in one_error_line(capsys, expected)


def test_seeds_beyond_torch_are_refused_by_name(tmp_path, capsys):
    (tmp_path / "c.txt").write_text("hello world\n", encoding="utf-8")
    (tmp_path / "vocab.txt").write_text("<S>\n</S>\n<UNK>\nhello\nworld\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["train", "--train", str(tmp_path / "c.txt"), "--vocab", str(tmp_path / "vocab.txt"), "--output-dir",
                 str(tmp_path / "lm"), "--seed", "99999999999999999999"]) != 0
    one_error_line(capsys, "seed must be in [0, 2**32)")
    assert main(["task", "train", "--task", "pos", "--train", str(tmp_path / "c.txt"), "--dev",
                 str(tmp_path / "c.txt"), "--out", str(tmp_path / "run"), "--model", "none",
                 "--seed", "99999999999999999999", *TINY]) != 0
    one_error_line(capsys, "--seed must be in [0, 2**32)")


def test_model_files_that_cannot_be_read_are_one_error(model_dir, capsys):
    config = model_dir / "config.json"
    text = config.read_text(encoding="utf-8")
    config.write_text(text.replace("12", "1" * 5000, 1), encoding="utf-8")  # an integer past Python's digit limit
    capsys.readouterr()
    assert main(["info", str(model_dir)]) != 0
    one_error_line(capsys, "config.json: not valid JSON")
    config.write_text(text, encoding="utf-8")
    (model_dir / "provenance.json").write_text('{"a": \n', encoding="utf-8")
    assert main(["info", str(model_dir)]) != 0
    one_error_line(capsys, "provenance.json: not valid JSON")
    (model_dir / "provenance.json").write_text("{}\n", encoding="utf-8")
    (model_dir / "vocab.txt").write_bytes(b"<S>\n</S>\n\xff\xfe\n")
    assert main(["info", str(model_dir)]) != 0
    one_error_line(capsys, "vocab.txt:3: invalid UTF-8")


# 13: JSON nested deeper than Python's recursion limit is one error naming the file, wherever JSON is read
DEEP = "[" * 100000 + "]" * 100000


def test_deeply_nested_json_is_one_error_everywhere(pos_run, model_dir, tmp_path, capsys):
    import shutil

    (tmp_path / "deep.json").write_text(DEEP, encoding="utf-8")
    (tmp_path / "c.txt").write_text("hello world\n", encoding="utf-8")
    (tmp_path / "vocab.txt").write_text("<S>\n</S>\n<UNK>\nhello\nworld\n", encoding="utf-8")
    lm = ["train", "--train", str(tmp_path / "c.txt"), "--vocab", str(tmp_path / "vocab.txt"), "--output-dir",
          str(tmp_path / "lm")]
    capsys.readouterr()
    for option in ("--model", "--config"):
        assert main([*lm, option, str(tmp_path / "deep.json")]) != 0
        one_error_line(capsys, "deep.json", "nested")
    data = tmp_path / "deep.jsonl"
    data.write_text('{"tokens": ["I"], "labels": ["PRON"]}\n' + DEEP + "\n", encoding="utf-8")
    assert main(["task", "predict", str(pos_run), str(data), "--no-progress"]) != 0
    one_error_line(capsys, f"{data}:2:", "nested too deeply")
    assert main(["task", "train", "--task", "pos", "--train", str(data), "--dev", str(data), "--out",
                 str(tmp_path / "run"), "--model", "none", *TINY]) != 0
    one_error_line(capsys, f"{data}:2:", "nested too deeply")
    for name in ("task_config.json", "results.json"):
        run = tmp_path / f"run-{name}"
        shutil.copytree(pos_run, run)
        (run / name).write_text(DEEP, encoding="utf-8")
        assert main(["task", "predict", str(run), str(tmp_path / "c.txt"), "--no-progress"]) != 0
        one_error_line(capsys, f"{name}: JSON nested too deeply")
    (model_dir / "provenance.json").write_text(DEEP, encoding="utf-8")
    assert main(["info", str(model_dir)]) != 0
    one_error_line(capsys, "provenance.json: JSON nested too deeply")
    (model_dir / "config.json").write_text(DEEP, encoding="utf-8")
    assert main(["info", str(model_dir)]) != 0
    one_error_line(capsys, "config.json", "nested")


# 12: --threads bounded, refused before anything is made (no lock, no run directory)
@pytest.mark.parametrize("threads", ["20000", "100000"])
def test_threads_beyond_the_machine_are_refused(tmp_path, capsys, threads):
    (tmp_path / "c.txt").write_text("hello world\n", encoding="utf-8")
    (tmp_path / "vocab.txt").write_text("<S>\n</S>\n<UNK>\nhello\nworld\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["train", "--train", str(tmp_path / "c.txt"), "--vocab", str(tmp_path / "vocab.txt"), "--output-dir",
                 str(tmp_path / "lm"), "--threads", threads]) != 0
    one_error_line(capsys, "threads must be at most")
    assert not (tmp_path / "lm").exists()
    data = tmp_path / "train.txt"
    data.write_text("I PRON\nlike VERB\n\n", encoding="utf-8")
    assert main(["task", "train", "--task", "pos", "--train", str(data), "--dev", str(data), "--out",
                 str(tmp_path / "run"), "--model", "none", "--threads", threads, *TINY]) != 0
    one_error_line(capsys, "--threads must be at most")
    assert not (tmp_path / "run").exists()


# 20: options bounded where memory or time grows with them
@pytest.mark.parametrize("unroll, budget, expected", [("100000", "300", "unroll_steps must be at most 4096"),
                                                      ("400", "300", "must be at most max_tokens (300)")])
def test_train_window_is_bounded(tmp_path, capsys, unroll, budget, expected):
    (tmp_path / "c.txt").write_text("hello world\n", encoding="utf-8")
    (tmp_path / "vocab.txt").write_text("<S>\n</S>\n<UNK>\nhello\nworld\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["train", "--train", str(tmp_path / "c.txt"), "--vocab", str(tmp_path / "vocab.txt"), "--output-dir",
                 str(tmp_path / "lm"), "--unroll-steps", unroll, "--max-tokens", budget]) != 0
    one_error_line(capsys, expected)
    assert not (tmp_path / "lm").exists()


def test_similar_clusters_are_bounded(model_dir, tmp_path, capsys):
    (tmp_path / "c.txt").write_text("hello world\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["similar", str(tmp_path / "c.txt"), "--query", "hello world", "--word", "hello", "--model",
                 str(model_dir), "--clusters", "100000"]) != 0
    one_error_line(capsys, "--clusters must be at most 20")


# The second audit (2026-11-27)
def test_empty_labels_are_refused_with_their_line(tmp_path, capsys):
    """An empty label column (a line ending in a tab, an empty UPOS) is refused at training, naming
    the line, instead of training a run whose config cannot be loaded."""
    columns = tmp_path / "c.tsv"
    columns.write_text("I\tPRON\nlike\t\ncats\tNOUN\n\n", encoding="utf-8")
    conllu = tmp_path / "c.conllu"
    conllu.write_text("# sent_id = 1\n# text = I like\n1\tI\tI\t\t_\t_\t0\troot\t_\t_\n"
                      "2\tlike\tlike\tVERB\t_\t_\t1\tdep\t_\t_\n\n", encoding="utf-8")
    for data, line in ((columns, 2), (conllu, 3)):
        capsys.readouterr()
        assert main(["task", "train", "--task", "pos", "--train", str(data), "--dev", str(data),
                     "--out", str(tmp_path / f"run-{data.suffix}"), "--model", "none", *TINY]) != 0
        message = one_error_line(capsys, f"{data}:{line}")
        assert "label" in message
        assert not (tmp_path / f"run-{data.suffix}" / "task_config.json").exists()


def test_predict_reads_sentences_a_line_with_blank_lines_as_text(pos_run, tmp_path, capsys):
    text = tmp_path / "s.txt"
    text.write_text("I like cats and you hate dogs now\n\nYou hate dogs and we like cats\n", encoding="utf-8")
    blocks = predict(capsys, pos_run, text).strip("\n").split("\n\n")
    assert [[line.split("\t")[0] for line in block.splitlines()] for block in blocks] == [
        "I like cats and you hate dogs now".split(), "You hate dogs and we like cats".split()]
    # a space-separated file of 5 columns (CoNLL-2003's German layout), a blank line between sentences: columns
    columns = tmp_path / "c5.txt"
    columns.write_text("I i x y PRON\nlike l x y VERB\n\nYou y x y PRON\n", encoding="utf-8")
    assert [line.split(" ")[0] for line in predict(capsys, pos_run, columns).split("\n") if line] == ["I", "like", "You"]


def test_predict_writes_a_space_separated_column_file_with_spaces(pos_run, tmp_path, capsys):
    columns = tmp_path / "c.txt"
    columns.write_text("I PRON\nlike VERB\n\nYou PRON\nhate VERB\n", encoding="utf-8")
    lines = predict(capsys, pos_run, columns).strip("\n").split("\n")
    assert "\t" not in "".join(lines) and [line.split(" ")[0] for line in lines] == ["I", "like", "", "You", "hate"]
    assert all(len(line.split(" ")) == 2 and line.split(" ")[1] in ("PRON", "VERB", "NOUN") for line in lines if line)


def test_eval_max_sentences_below_one_is_refused_by_name(pos_run, capsys):
    for value in ("0", "-1"):
        capsys.readouterr()
        assert main(["task", "eval", str(pos_run), "--split", "dev", "--max-sentences", value, "--no-progress"]) != 0
        one_error_line(capsys, "--max-sentences", ">= 1")


def test_resume_with_given_files_ignores_the_data_folder(tmp_path, capsys, monkeypatch):
    """A run trained on --train/--dev files never reads the data folder: resuming it from elsewhere
    (another working directory, another --data-dir) is not refused for it."""
    import importlib

    task_train = importlib.import_module("elmokit.tasks.train")  # the module (elmokit.tasks.train is also a function)

    data = tmp_path / "train.txt"
    data.write_text("I PRON\nlike VERB\ncats NOUN\n\nYou PRON\nhate VERB\ndogs NOUN\n\n", encoding="utf-8")
    run = tmp_path / "run"
    command = ["task", "train", "--task", "pos", "--train", str(data), "--dev", str(data), "--out", str(run),
               "--model", "none", *TINY[2:], "--max-epochs", "2"]
    saved = task_train.save_loop

    def save_then_stop(*args, **kwargs):
        saved(*args, **kwargs)
        raise KeyboardInterrupt("stopped after the first epoch")

    with monkeypatch.context() as patch:
        patch.setattr(task_train, "save_loop", save_then_stop)
        assert main(command) != 0
    assert (run / task_train.CHECKPOINT).is_file()
    capsys.readouterr()
    assert main([*command, "--resume", "--data-dir", str(tmp_path / "elsewhere")]) == 0, capsys.readouterr().err
    assert (run / "results.json").is_file() and not (run / task_train.CHECKPOINT).exists()
