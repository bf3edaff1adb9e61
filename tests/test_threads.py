"""One ElmoEmbedder or Elmo shared by many threads gives what sequential calls give; and the torch
threads a model runs on: the default from the CPUs the process may use (affinity, cgroup quota,
other work), `threads` passed on by every entry point, the `elmo` command's OpenMP wait policy."""

from __future__ import annotations

import itertools
import os
import threading
import time
import types

import numpy as np
import pytest
import torch

from elmokit import Elmo, ElmoEmbedder, TokenCache, batch_to_ids

N_THREADS = 8


def _sentence_lists(seed: int, n_lists: int, n_sentences: int, vocabulary: int) -> list[list[list[str]]]:
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(vocabulary)]
    return [[list(rng.choice(words, rng.integers(0, 12))) for _ in range(n_sentences)] for _ in range(n_lists)]


def _in_threads(work, inputs: list) -> list:
    """work(x) for every x, each in its own thread, all started together; re-raises any error."""
    results, errors = [None] * len(inputs), []
    start = threading.Barrier(len(inputs))

    def run(i: int) -> None:
        try:
            start.wait()
            results[i] = work(inputs[i])
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def test_embedder_without_cache_in_threads_equals_sequential_exactly(tiny_model):
    embedder = ElmoEmbedder(module=tiny_model, cache_tokens=False)
    lists = _sentence_lists(0, N_THREADS, 40, 300)
    sequential = [list(embedder.embed_sentences(sentences, batch_size=5)) for sentences in lists]
    for _ in range(3):
        threaded = _in_threads(lambda sentences: list(embedder.embed_sentences(sentences, batch_size=5)), lists)
        for got, expected in zip(threaded, sequential):
            assert len(got) == len(expected)
            for a, b in zip(got, expected):
                np.testing.assert_array_equal(a, b)


def test_token_cache_shared_by_threads_that_fill_and_reset_it(tiny_model):
    """A cache of 1,024 words, 8 threads over 6,000: it fills and starts over many times while
    other threads read it. A row read after another thread's reset would be another word's
    vector (differences of order 1, or a KeyError); the cache itself is exact to 1e-6 (the
    token encoder's sums depend slightly on how many words it runs at once)."""
    projection = tiny_model.config.lstm.projection_dim
    embedder = ElmoEmbedder(module=tiny_model)
    embedder.cache = TokenCache(embedder.bilm, max_bytes=1024 * 4 * projection)
    lists = _sentence_lists(1, N_THREADS, 60, 6000)
    plain = ElmoEmbedder(module=tiny_model, cache_tokens=False)
    sequential = [list(plain.embed_sentences(sentences, batch_size=4)) for sentences in lists]
    for _ in range(3):
        threaded = _in_threads(lambda sentences: list(embedder.embed_sentences(sentences, batch_size=4)), lists)
        for got, expected in zip(threaded, sequential):
            for a, b in zip(got, expected):
                np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert len(embedder.cache.index) <= embedder.cache.max_size == 1024


def test_embed_batch_and_sentence_in_threads(tiny_model):
    embedder = ElmoEmbedder(module=tiny_model, cache_tokens=False)
    lists = _sentence_lists(2, N_THREADS, 6, 200)
    sequential = [embedder.embed_batch(batch) for batch in lists]
    threaded = _in_threads(embedder.embed_batch, lists)
    for got, expected in zip(threaded, sequential):
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("word_inputs", [False, True])
def test_elmo_in_eval_mode_in_threads_equals_sequential_exactly(tiny_model, word_inputs):
    lists = _sentence_lists(3, N_THREADS, 6, 100)
    vocab = ["@@PADDING@@", *sorted({word for sentences in lists for sentence in sentences for word in sentence})]
    elmo = Elmo(module=tiny_model, num_output_representations=2, dropout=0.5,
                vocab_to_cache=vocab if word_inputs else None).eval()
    row = {word: i for i, word in enumerate(vocab)}  # 0: padding

    def inputs(sentences):
        if not word_inputs:
            return {"inputs": batch_to_ids(sentences)}
        width = max(1, max(map(len, sentences)))
        ids = torch.tensor([[row[w] for w in s] + [0] * (width - len(s)) for s in sentences], dtype=torch.long)
        return {"word_inputs": ids}

    def run(sentences):
        with torch.no_grad():
            output = elmo(**inputs(sentences))
        return [r.numpy() for r in output["elmo_representations"]], output["mask"].numpy()

    sequential = [run(sentences) for sentences in lists]
    for _ in range(3):
        for (got, got_mask), (expected, expected_mask) in zip(_in_threads(run, lists), sequential):
            np.testing.assert_array_equal(got_mask, expected_mask)
            for a, b in zip(got, expected):
                np.testing.assert_array_equal(a, b)


def test_stateful_embedder_calls_do_not_interleave(tiny_model):
    """Stateful results depend on the order of calls by design; shared by threads, each call
    must still see a whole state (one of the orders, never a mix): with identical batches the
    carried state after N calls is that of N sequential calls."""
    batch = _sentence_lists(4, 1, 3, 50)[0]
    threaded = ElmoEmbedder(module=tiny_model, stateful=True, cache_tokens=False)
    _in_threads(lambda _: threaded.embed_batch(batch), list(range(N_THREADS)))
    sequential = ElmoEmbedder(module=tiny_model, stateful=True, cache_tokens=False)
    for _ in range(N_THREADS):
        sequential.embed_batch(batch)
    for a, b in zip(threaded.carried.state, sequential.carried.state):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# The torch threads a model runs on (elmokit.devices.use_threads, default_threads)
# ---------------------------------------------------------------------------------------------
GIVEN = 3  # a count no default here gives (2 CPUs, the suite's 1 thread): the entry point passed it on


@pytest.fixture
def thread_count(monkeypatch):
    """torch's count and elmokit's memory of a given one, restored after the test; no OMP_NUM_THREADS."""
    from elmokit import devices

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    monkeypatch.setitem(devices._threads_given, "count", None)
    yield
    torch.set_num_threads(before)


def fake_machine(root, monkeypatch, *, cgroup="0::/", loadavg="0.00 0.00 0.00 1/100 1", running=("R",),
                 cpus=8, files=None, others=0.0, own=0.0):
    """A /proc and /sys/fs/cgroup under `root`: this process's cgroup line(s), the machine's
    loadavg, its own threads' states; `others` CPUs busy with other processes and `own` with this
    one over any window (/proc/stat's busy ticks advance by both a second, /proc/self/stat's by
    `own`); `files` under the cgroup root."""
    from elmokit import devices

    proc, cgroups = root / "proc", root / "cgroup"
    (proc / "self" / "task").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup + "\n")
    (proc / "loadavg").write_text(loadavg + "\n")
    (proc / "uptime").write_text("1000.00 900.00\n")
    for i, state in enumerate(running):
        (proc / "self" / "task" / str(i)).mkdir()
        (proc / "self" / "task" / str(i) / "stat").write_text(f"{i} (python) {state} 1 2 3\n")
    for name, text in (files or {}).items():
        (cgroups / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroups / name).write_text(text)
    cgroups.mkdir(exist_ok=True)
    monkeypatch.setattr(devices, "PROC", proc)
    monkeypatch.setattr(devices, "CGROUP_ROOT", cgroups)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    ticks_a_second, clock = os.sysconf("SC_CLK_TCK"), {"machine": 0.0, "own": 0.0}

    def ticking(path: Path, read=devices._read) -> str:  # every reading a second later
        if path == proc / "stat":
            clock["machine"] += (others + own) * ticks_a_second
            return f"cpu  {int(clock['machine'])} 0 0 5000 0 0 0 0 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n"
        if path == proc / "self" / "stat":
            clock["own"] += own * ticks_a_second
            return f"42 (py thon) R {' '.join(['0'] * 10)} {int(clock['own'])} 0 {' '.join(['0'] * 6)} 0 rest\n"
        return read(path)

    monkeypatch.setattr(devices, "_read", ticking)
    seconds = itertools.count()  # devices' own clock: a second a reading, no sleeping
    monkeypatch.setattr(devices, "time", types.SimpleNamespace(perf_counter=lambda: float(next(seconds)),
                                                               sleep=lambda _: None))


def test_cgroup_v2_quota_is_the_tightest_along_the_process_path(tmp_path, monkeypatch):
    from elmokit.devices import cgroup_cpu_quota, usable_cpus

    fake_machine(tmp_path, monkeypatch, cgroup="0::/user.slice/job.scope", files={
        "cpu.max": "max 100000\n", "user.slice/cpu.max": "150000 100000\n",
        "user.slice/job.scope/cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota() == 1.5
    assert usable_cpus() == 1  # 1.5 CPUs of time: one thread (rounded down)


def test_cgroup_v1_quota_of_a_container_whose_path_is_not_mounted(tmp_path, monkeypatch):
    """Docker on cgroup v1: /proc/self/cgroup names the host's path, the container sees its own
    cgroup at the controller's root."""
    from elmokit.devices import cgroup_cpu_quota, usable_cpus

    fake_machine(tmp_path, monkeypatch, cgroup="4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc", files={
        "cpu,cpuacct/cpu.cfs_quota_us": "300000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota() == 3.0
    assert usable_cpus() == 3


def test_no_quota_leaves_the_affinity(tmp_path, monkeypatch):
    from elmokit.devices import cgroup_cpu_quota, usable_cpus

    fake_machine(tmp_path, monkeypatch, cgroup="1:cpu:/", cpus=6, files={
        "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota() is None and usable_cpus() == 6
    (tmp_path / "proc" / "self" / "cgroup").unlink()  # not Linux, or no /proc: no limit
    assert cgroup_cpu_quota() is None


def test_busy_cpus_are_the_run_queue_less_this_process_or_the_window(tmp_path, monkeypatch):
    from elmokit.devices import busy_cpus

    # 6 runnable on the machine, 2 of them this process's threads: 4 others
    fake_machine(tmp_path, monkeypatch, loadavg="0.50 0.40 0.30 6/300 99", running=("R", "R", "S"))
    assert busy_cpus() == 4
    # nothing else runnable at the readings, but 2.5 CPUs of other work over the window: work that comes and goes
    fake_machine(tmp_path / "again", monkeypatch, loadavg="0.00 0.00 0.00 1/300 99", running=("R",), others=2.5,
                 own=1.0)
    assert busy_cpus() == 2.5  # the machine's 3.5 CPUs less this process's own
    # a 1-minute load of 3.25 left by a job that ended, nothing running now: a quiet machine
    fake_machine(tmp_path / "after", monkeypatch, loadavg="3.25 2.00 1.00 1/300 99", running=("R",))
    assert busy_cpus() == 0


@pytest.mark.parametrize("runnable, others, quota, expected", [
    (1, 0.1, None, 8),  # a quiet machine: every CPU
    (1, 0.1, ("200000 100000\n"), 2),  # a quota of 2 CPUs
    (1, 2.6, None, 5),  # 2.6 CPUs busy: 5.4 free, 5 threads
    (1, 2.6, ("400000 100000\n"), 4),  # the quota is the tighter
    (12, 9.0, None, 1),  # more busy than there are CPUs: one thread, never 0
])
def test_default_threads_fit_affinity_quota_and_load(tmp_path, monkeypatch, runnable, others, quota, expected):
    from elmokit.devices import default_threads

    fake_machine(tmp_path, monkeypatch, loadavg=f"9.00 9.0 9.0 {runnable}/90 1", others=others,
                 files={"cpu.max": quota} if quota else None)
    assert default_threads() == expected


def test_default_threads_follow_the_affinity(tmp_path, monkeypatch):
    from elmokit.devices import default_threads

    fake_machine(tmp_path, monkeypatch)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})  # taskset -c 0-2
    assert default_threads() == 3


def test_use_threads_lowers_never_raises_and_keeps_a_given_count(thread_count, monkeypatch):
    from elmokit import devices

    cpu = torch.device("cpu")
    torch.set_num_threads(2)
    monkeypatch.setattr(devices, "default_threads", lambda: 1)
    assert devices.use_threads(None, cpu) == 1 == torch.get_num_threads()
    monkeypatch.setattr(devices, "default_threads", lambda: 4)
    assert devices.use_threads(None, cpu) == 1  # the process's own lower count stays
    monkeypatch.setattr(devices, "default_threads", lambda: 1)
    assert devices.use_threads(GIVEN, cpu) == GIVEN
    assert devices.use_threads(None, cpu) == GIVEN  # given once: later models without a count keep it
    with pytest.raises(ValueError, match="threads must be from 1 to"):
        devices.use_threads(0, cpu)


def test_use_threads_leaves_omp_num_threads_and_gpus_alone(thread_count, monkeypatch):
    from elmokit import devices

    torch.set_num_threads(2)
    monkeypatch.setattr(devices, "default_threads", lambda: 1)
    assert devices.use_threads(None, torch.device("meta")) == 2  # not the CPU: torch's count is not the model's
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert devices.use_threads(None, torch.device("cpu")) == 2  # the user's choice


def test_library_entry_points_pass_threads_on(thread_count, tiny_model):
    from elmokit.hub import HubElmo

    for build in (lambda: ElmoEmbedder(module=tiny_model, threads=GIVEN), lambda: Elmo(module=tiny_model, threads=GIVEN),
                  lambda: HubElmo(module=tiny_model, threads=GIVEN)):
        torch.set_num_threads(1)
        build()
        assert torch.get_num_threads() == GIVEN
    with pytest.raises(ValueError, match="threads must be from 1 to"):
        ElmoEmbedder(module=tiny_model, threads=0)


def test_entry_points_without_a_count_take_the_default(thread_count, tiny_model, monkeypatch):
    from elmokit import devices

    torch.set_num_threads(GIVEN + 1)
    monkeypatch.setattr(devices, "default_threads", lambda: GIVEN)
    ElmoEmbedder(module=tiny_model)
    assert torch.get_num_threads() == GIVEN


def test_hub_module_passes_threads_on(thread_count, tiny_model, monkeypatch):
    from elmokit import hub

    monkeypatch.setattr(hub, "load_handle", lambda handle: (tiny_model, None))
    hub.Module("any/handle", threads=GIVEN)
    assert torch.get_num_threads() == GIVEN


def _embeds_with_given_threads(make_and_run) -> None:
    torch.set_num_threads(1)
    make_and_run()
    assert torch.get_num_threads() == GIVEN


def test_spacy_pipe_passes_threads_on(thread_count, model_dir):
    spacy = pytest.importorskip("spacy")
    import elmokit.integrations.spacy  # noqa: F401  (registers the factory)

    _embeds_with_given_threads(lambda: spacy.blank("en").add_pipe(
        "elmo", config={"model": str(model_dir), "threads": GIVEN})(spacy.blank("en")("a b")))


def test_flair_embeddings_pass_threads_on(thread_count, model_dir):
    pytest.importorskip("flair")
    from elmokit.integrations.flair import ELMoEmbeddings

    _embeds_with_given_threads(lambda: ELMoEmbeddings(str(model_dir), threads=GIVEN))


def test_sentence_transformers_pass_threads_on_also_when_loading_a_folder(thread_count, model_dir, tmp_path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from elmokit.integrations.sentence_transformers import ELMoSentenceEncoder, save_sentence_transformers

    encoder = ELMoSentenceEncoder(model_dir, threads=GIVEN)
    _embeds_with_given_threads(lambda: sentence_transformers.SentenceTransformer(
        modules=[encoder], device="cpu").encode(["a b"]))
    folder = save_sentence_transformers(model_dir, tmp_path / "st")
    _embeds_with_given_threads(lambda: sentence_transformers.SentenceTransformer(
        str(folder), device="cpu", model_kwargs={"threads": GIVEN}).encode(["a b"]))


def test_langchain_and_llama_index_pass_threads_on(thread_count, model_dir):
    for module, name in (("elmokit.integrations.langchain", "ELMoEmbeddings"),
                         ("elmokit.integrations.llama_index", "ELMoEmbedding")):
        try:
            embeddings = getattr(__import__(module, fromlist=[name]), name)(model=str(model_dir), threads=GIVEN)
        except ImportError:
            continue  # that library is not installed
        _embeds_with_given_threads(lambda: embeddings.get_text_embedding("a b") if hasattr(
            embeddings, "get_text_embedding") else embeddings.embed_query("a b"))


def test_keras_layer_passes_threads_on(thread_count, model_dir, monkeypatch):
    if "keras" not in __import__("sys").modules:
        monkeypatch.setenv("KERAS_BACKEND", "torch")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "torch":
        pytest.skip("keras was imported with another backend in this process")
    from elmokit.integrations.keras import ElmoEmbedding

    _embeds_with_given_threads(lambda: ElmoEmbedding(str(model_dir), threads=GIVEN))


# ---------------------------------------------------------------------------------------------
# The `elmo` command's OpenMP wait policy (elmokit_launch)
# ---------------------------------------------------------------------------------------------
WATCH_TORCH_IMPORT = r"""
import importlib.abc, json, os, sys
names = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
seen = {}

class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" and "torch" not in seen:  # the environment OpenMP will read
            seen["torch"] = {n: os.environ.get(n) for n in names}
        return None

sys.meta_path.insert(0, Watch())
import elmokit_launch
imported = {n: os.environ.get(n) for n in names}
sys.argv = ["elmo", "--version"]
try:
    elmokit_launch.main()
except SystemExit:
    pass
print(json.dumps({"imported": imported, "at_torch_import": seen.get("torch")}))
"""


def _wait_policy_seen(**environment: str) -> dict:
    import json
    import subprocess
    import sys
    from pathlib import Path

    from elmokit_launch import WAIT_POLICY

    env = {k: v for k, v in os.environ.items() if k not in WAIT_POLICY}
    env.update(environment, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", WATCH_TORCH_IMPORT], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_elmo_command_sets_the_wait_policy_before_torch_is_imported():
    report = _wait_policy_seen()
    nothing = {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None, "KMP_BLOCKTIME": None}
    assert report["imported"] == nothing  # importing the module changes nothing; its main does
    assert report["at_torch_import"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"}


def test_elmo_command_keeps_a_wait_policy_the_user_set():
    report = _wait_policy_seen(OMP_WAIT_POLICY="ACTIVE")
    assert report["at_torch_import"] == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None, "KMP_BLOCKTIME": None}


def test_the_elmo_console_script_is_the_launcher():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["scripts"]["elmo"] == "elmokit_launch:main"
    assert "elmokit_launch" in pyproject["tool"]["setuptools"]["py-modules"]
