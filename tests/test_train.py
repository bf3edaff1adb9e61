"""The training loop end to end: CLI smoke run, exact resume after SIGKILL, export, perplexity,
continued training, and 2 processes (DDP, gloo) against 1 with the same global batch."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from elmokit.cli import main
from elmokit.config import CharCNNConfig, ElmoConfig, LSTMConfig

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
            "device": "cpu"}
    (root / "train.json").write_text(json.dumps(base), encoding="utf-8")
    return {"root": root, "train_json": root / "train.json", "vocab": root / "vocab.txt",
            "valid": root / "valid.txt"}


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
    assert {"step", "tokens", "loss", "lr", "tokens_per_s"} <= set(records[0])
    valid = [r for r in records if "valid_ppl" in r]
    assert valid and {"valid_forward_ppl", "valid_backward_ppl"} <= set(valid[-1])
    with pytest.raises(SystemExit):  # an existing run is not overwritten silently
        sys.exit(main(["train", "--config", str(corpus["train_json"]), "--output-dir", str(run)]))


def test_resume_after_sigkill_gives_identical_losses(corpus, tmp_path):
    reference = tmp_path / "reference"
    done = elmo("train", "--config", str(corpus["train_json"]), "--output-dir", str(reference))
    assert done.wait(timeout=60) == 0, done.stderr.read()
    expected = losses(reference)
    assert len(expected) > 20

    killed = tmp_path / "killed"
    kill_at = random.Random().randint(4, max(expected) - 4)
    process = elmo("train", "--config", str(corpus["train_json"]), "--output-dir", str(killed))
    while process.poll() is None and max(losses(killed), default=0) < kill_at if (killed / "metrics.jsonl").exists() \
            else process.poll() is None:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert max(losses(killed)) < max(expected), "the run finished before it could be killed"
    resumed = elmo("train", "--resume", "--output-dir", str(killed))
    assert resumed.wait(timeout=60) == 0, resumed.stderr.read()
    assert losses(killed) == expected  # every step's loss, bit for bit
