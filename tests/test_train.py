"""The training loop end to end: CLI smoke run, exact resume after SIGKILL, export, perplexity,
continued training, and 2 processes (DDP, gloo) against 1 with the same global batch."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from elmokit.cli import main
from elmokit.model.config import CharCNNConfig, ElmoConfig, LSTMConfig

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the cat sat on a mat dog ran to house big small red green blue one two three and of "
         "in is was he she it they we saw").split()


def tiny_config(clip: float = 3.0) -> ElmoConfig:
    return ElmoConfig(CharCNNConfig(embedding_dim=4, filters=((1, 4), (2, 8), (3, 8)), n_highway=1),
                      LSTMConfig(cell_dim=16, projection_dim=8, n_layers=2, cell_clip=clip, proj_clip=clip))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """A tiny synthetic corpus, its vocabulary, a model config and a base training config."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for name, n_lines in (("train.txt", 160), ("valid.txt", 30)):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(n_lines)]
        (root / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["vocab", str(root / "train.txt"), "-o", str(root / "vocab.txt")]) == 0
    tiny_config().save(root / "model.json")
    base = {"train_files": [str(root / "train.txt")], "valid_files": [str(root / "valid.txt")],
            "vocab": str(root / "vocab.txt"), "model": str(root / "model.json"), "batch_size": 4,
            "unroll_steps": 5, "epochs": 2, "log_every": 1, "checkpoint_every": 3, "eval_every": 20,
            "softmax": "sampled", "n_samples": 10, "dropout": 0.1, "threads": 1, "progress": False,
            "device": "cpu", "lstm_bf16": False, "softmax_bf16": False}  # float32 on every CPU: the numbers
    # these tests compare (1 process against 2, a resume against a run) do not depend on which CPU runs them
    (root / "train.json").write_text(json.dumps(base), encoding="utf-8")
    return {"root": root, "train_json": root / "train.json", "vocab": root / "vocab.txt",
            "valid": root / "valid.txt"}


def last_step(run_dir: Path) -> int:
    """The last step in metrics.jsonl of a run still writing it: its complete lines only (the
    last one may be half-written when it is read)."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    records = [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]
    return max((r["step"] for r in records if "loss" in r), default=0)


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def elmo(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "elmokit", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def test_train_smoke_writes_run_files(corpus, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--epochs", "1"]) == 0
    for name in ("checkpoint.pt", "metrics.jsonl", "curves.png", "train_config.json", "best/model.safetensors",
                 "best/vocab.txt", "best/config.json"):
        assert (run / name).is_file(), name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "tokens", "loss", "lr", "tokens_per_s", "elapsed_s"} <= set(records[0])
    assert all(a["elapsed_s"] <= b["elapsed_s"] for a, b in zip(records, records[1:]))
    valid = [r for r in records if "valid_ppl" in r]
    assert valid and {"valid_forward_ppl", "valid_backward_ppl"} <= set(valid[-1])
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    # an existing run is refused (exit status 2), and kept: not a byte of it changes
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run)]) == 2
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == before


@pytest.fixture(scope="module")
def reference_losses(corpus, tmp_path_factory) -> dict[int, float]:
    """Every step's loss of the base config's uninterrupted run (a process of its own, as the
    interrupted runs it is compared with): what a resumed run must give, bit for bit."""
    reference = tmp_path_factory.mktemp("reference")
    done = elmo("train", "--config", str(corpus["train_json"]), "--output-dir", str(reference / "run"))
    assert done.wait() == 0, done.stderr.read()
    return losses(reference / "run")


def test_resume_after_sigkill_gives_identical_losses(corpus, tmp_path, reference_losses):
    expected = reference_losses
    assert len(expected) > 20

    killed = tmp_path / "killed"
    kill_at = random.Random(17).randint(4, max(expected) - 4)  # seeded: a failure replays
    process = elmo("train", "--config", str(corpus["train_json"]), "--output-dir", str(killed))
    while process.poll() is None and last_step(killed) < kill_at:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert max(losses(killed)) < max(expected), f"the run finished before it could be killed at step {kill_at}"
    resumed = elmo("train", "--resume", "--output-dir", str(killed))
    assert resumed.wait() == 0, resumed.stderr.read()
    assert losses(killed) == expected  # every step's loss, bit for bit


def test_a_resume_that_changes_settings_records_them(corpus, tmp_path):
    """`--resume --eval-every N` (a setting changed mid-run): the run goes on with it, metrics.jsonl
    says at which step which fields changed (old, new), and train_config.json is the new one."""
    run = tmp_path / "run"
    process = elmo("train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--epochs", "1",
                   "--checkpoint-every", "1000")
    while process.poll() is None and last_step(run) < 3:
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    assert process.wait() == 130, process.stderr.read()
    stopped_at = max(losses(run))
    refused = elmo("train", "--resume", "--output-dir", str(run), "--batch-size", "8")  # the data state says no
    assert refused.wait() == 2 and "batch_size" in refused.stderr.read()
    assert json.loads((run / "train_config.json").read_text())["batch_size"] == 4  # nothing recorded
    resumed = elmo("train", "--resume", "--output-dir", f"{run}/", "--eval-every", "7", "--threads", "2")
    assert resumed.wait() == 0, resumed.stderr.read()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if "resumed_with" in r] == [{"step": stopped_at, "resumed_with": {"eval_every": [20, 7]}}]
    evaluated = [r["step"] for r in records if "valid_ppl" in r and r["step"] > stopped_at][:-1]  # last: the epoch's end
    assert len(evaluated) >= 2 and all(step % 7 == 0 for step in evaluated)
    assert json.loads((run / "train_config.json").read_text())["eval_every"] == 7


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_checkpoints_the_step_it_stops_at(corpus, tmp_path, stop_signal, reference_losses):
    """Ctrl-C or SIGTERM: the run finishes its step, writes a checkpoint there (not only every
    checkpoint_every steps), exits with 130, and --resume gives the uninterrupted run's losses."""
    expected = reference_losses

    stopped = tmp_path / "stopped"
    stop_at = random.Random(stop_signal).randint(4, max(expected) - 8)  # seeded: a failure replays
    process = elmo("train", "--config", str(corpus["train_json"]), "--output-dir", str(stopped),
                   "--checkpoint-every", "1000")
    while process.poll() is None and last_step(stopped) < stop_at:
        time.sleep(0.01)
    process.send_signal(stop_signal)
    _, stderr = process.communicate()
    assert process.returncode == 130, stderr
    last = max(losses(stopped))
    assert last < max(expected), f"the run finished before the signal at step {stop_at}"
    assert f"at step {last}: checkpoint written" in stderr
    resumed = elmo("train", "--resume", "--output-dir", str(stopped))
    assert resumed.wait() == 0, resumed.stderr.read()
    assert losses(stopped) == expected


def test_export_original_and_native_give_identical_bilm_outputs(corpus, tmp_path):
    from elmokit.training.checkpoint import load_checkpoint, model_from_checkpoint
    from elmokit.model.chars import batch_to_ids
    from elmokit.model.weights import load_original, load_pretrained, read_safetensors

    run = tmp_path / "run"
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--epochs", "1"]) == 0
    out = tmp_path / "export"
    assert main(["export", str(run), "--last", "--original", str(out / "options.json"), str(out / "weights.hdf5"),
                 "--native", str(out / "native")]) == 0
    trained = model_from_checkpoint(load_checkpoint(run / "checkpoint.pt")).bilm
    char_ids = batch_to_ids([["the", "cat", "sat"], ["a"], ["unseen", "wordß"]])
    expected = trained(char_ids).layers
    for loaded in (load_original(out / "options.json", out / "weights.hdf5"), load_pretrained(out / "native")):
        for got, want in zip(loaded(char_ids).layers, expected):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert (out / "native" / "vocab.txt").read_text() == corpus["vocab"].read_text()

    # an embedding-only half-precision copy (how the built-in model ships): no softmax, float16
    # on disk, float32 outputs within fp16 rounding of the trained model's
    assert main(["export", str(run), "--last", "--native", str(out / "small"), "--no-softmax", "--dtype", "float16"]) == 0
    stored = read_safetensors(out / "small" / "model.safetensors")
    assert not any(name.startswith("softmax.") for name in stored)
    assert {t.dtype for t in stored.values() if t.is_floating_point()} == {torch.float16}
    assert (out / "small" / "model.safetensors").stat().st_size < (out / "native" / "model.safetensors").stat().st_size
    for got, want in zip(load_pretrained(out / "small")(char_ids).layers, expected):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_export_records_the_provenance_of_the_model_it_writes(corpus, tmp_path):
    """`elmo export --last --native` writes the last checkpoint's provenance.json: its steps and
    tokens, and the validation the run made at that step (a run that ends on its token budget
    validates its last model); from best/, best/'s provenance.json goes with the model."""
    from elmokit.training.checkpoint import load_checkpoint

    run = tmp_path / "run"
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--epochs", "1",
                 "--max-tokens", "200"]) == 0
    assert main(["export", str(run), "--last", "--native", str(tmp_path / "last")]) == 0
    card = json.loads((tmp_path / "last" / "provenance.json").read_text())
    progress = load_checkpoint(run / "checkpoint.pt")["progress"]
    assert (card["steps"], card["tokens"], card["model"]) == (progress["step"], progress["tokens"],
                                                              "the run's last checkpoint")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    at_last = [r for r in records if "valid_ppl" in r and r["step"] == progress["step"]]
    assert at_last, "the run did not validate its last model"
    assert (card["valid_ppl"], card["valid_forward_ppl"]) == (round(at_last[-1]["valid_ppl"], 3),
                                                              round(at_last[-1]["valid_forward_ppl"], 3))
    assert main(["export", str(run), "--native", str(tmp_path / "best")]) == 0
    assert (json.loads((tmp_path / "best" / "provenance.json").read_text())
            == json.loads((run / "best" / "provenance.json").read_text()))


def test_perplexity_command_matches_an_independent_computation(corpus, tmp_path, capsys):
    """`elmo perplexity` (the training engine: windows, carried state, one-pass softmax) against
    the inference engine (BiLM.contextualize, the embedder's LSTM) over the same streams and a
    float64 log-softmax: with one row, the whole file is one stream, every sentence carrying
    the state of the ones before; --per-sentence scores each sentence from a fresh state."""
    from elmokit.training.checkpoint import load_model_dir
    from elmokit.training.vocab import Vocabulary

    run = tmp_path / "run"
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--epochs", "1",
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["perplexity", str(run), str(corpus["valid"]), "--json", "--batch-size", "1", "--unroll-steps", "5",
                 "--per-sentence", str(tmp_path / "scores.tsv")]) == 0
    result = json.loads(capsys.readouterr().out)

    model, vocab_path = load_model_dir(run / "best")
    vocab = Vocabulary.load(vocab_path)
    sentences = [line.split() for line in corpus["valid"].read_text().splitlines() if line.strip()]
    forward = _stream_nll(model, vocab, [t for s in sentences for t in ["<S>", *s]],
                          [t for s in sentences for t in [*s, "</S>"]], direction=0)
    backward = _stream_nll(model, vocab, [t for s in sentences for t in ["</S>", *s[::-1]]],
                           [t for s in sentences for t in [*s[::-1], "<S>"]], direction=1)
    n_targets = sum(len(s) + 1 for s in sentences)
    assert result["n_tokens"] == n_targets
    assert result["forward_ppl"] == pytest.approx(math.exp(forward / n_targets), rel=1e-4)
    assert result["backward_ppl"] == pytest.approx(math.exp(backward / n_targets), rel=1e-4)
    assert result["ppl"] == pytest.approx(math.exp(0.5 * (forward + backward) / n_targets), rel=1e-4)

    rows = (tmp_path / "scores.tsv").read_text().splitlines()
    assert rows[0].split("\t") == ["file", "line", "n_targets", "forward_nll", "backward_nll", "forward_ppl",
                                    "backward_ppl", "ppl"]
    assert len(rows) == 1 + len(sentences)
    for row, sentence in zip(rows[1:], sentences):
        fields = row.split("\t")
        assert int(fields[2]) == len(sentence) + 1
        alone_forward = _stream_nll(model, vocab, ["<S>", *sentence], [*sentence, "</S>"], direction=0)
        alone_backward = _stream_nll(model, vocab, ["</S>", *sentence[::-1]], [*sentence[::-1], "<S>"], direction=1)
        assert float(fields[3]) == pytest.approx(alone_forward, abs=2e-4)
        assert float(fields[4]) == pytest.approx(alone_backward, abs=2e-4)
    assert main(["perplexity", str(run / "best"), str(corpus["valid"]), "--per-sentence",
                 str(tmp_path / "scores.jsonl")]) == 0
    first = json.loads((tmp_path / "scores.jsonl").read_text().splitlines()[0])
    assert first["line"] == 1 and first["n_targets"] == len(sentences[0]) + 1


def test_perplexity_of_the_first_sentences_with_the_built_in_model(corpus, tmp_path, capsys, monkeypatch):
    """`elmo perplexity FILE --max-sentences N`: with no MODEL the built-in model scores the files
    (here a trained model put where the built-in one lives, float16 as it ships), and N stops the
    files after their first N sentences, across file boundaries: the same figures as the first N
    sentences written to a file of their own and scored by the model given by name."""
    import elmokit.model.builtin as builtin

    run = tmp_path / "run"
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--epochs", "1",
                 "--no-progress"]) == 0
    shipped = tmp_path / "models" / builtin.BUILTIN_MODEL
    assert main(["export", str(run), "--native", str(shipped), "--dtype", "float16"]) == 0
    monkeypatch.setattr(builtin, "MODELS_DIR", shipped.parent)
    sentences = [line for line in corpus["valid"].read_text().splitlines() if line.strip()]
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"  # 10 + the rest; N = 14 crosses into b.txt
    first.write_text("\n".join(sentences[:10]) + "\n\n", encoding="utf-8")
    second.write_text("\n".join(sentences[10:]) + "\n", encoding="utf-8")
    head = tmp_path / "head.txt"
    head.write_text("\n".join(sentences[:14]) + "\n", encoding="utf-8")
    capsys.readouterr()

    def scores(argv: list[str]) -> dict:
        assert main(["perplexity", *argv, "--json", "--batch-size", "3", "--unroll-steps", "4"]) == 0
        return json.loads(capsys.readouterr().out)

    limited = scores([str(first), str(second), "--max-sentences", "14"])
    assert limited["n_tokens"] == sum(len(s.split()) + 1 for s in sentences[:14])
    assert limited == scores([str(shipped), str(head)])
    assert limited != scores([str(shipped), str(first), str(second)])  # the limit did cut something
    assert scores([str(head)]) == limited  # no MODEL: the built-in one

    assert main(["perplexity", str(run), "--json"]) == 2  # a directory alone: the model, no file
    assert "no FILE follows it" in capsys.readouterr().err
    assert main(["perplexity", str(head), "--max-sentences", "0"]) == 2
    assert "--max-sentences must be at least 1" in capsys.readouterr().err
    assert main(["perplexity", str(tmp_path / "typo_run"), str(head)]) == 2  # meant as MODEL
    assert "typo_run: no such model directory or file" in capsys.readouterr().err
    assert main(["perplexity", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    scores_file = tmp_path / "scores.tsv"
    assert main(["perplexity", str(first), str(second), "--max-sentences", "14", "--per-sentence", str(scores_file)]) == 0
    rows = scores_file.read_text().splitlines()[1:]
    assert len(rows) == 14 and rows[-1].split("\t")[:2] == [str(second), "4"]
    embedding_only = tmp_path / "v1" / builtin.BUILTIN_MODEL  # how v1 shipped: no softmax
    assert main(["export", str(run), "--native", str(embedding_only), "--no-softmax"]) == 0
    monkeypatch.setattr(builtin, "MODELS_DIR", embedding_only.parent)
    capsys.readouterr()
    assert main(["perplexity", str(head)]) == 2
    assert "ships without its softmax" in capsys.readouterr().err


def _stream_nll(model, vocab, inputs: list[str], targets: list[str], direction: int) -> float:
    """Summed NLL of `targets` after each of `inputs`, read as one stream from a zero state by the
    forward (direction 0) or backward (1) LSTM: the backward one reads its row right to left,
    so it is given the stream reversed and its outputs are turned back."""
    from elmokit.model.chars import tokens_to_char_ids

    row = inputs if direction == 0 else inputs[::-1]
    with torch.no_grad():
        embeddings = model.bilm.encode_tokens(torch.from_numpy(tokens_to_char_ids(row)))  # (N, P)
        top = model.bilm.contextualize(embeddings, torch.ones(1, len(row), dtype=torch.bool)).layers[-1][0]  # (N, 2P)
        dim = top.shape[-1] // 2
        hidden = top[:, :dim] if direction == 0 else top[:, dim:].flip(0)  # (N, P), in stream order
        logits = hidden.double() @ model.softmax.weight.double().T + model.softmax.bias.double()  # (N, V)
    ids = torch.from_numpy(vocab.encode(targets))
    return -float(torch.log_softmax(logits, dim=-1)[torch.arange(len(ids)), ids].sum())


def test_init_from_keeps_the_softmax_and_init_from_original_replaces_it(corpus, tmp_path):
    from elmokit.training.checkpoint import load_model_dir
    from elmokit.training.loop import TrainConfig, build_model
    from elmokit.training.vocab import Vocabulary
    from elmokit.model.weights import save_original

    run = tmp_path / "run"
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--epochs", "1"]) == 0
    trained, _ = load_model_dir(run / "best")
    vocab = Vocabulary.load(corpus["vocab"])
    base = TrainConfig.load(corpus["train_json"], output_dir=str(tmp_path / "adapted"))
    adapted = build_model(TrainConfig(**{**base.__dict__, "init_from": str(run / "best")}), vocab)
    torch.testing.assert_close(adapted.state_dict(), trained.state_dict())
    save_original(trained.bilm, tmp_path / "options.json", tmp_path / "weights.hdf5")
    original = build_model(TrainConfig(**{**base.__dict__, "init_from_original": [str(tmp_path / "options.json"),
                                                                                   str(tmp_path / "weights.hdf5")]}), vocab)
    torch.testing.assert_close(original.bilm.state_dict(), trained.bilm.state_dict())
    assert not torch.equal(original.softmax.weight, trained.softmax.weight)
    # and the continued run trains
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(tmp_path / "continued"),
                 "--epochs", "1", "--init-from", str(run / "best")]) == 0


def test_config_file_overrides_and_errors(corpus, tmp_path):
    from elmokit.commands.train import config_from_args
    from elmokit.cli import build_parser
    from elmokit.model.config import ConfigError
    from elmokit.training.loop import TrainConfig

    args = build_parser().parse_args(["train", "--config", str(corpus["train_json"]), "--lr", "0.05",
                                      "--batch-size", "8", "--no-bf16", "--valid", "a.txt", "b.txt"])
    config = config_from_args(args)
    assert (config.lr, config.batch_size, config.bf16, config.valid_files) == (
        0.05, 8, False, [str(Path.cwd() / "a.txt"), str(Path.cwd() / "b.txt")])  # read from this folder
    assert config.unroll_steps == 5  # from the file
    (tmp_path / "bad.json").write_text(json.dumps({"learning_rate": 1}))
    with pytest.raises(ConfigError, match="learning_rate"):
        TrainConfig.load(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="optimizer"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ConfigError, match="multiple of log_every"):
        TrainConfig(log_every=10, checkpoint_every=15)
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(tmp_path / "r"),
                 "--vocab", str(tmp_path / "missing.txt")]) == 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_processes_take_the_same_steps_as_one(corpus, tmp_path):
    """DDP over gloo, 2 processes x 2 rows against 1 process x 4 rows: with data_split=rows both see
    the same global batches, so the losses agree up to float summation order (1e-5 relative)."""
    options = ["train", "--config", str(corpus["train_json"]), "--epochs", "1", "--dropout", "0",
               "--softmax", "full", "--data-split", "rows", "--eval-every", "10"]
    single = elmo(*options, "--output-dir", str(tmp_path / "one"))
    assert single.wait() == 0, single.stderr.read()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    double = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), "-m", "elmokit", *options, "--output-dir", str(tmp_path / "two")],
        env=env, capture_output=True, text=True)
    assert double.returncode == 0, double.stderr[-3000:]
    one, two = (read(tmp_path / name / "metrics.jsonl") for name in ("one", "two"))
    assert len(one) == len(two) > 10
    for a, b in zip(one, two):
        assert a["step"] == b["step"] and a["tokens"] == b["tokens"]
        for key in ("loss", "valid_ppl"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (a, b)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lr_schedule_warmup_stable_decay():
    """Warm-up, constant, halved by lr_decay (lr_scale), then linear to 0 over anneal_steps from anneal_start."""
    from elmokit.model.config import ConfigError
    from elmokit.training.loop import Progress, TrainConfig

    config = TrainConfig(lr=0.002, warmup_steps=4, anneal_start=100, anneal_steps=50)
    lrs = {step: Progress(step=step).lr(config) for step in (0, 3, 50, 99, 100, 125, 149, 150, 400)}
    assert lrs == pytest.approx({0: 0.0005, 3: 0.002, 50: 0.002, 99: 0.002, 100: 0.002, 125: 0.001,
                                 149: 0.002 / 50, 150: 0.0, 400: 0.0})
    assert Progress(step=125, lr_scale=0.5).lr(config) == pytest.approx(0.0005)
    assert Progress(step=10 ** 6).lr(TrainConfig(lr=0.002)) == 0.002  # no anneal by default
    with pytest.raises(ConfigError, match="anneal_start and anneal_steps go together"):
        TrainConfig(anneal_start=100)


def test_a_field_newer_than_the_checkpoint_is_no_change_at_its_default():
    """A checkpoint written before a field existed (its saved config lacks it) resumes with that
    field's default as no change, and with another value as a change from the default."""
    from dataclasses import asdict

    from elmokit.training.loop import TrainConfig, _changed_settings

    saved = {name: value for name, value in asdict(TrainConfig()).items() if not name.startswith("anneal_")}
    assert _changed_settings(saved, TrainConfig()) == {}
    assert _changed_settings(saved, TrainConfig(anneal_start=67_000, anneal_steps=17_000)) == {
        "anneal_start": [0, 67_000], "anneal_steps": [0, 17_000]}


def test_a_run_that_ends_on_its_token_budget_validates_its_last_model(corpus, tmp_path):
    """--max-tokens ends a run between two validations: its last model is validated as well, and
    kept in best/ when it is the best (an annealed run ends on its best)."""
    run = tmp_path / "run"
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run),
                 "--max-tokens", "100", "--eval-every", "1000"]) == 0
    records = read(run / "metrics.jsonl")
    last = max(r["step"] for r in records if "loss" in r)
    assert 1 < last < 1000 and [r["step"] for r in records if "valid_ppl" in r] == [last]
    assert json.loads((run / "best" / "provenance.json").read_text())["steps"] == last


def test_the_first_metrics_line_after_a_resume_covers_the_same_steps(corpus, tmp_path, monkeypatch):
    """Logged every 3 steps, stopped at step 5, resumed: the line at step 6 averages steps 4 to 6,
    as the uninterrupted run's does (the window's sums are in the checkpoint), not step 6 alone."""
    import itertools

    from elmokit.training import processes

    options = ["--config", str(corpus["train_json"]), "--epochs", "1", "--log-every", "3", "--checkpoint-every", "999"]
    assert main(["train", *options, "--output-dir", str(tmp_path / "reference")]) == 0
    steps = itertools.count(1)
    with monkeypatch.context() as patch:
        patch.setattr(processes.StopSignals, "requested", lambda self, dist_: next(steps) == 5)
        assert main(["train", *options, "--output-dir", str(tmp_path / "stopped")]) == 130
    assert main(["train", "--resume", "--output-dir", str(tmp_path / "stopped")]) == 0

    def lines(run: str) -> list[dict]:
        return [{key: record[key] for key in ("step", "loss", "grad_norm")}
                for record in read(tmp_path / run / "metrics.jsonl") if "loss" in record]

    assert [line["step"] for line in lines("stopped")][:2] == [3, 6]
    assert lines("stopped") == lines("reference")


# The second audit (2026-11-27)
def test_a_resume_raising_the_token_budget_trains_on(corpus, tmp_path, caplog):
    run = tmp_path / "run"
    base = ["train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--eval-every", "1000"]
    assert main([*base, "--max-tokens", "100"]) == 0
    first = max(losses(run))
    with caplog.at_level("WARNING", logger="elmokit"):
        assert main(["train", "--resume", "--output-dir", str(run), "--max-tokens", "100"]) == 0
    assert max(losses(run)) == first and "already ended on its token budget" in caplog.text
    assert main(["train", "--resume", "--output-dir", str(run), "--max-tokens", "300"]) == 0
    assert max(losses(run)) > first


def test_a_resume_cannot_change_the_optimizer_or_the_model(corpus, tmp_path, capsys):
    """Refused before anything is rewritten: the checkpoint holds Adagrad's state and the model's
    shape; a plain resume still works after."""
    run = tmp_path / "run"
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--max-tokens", "60",
                 "--eval-every", "1000"]) == 0
    before = (run / "train_config.json").read_bytes()
    other = tmp_path / "other.json"
    tiny_config(clip=1.0).save(other)
    for change, named in ((["--optimizer", "adam"], "--optimizer 'adagrad', now 'adam'"),
                          (["--model", str(other)], "--model")):
        capsys.readouterr()
        assert main(["train", "--resume", "--output-dir", str(run), *change]) == 2
        assert named in capsys.readouterr().err
        assert (run / "train_config.json").read_bytes() == before
    assert main(["train", "--resume", "--output-dir", str(run), "--max-tokens", "120"]) == 0


def test_a_resumed_run_does_not_read_its_starting_model_again(corpus, tmp_path):
    """--init-from's folder may be gone by the resume: the checkpoint holds the whole model."""
    start = tmp_path / "start"
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(start), "--max-tokens", "40",
                 "--eval-every", "1000"]) == 0
    shutil.copytree(start / "best", tmp_path / "init")
    run = tmp_path / "run"
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--max-tokens", "40",
                 "--eval-every", "1000", "--init-from", str(tmp_path / "init")]) == 0
    shutil.rmtree(tmp_path / "init")
    assert main(["train", "--resume", "--output-dir", str(run), "--max-tokens", "80"]) == 0


def test_a_vocabulary_named_json_is_refused(corpus, tmp_path, capsys):
    assert main(["vocab", str(corpus["root"] / "train.txt"), "-o", str(tmp_path / "v.json")]) == 2
    assert "cannot end in .json" in capsys.readouterr().err and not (tmp_path / "v.json").exists()


def test_metrics_say_each_steps_own_lr_and_the_training_speed(corpus, tmp_path, monkeypatch):
    """The lr of a metrics line is the one its step used (warm-up: step k's); a validation's time is
    not in the next line's tokens_per_s."""
    from elmokit.training import loop

    run = tmp_path / "run"
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--max-tokens", "200",
                 "--warmup-steps", "10", "--lr", "0.2", "--eval-every", "1000"]) == 0
    records = [r for r in read(run / "metrics.jsonl") if "loss" in r]
    config = loop.TrainConfig.load(run / "train_config.json")
    for record in records:
        assert record["lr"] == pytest.approx(loop.Progress(step=record["step"] - 1).lr(config))
    slow = tmp_path / "slow"
    evaluate = loop.run_evaluation

    def slow_evaluation(*args, **kwargs):
        time.sleep(0.5)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(loop, "run_evaluation", slow_evaluation)
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(slow), "--max-tokens", "200",
                 "--eval-every", "2", "--checkpoint-every", "1000"]) == 0
    lines = [r for r in read(slow / "metrics.jsonl") if "loss" in r and r["step"] > 1]
    after = [r["tokens_per_s"] for r in lines if r["step"] % 2 == 1]  # each the step after a 0.5 s validation
    others = sorted(r["tokens_per_s"] for r in lines if r["step"] % 2 == 0)
    assert after and others and min(after) > 0.3 * others[len(others) // 2]  # a step takes ~10 ms: 0.5 s would show


def test_corpus_perplexity_takes_one_file_or_a_pattern(corpus):
    from elmokit.training.perplexity import corpus_perplexity
    from elmokit.training.lm import LanguageModel
    from elmokit.training.vocab import Vocabulary

    vocab = Vocabulary.load(corpus["vocab"])
    torch.manual_seed(0)
    model = LanguageModel(tiny_config(), len(vocab), 0.0, 0)
    valid = corpus["valid"]
    listed = corpus_perplexity(model, vocab, [valid])
    for files in (valid, str(valid), [str(valid.parent / "valid*.txt")]):
        assert corpus_perplexity(model, vocab, files, progress=True)["ppl"] == pytest.approx(listed["ppl"])


def test_a_lstm_bf16_run_validates_in_float32_as_elmo_perplexity_scores(corpus, tmp_path, capsys):
    """The run's valid_ppl (the best model's choice) is what `elmo perplexity` gives for best/ with
    the run's windows: float32, whatever the training's products."""
    from elmokit.kernels import bf16_native

    if not bf16_native():
        pytest.skip("--lstm-bf16 needs a CPU with bfloat16 products")
    run = tmp_path / "run"
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--max-tokens", "100",
                 "--eval-every", "1000", "--lstm-bf16"]) == 0
    valid = [r for r in read(run / "metrics.jsonl") if "valid_ppl" in r][-1]["valid_ppl"]
    capsys.readouterr()
    assert main(["perplexity", str(run), str(corpus["valid"]), "--json", "--batch-size", "64",  # its eval_batch_size
                 "--unroll-steps", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["ppl"] == pytest.approx(valid, rel=1e-9)


def test_a_run_stopped_by_patience_stays_stopped_on_resume(corpus, tmp_path):
    """--patience ends a run for good (only a token budget is raised by a resume): a plain
    --resume, as a requeued --auto-resume job runs, takes no step."""
    run = tmp_path / "run"
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--eval-every", "1",
                 "--patience", "1", "--lr", "30"]) == 0
    records = read(run / "metrics.jsonl")
    last = max(r["step"] for r in records if "loss" in r)
    assert last < 60  # stopped early (two epochs of the base config are 123 steps)
    assert main(["train", "--resume", "--output-dir", str(run)]) == 0
    assert max(r["step"] for r in read(run / "metrics.jsonl") if "loss" in r) == last


# Issue 54: a run never writes, nor resumes from, weights that are not finite or bytes that are damaged
def test_a_loss_gone_nan_stops_the_run_at_its_step_and_keeps_the_last_finite_checkpoint(corpus, tmp_path,
                                                                                        monkeypatch, capsys):
    """The 5th training window's loss made NaN: elmo train stops at step 5 with one line naming it
    (exit 2); checkpoint.pt stays step 3's, every weight finite, and no best/ is written (a run
    without validation writes its last model there at its end; it ran on to exit 0 before)."""
    import itertools

    from elmokit.training.lm import LanguageModel

    config = {**json.loads(corpus["train_json"].read_text()), "valid_files": [], "epochs": 1}
    (tmp_path / "train.json").write_text(json.dumps(config), encoding="utf-8")
    forward, windows = LanguageModel.forward, itertools.count(1)

    def poisoned(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return out._replace(forward_nll=out.forward_nll * math.nan) if self.training and next(windows) == 5 else out

    monkeypatch.setattr(LanguageModel, "forward", poisoned)
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--config", str(tmp_path / "train.json"), "--output-dir", str(run)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "step 5" in error and "NaN" in error, error
    checkpoint = torch.load(run / "checkpoint.pt", weights_only=True)
    assert checkpoint["progress"]["step"] == 3
    assert all(bool(torch.isfinite(tensor).all()) for tensor in checkpoint["model"].values())
    assert not (run / "best").exists() and max(losses(run)) == 4


def test_weights_gone_infinite_after_a_finite_loss_are_never_checkpointed(corpus, tmp_path, capsys):
    """--resume --lr 1e300 --checkpoint-every 1: step 4's loss is finite, its update is not; the
    checkpoint of step 4 is refused with one line naming the step, checkpoint.pt stays step 3's."""
    run = tmp_path / "run"
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--max-tokens", "60",
                 "--eval-every", "1000"]) == 0
    assert load_step(run) == 3
    capsys.readouterr()
    assert main(["train", "--resume", "--output-dir", str(run), "--max-tokens", "200", "--lr", "1e300",
                 "--checkpoint-every", "1"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "step 4" in error, error
    assert math.isfinite(losses(run)[4]) and load_step(run) == 3


def load_step(run: Path) -> int:
    return torch.load(run / "checkpoint.pt", weights_only=True)["progress"]["step"]


def flip_a_tensor_byte(path: Path) -> str:
    """Flip one byte in the middle of the largest member of a torch.save zip (a tensor's bytes);
    returns the member's name."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        tensors = [info for info in archive.infolist() if "/data/" in info.filename]
    member = max(tensors, key=lambda info: info.file_size)
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack_from("<HH", data, member.header_offset + 26)  # the local header's
    data[member.header_offset + 30 + name_length + extra_length + member.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return member.filename


def test_a_resume_refuses_a_damaged_or_non_finite_checkpoint(corpus, tmp_path, capsys):
    """One flipped byte in a tensor (torch.load reads it without a word) fails its CRC-32: the
    resume is refused naming the file and the member; a checkpoint with a NaN weight is refused
    naming the file and the tensor; the intact checkpoint then resumes."""
    import io

    run = tmp_path / "run"
    assert main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--max-tokens", "60",
                 "--eval-every", "1000"]) == 0
    path = run / "checkpoint.pt"
    intact = path.read_bytes()
    member = flip_a_tensor_byte(path)
    torch.load(path, weights_only=True)  # torch reads the damaged tensor without a word
    resume = ["train", "--resume", "--output-dir", str(run), "--max-tokens", "100"]
    capsys.readouterr()
    assert main(resume) == 2
    error = capsys.readouterr().err
    assert str(path) in error and member in error and "CRC" in error, error

    checkpoint = torch.load(io.BytesIO(intact), weights_only=True)
    name = sorted(checkpoint["model"])[1]
    checkpoint["model"][name].view(-1)[0] = math.nan
    torch.save(checkpoint, path)
    assert main(resume) == 2
    error = capsys.readouterr().err
    assert str(path) in error and repr(name) in error and "NaN" in error, error
    path.write_bytes(intact)
    assert main(resume) == 0 and load_step(run) == 5


def test_a_start_or_resume_removes_what_killed_writes_of_the_run_left(corpus, tmp_path):
    """The temporary files that atomic_path leaves when its writer is killed (made here by a
    process killed mid-write) of checkpoint.pt, train_config.json and best/'s files: a fresh start
    removes those of its directory, a resume those of best/ too; other files stay."""
    run = tmp_path / "run"

    def killed_writes(*names: str) -> list[Path]:
        script = ("import os, sys; from elmokit.io import atomic_path\n"
                  "for name in sys.argv[1:]: atomic_path(name).__enter__().write_bytes(b'half a file')\n"
                  "os._exit(9)")
        subprocess.run([sys.executable, "-c", script, *(str(run / name) for name in names)], check=False,
                       env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        left = sorted(set(run.rglob(".*.tmp")) - set(kept))
        assert len(left) == len(names), left
        return left

    kept = [run / "notes.tmp", run / ".checkpoint.pt.tmp"]
    run.mkdir()
    for path in kept:
        path.write_text("not the run's")
    killed_writes("checkpoint.pt")
    base = ["train", "--config", str(corpus["train_json"]), "--output-dir", str(run), "--eval-every", "1000"]
    assert main([*base, "--auto-resume", "--max-tokens", "60"]) == 0
    assert sorted(run.rglob("*.tmp")) == sorted(kept)
    kept.append(run / "best" / ".other.safetensors.x1y2z3w4.tmp")
    kept[-1].write_text("not the run's")
    killed_writes("checkpoint.pt", "train_config.json", "best/model.safetensors", "best/README.md")
    assert main(["train", "--resume", "--output-dir", str(run), "--max-tokens", "100"]) == 0
    assert sorted(run.rglob("*.tmp")) == sorted(kept)


def test_a_run_started_with_relative_paths_resumes_from_another_folder(corpus, tmp_path, monkeypatch):
    """--train, --valid, --vocab and --model given relative to the folder the run starts in: its
    train_config.json holds them absolute, so --resume from another folder reads the same files,
    also when that resume names them again spelt another way (`..`); and a run saved with relative
    paths (before they were made absolute: its options and its data position) resumes from its own
    folder with no change of settings recorded."""
    root = corpus["root"]
    monkeypatch.chdir(root)
    run = tmp_path / "run"
    args = ["train", "--train", "train.txt", "--valid", "valid.txt", "--vocab", "vocab.txt", "--model", "model.json",
            "--batch-size", "4", "--unroll-steps", "5", "--max-tokens", "60", "--log-every", "1",
            "--checkpoint-every", "1", "--eval-every", "100", "--softmax", "full", "--threads", "1", "--no-progress",
            "--device", "cpu", "--no-lstm-bf16", "--no-softmax-bf16", "--output-dir", str(run)]
    assert main(args) == 0
    saved = json.loads((run / "train_config.json").read_text())
    assert [Path(saved["vocab"]), Path(saved["model"]), *map(Path, saved["train_files"] + saved["valid_files"])] == [
        Path.cwd() / name for name in ("vocab.txt", "model.json", "train.txt", "valid.txt")]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--resume", "--output-dir", str(run), "--max-tokens", "120"]) == 0
    assert last_step(run) == 6  # 120 tokens, 20 a step
    spelt = os.path.relpath(root, elsewhere)  # ../../corpus0 or the like
    assert main(["train", "--resume", "--output-dir", os.path.relpath(run), "--max-tokens", "140",
                 "--vocab", f"{spelt}/vocab.txt", "--model", f"{spelt}/../{root.name}/model.json",
                 "--train", f"{spelt}/train.txt"]) == 0
    assert last_step(run) == 7
    monkeypatch.chdir(root)  # a run saved with relative paths, resumed where it started
    relative = {"vocab": "vocab.txt", "model": "model.json", "train_files": ["train.txt"],
                "output_dir": os.path.relpath(run)}
    (run / "train_config.json").write_text(json.dumps(saved | relative))
    checkpoint = torch.load(run / "checkpoint.pt", weights_only=True)
    checkpoint["train_config"] |= relative
    for rank in checkpoint["ranks"]:  # the data position names the files as the run gave them
        rank["data"]["config"]["files"] = ["train.txt"]
    torch.save(checkpoint, run / "checkpoint.pt")
    assert main(["train", "--resume", "--output-dir", str(run), "--max-tokens", "160"]) == 0
    assert last_step(run) == 8
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(set(record["resumed_with"]) == {"max_tokens"} for record in records if "resumed_with" in record)


def test_absolute_paths_keep_names_and_escape_the_folder_in_globs(tmp_path, monkeypatch):
    """What a run saves: a preset, the built-in model and URLs stay names even where a folder of
    that name exists; a working folder whose name holds glob characters is escaped, so a file in
    it still matches."""
    from elmokit.training.config import TrainConfig
    from elmokit.textfiles import expand_paths

    folder = tmp_path / "exp[1]*"
    (folder / "small").mkdir(parents=True)
    (folder / "gutenberg-en").mkdir()
    (folder / "train.txt").write_text("a b\n")
    monkeypatch.chdir(folder)
    config = TrainConfig(model="small", init_from="gutenberg-en", train_files=["train.txt", "t*.txt"],
                         vocab="~/vocab.txt", output_dir="../run").with_absolute_paths()
    assert (config.model, config.init_from) == ("small", "gutenberg-en")
    original = TrainConfig(init_from_original=["https://example.org/o.json", "w.hdf5"]).with_absolute_paths()
    assert original.init_from_original == ["https://example.org/o.json", str(folder / "w.hdf5")]
    assert config.vocab == str(Path.home() / "vocab.txt") and config.output_dir == str(tmp_path / "run")
    assert expand_paths(config.train_files) == [folder / "train.txt"]
    assert TrainConfig(model="model.json").with_absolute_paths().model == str(folder / "model.json")


def test_the_python_api_saves_a_runs_files_absolute_too(corpus, tmp_path, monkeypatch):
    """`elmokit.training.loop.train(TrainConfig(...))` with relative paths, as `elmo train`: the
    saved train_config.json names the files absolute."""
    from elmokit.training.config import TrainConfig
    from elmokit.training.loop import train

    monkeypatch.chdir(corpus["root"])
    base = json.loads(corpus["train_json"].read_text())
    config = TrainConfig(**base | {"train_files": ["train.txt"], "valid_files": [], "vocab": "vocab.txt",
                                   "model": "model.json", "max_tokens": 20, "output_dir": str(tmp_path / "run")})
    train(config)
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert (saved["train_files"], saved["vocab"], saved["model"]) == (
        [str(corpus["root"] / "train.txt")], str(corpus["root"] / "vocab.txt"), str(corpus["root"] / "model.json"))
