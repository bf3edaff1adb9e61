"""`elmo train` that survives a lost worker: under `torchrun --max-restarts` a worker SIGKILLed
mid-epoch costs the job a restart, not the run (every logged loss and the final weights equal an
uninterrupted run's, no step logged twice); `--auto-resume` (the one command line of a restarted
job) starts, continues, or replaces a start killed before its first checkpoint; the ranks refuse
together to resume from checkpoints that differ; what a killed writer leaves is cleaned up."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from elmokit.cli import main
from elmokit.model.config import ConfigError
from tests.test_train import REPO, corpus, free_port, losses, read  # noqa: F401 (corpus: a fixture)

TORCHRUN_TIMEOUT_S = 300  # a job that hangs fails the test instead of the suite


@pytest.fixture
def short_run(corpus, tmp_path) -> Path:
    """A training config of ~30 steps (half the tiny corpus, one epoch, a checkpoint every 3
    steps, no validation): the elastic test pays three process starts a job, not many steps."""
    lines = corpus["root"].joinpath("train.txt").read_text(encoding="utf-8").splitlines()
    train = tmp_path / "train.txt"
    train.write_text("\n".join(lines[:80]) + "\n", encoding="utf-8")
    config = json.loads(corpus["train_json"].read_text())
    config.update(train_files=[str(train)], valid_files=[], epochs=1, checkpoint_every=3)
    path = tmp_path / "short.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    return path


def torchrun(config: Path, out_dir: Path) -> subprocess.Popen:
    """`elmo train --auto-resume` under torchrun: 2 gloo processes, c10d rendezvous, 2 restarts."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--max-restarts", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
               "--monitor-interval", "0.1", "-m", "elmokit", "train", "--config", str(config),
               "--output-dir", str(out_dir), "--auto-resume"]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def workers(agent: int) -> dict[int, int]:
    """{RANK: pid} of the worker processes the torchrun agent `agent` runs now (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0") if parent == agent else []
        except (OSError, ValueError, IndexError):  # not a process, or one that has just ended
            continue
        rank = next((item[5:] for item in environ if item.startswith(b"RANK=")), None)
        if rank is not None:  # a child between fork and exec has no RANK yet
            found[int(rank)] = int(entry.name)
    return found


def logged_step(run_dir: Path) -> int:
    """The last step in metrics.jsonl, its complete lines only."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return max((json.loads(line)["step"] for line in text[:text.rfind("\n") + 1].splitlines()), default=0)


def kill_worker(job: subprocess.Popen, rank: int, at_step: int, run_dir: Path, spared: set[int]) -> int:
    """SIGKILL the worker of `rank` (not one of the pids in `spared`: an earlier attempt's) once
    the run has logged `at_step`; returns its pid."""
    deadline = time.monotonic() + TORCHRUN_TIMEOUT_S
    while job.poll() is None and time.monotonic() < deadline:
        pid = workers(job.pid).get(rank)
        if pid is not None and pid not in spared and logged_step(run_dir) >= at_step:
            os.kill(pid, signal.SIGKILL)
            return pid
        time.sleep(0.01)
    job.kill()
    pytest.fail(f"the job ended (status {job.poll()}) before rank {rank} could be killed at step {at_step}: "
                f"{job.communicate()[1][-3000:]}")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the workers through Linux's /proc")
def test_a_job_that_loses_workers_ends_as_an_uninterrupted_run(short_run, tmp_path):
    """Rank 1 killed at step 8 (after the checkpoint of step 6), then in the restarted job rank 0,
    the checkpoint writer, killed at step 14: the job restarts twice from its last checkpoint and
    ends with the uninterrupted job's weights, bit for bit, and its metrics.jsonl line for line."""
    reference = torchrun(short_run, tmp_path / "reference")
    _, stderr = reference.communicate(timeout=TORCHRUN_TIMEOUT_S)
    assert reference.returncode == 0, stderr[-3000:]
    expected = read(tmp_path / "reference" / "metrics.jsonl")
    assert max(losses(tmp_path / "reference")) > 20

    killed_dir = tmp_path / "killed"
    job = torchrun(short_run, killed_dir)
    try:
        first = kill_worker(job, 1, 8, killed_dir, spared=set())
        first_attempt = set(workers(job.pid).values()) | {first}
        kill_worker(job, 0, 14, killed_dir, spared=first_attempt)  # the restarted job's rank 0
        _, stderr = job.communicate(timeout=TORCHRUN_TIMEOUT_S)
    finally:
        job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert stderr.count("exitcode: -9") == 2, stderr[-3000:]  # torchrun saw both workers die
    records = read(killed_dir / "metrics.jsonl")
    steps = [record["step"] for record in records if "loss" in record]
    assert steps == list(range(1, len(steps) + 1))  # no step written twice, none missing
    dropped = {"elapsed_s", "tokens_per_s"}  # wall-clock figures: the only ones that differ
    assert ([{k: v for k, v in r.items() if k not in dropped} for r in records]
            == [{k: v for k, v in r.items() if k not in dropped} for r in expected])
    final, uninterrupted = (torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)
                            for name in ("killed", "reference"))
    assert final["progress"]["step"] == uninterrupted["progress"]["step"] == steps[-1]
    for name, tensor in uninterrupted["model"].items():
        assert torch.equal(final["model"][name], tensor), name
    assert not list(killed_dir.glob(".*.tmp")) and not (killed_dir / "train.lock").exists()


def test_auto_resume_starts_continues_and_replaces_an_unfinished_start(short_run, tmp_path, monkeypatch):
    """--auto-resume in one process: an empty directory starts a run; a stopped run continues to
    the uninterrupted run's losses (the temporary file of a checkpoint write a kill interrupted
    is removed); a start killed before its first checkpoint (run files, no checkpoint.pt) is
    replaced; a directory whose checkpoint.pt is damaged is an error, not a fresh start."""
    from elmokit.training import processes

    options = ["train", "--config", str(short_run)]
    assert main([*options, "--output-dir", str(tmp_path / "reference")]) == 0
    run = tmp_path / "run"
    steps = itertools.count(1)
    with monkeypatch.context() as patch:
        patch.setattr(processes.StopSignals, "requested", lambda self, dist_: next(steps) == 7)
        assert main([*options, "--output-dir", str(run), "--auto-resume"]) == 130  # started, stopped at 7
    assert max(losses(run)) == 7
    (run / ".checkpoint.pt.k1ll3d.tmp").write_bytes(b"half a checkpoint")
    assert main([*options, "--output-dir", str(run), "--auto-resume"]) == 0  # continued
    assert losses(run) == losses(tmp_path / "reference")
    assert not (run / ".checkpoint.pt.k1ll3d.tmp").exists()

    unfinished = tmp_path / "unfinished"  # what a start SIGKILLed before its first checkpoint leaves
    unfinished.mkdir()
    (unfinished / "train_config.json").write_text("{}")
    (unfinished / "metrics.jsonl").write_text('{"step": 1, "loss": 99.0}\n')
    assert main([*options, "--output-dir", str(unfinished)]) == 2  # without --auto-resume: refused
    assert main([*options, "--output-dir", str(unfinished), "--auto-resume"]) == 0
    assert losses(unfinished) == losses(tmp_path / "reference")

    (run / "checkpoint.pt").write_bytes(b"not a checkpoint")
    assert main([*options, "--output-dir", str(run), "--auto-resume"]) == 2
    assert main([*options, "--output-dir", str(run), "--auto-resume", "--resume"]) == 2


def test_the_ranks_resume_together_or_refuse_together(tmp_path):
    """Every rank reports what it read (step, checkpoint id) or its error, and all decide alike."""
    from elmokit.training.checkpoint import check_ranks_agree

    path = tmp_path / "checkpoint.pt"
    for rank in (0, 1):
        check_ranks_agree(path, [(30, "a1"), (30, "a1")], rank)  # the same checkpoint: go on
    with pytest.raises(ConfigError, match=r"different checkpoints \(rank 0 step 30, rank 1 step 27"):
        check_ranks_agree(path, [(30, "a1"), (27, "b2")], 0)
    with pytest.raises(ConfigError, match="different checkpoints"):  # one step written twice
        check_ranks_agree(path, [(30, "a1"), (30, "c3")], 1)
    missing = [(30, "a1"), "FileNotFoundError: checkpoint not found"]
    with pytest.raises(ConfigError, match="rank 1: FileNotFoundError.*shared by all nodes"):
        check_ranks_agree(path, missing, 0)
    check_ranks_agree(path, missing, 1)  # rank 1 raises its own error (the caller re-raises it)


def test_a_metrics_line_cut_short_by_a_kill_is_dropped_on_resume(tmp_path):
    from elmokit.training.metrics import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    truncate_metrics(path, 2)
    assert read(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(ValueError, match="metrics.jsonl, line 2: not a JSON record"):
        truncate_metrics(path, 3)  # damage before the last line is no interrupted write


def _start_as_rank(rank: int, port: int, config_path: str, run_dirs: list[str], results: str) -> None:
    """Worker of `test_every_rank_follows_rank_0s_view_of_the_run_directory`: join a 2-process gloo
    group, `start_run(resume="auto")` in this rank's own run directory, write what came of it."""
    import datetime

    import torch.distributed as dist

    from elmokit.training.config import TrainConfig
    from elmokit.training.loop import start_run

    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))  # a rank left waiting fails, not hangs
    try:
        run = start_run(TrainConfig.load(config_path, output_dir=run_dirs[rank]), "auto")
        outcome = ["resumed" if run.progress.step else "started", run.progress.step]
    except Exception as error:  # what each rank raised is the result
        outcome = [type(error).__name__, str(error)]
    Path(results, f"rank{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()


def test_every_rank_follows_rank_0s_view_of_the_run_directory(short_run, tmp_path):
    """--auto-resume where the ranks see different run directories (a node whose view lacks the
    checkpoint, or holds a stale one): rank 0 finds a checkpoint, rank 1 none: both try to resume
    and refuse together, naming the rank that could not read it; rank 0 finds none, rank 1 one:
    both start the run afresh. A rank that trusted its own view entered other collectives than
    the rest (a hang, a garbled exchange) or refused alone."""
    import torch.multiprocessing as mp

    done = tmp_path / "done"
    assert main(["train", "--config", str(short_run), "--output-dir", str(done), "--max-tokens", "60"]) == 0
    for case, holder in (("rank0_sees_it", 0), ("rank1_sees_it", 1)):
        run_dirs = [tmp_path / case / f"view{rank}" for rank in (0, 1)]
        run_dirs[1 - holder].mkdir(parents=True)
        shutil.copytree(done, run_dirs[holder])
        mp.spawn(_start_as_rank, args=(free_port(), str(short_run), [str(d) for d in run_dirs], str(tmp_path / case)),
                 nprocs=2)
        outcomes = [json.loads((tmp_path / case / f"rank{rank}.json").read_text()) for rank in (0, 1)]
        if holder == 0:
            assert outcomes[0][0] == "ConfigError" and "rank 1: FileNotFoundError" in outcomes[0][1], outcomes
            assert outcomes[1][0] == "FileNotFoundError" and str(run_dirs[1]) in outcomes[1][1], outcomes
        else:
            assert outcomes == [["started", 0], ["started", 0]]


def test_each_restart_attempt_keeps_its_keys_in_the_agents_store_apart(monkeypatch):
    """Under torchrun's shared agent store, `restart_safe_store` gives each attempt its own prefix
    of that store: a key set by attempt 2's workers is read there under elmokit/attempt_2/, and an
    attempt 3 does not see it (the dead workers' addresses of pytorch/pytorch#135712). Outside
    such a store: torch's own ({})."""
    import torch.distributed as dist

    from elmokit.training.processes import restart_safe_store

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert restart_safe_store(0, 2) == {}
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    stores = {}
    for attempt in (2, 3):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        stores[attempt] = restart_safe_store(1, 2)
        assert (stores[attempt]["rank"], stores[attempt]["world_size"]) == (1, 2)
    stores[2]["store"].set("rank_0_address", "dead-worker")
    assert agent.check(["elmokit/attempt_2/rank_0_address"])  # check, not get: a missing key's get waits
    assert agent.get("elmokit/attempt_2/rank_0_address") == b"dead-worker"
    assert not stores[3]["store"].check(["rank_0_address"])
