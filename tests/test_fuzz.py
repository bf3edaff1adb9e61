"""A fuzz harness for the command line (issue 17, point 10): random argument lists and random,
truncated or corrupt input files for every `elmo` subcommand, run in-process through
`elmokit.cli.main`. The property, whatever the input:

    exit 0, or a non-zero exit with one error line ("elmo COMMAND: error: ...", the last line
    on stderr; argparse adds its usage above it) and no traceback; after a failure nothing new
    in the output folder (no partial file, no half-made run directory), after a success no
    temporary file, partial output or lock left there; the inputs and the shared model, run and
    task directories are never changed.

Hypothesis runs derandomized (the same examples on every run, no example database), without
deadlines; the example counts keep the whole harness near a minute on one CPU thread with the
tiny model of tests/conftest.py. `FUZZ_EXAMPLES=N` in the environment scales every count by N;
`FUZZ_NO_SHRINK=1` reports the first failing example as found, without shrinking it;
`FUZZ_SHOW_ERRORS=1` with --hypothesis-show-statistics shows which errors the examples reached.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from elmokit import BiLM, save_original, save_pretrained
from elmokit.cli import main
from tests.conftest import tiny_config

WORDS = "the cat sat on a mat dog ran to house big small play".split()
SCALE = float(os.environ.get("FUZZ_EXAMPLES", "1"))


def fuzz_settings(examples: int):
    phases = [Phase.generate] if os.environ.get("FUZZ_NO_SHRINK") else list(Phase)  # no shrinking: a quick report
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, derandomize=True, database=None,
                    phases=phases, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                          HealthCheck.function_scoped_fixture])


# ---------------------------------------------------------------------------------------------
# Shared, read-only material: a tiny model (native and original), a vocabulary, a trained run
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz-shared")
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 9))) for _ in range(40)) + "\n"
    (root / "corpus.txt").write_text(text, encoding="utf-8")
    torch.manual_seed(0)
    save_pretrained(BiLM(tiny_config()).eval(), root / "model")
    save_original(BiLM(tiny_config()).eval(), root / "options.json", root / "weights.hdf5")
    tiny_config().save(root / "model.json")
    assert main(["vocab", str(root / "corpus.txt"), "-o", str(root / "vocab.txt")]) == 0
    assert main(["train", "--train", str(root / "corpus.txt"), "--valid", str(root / "corpus.txt"), "--vocab",
                 str(root / "vocab.txt"), "--model", str(root / "model.json"), "--output-dir", str(root / "run"),
                 "--batch-size", "2", "--unroll-steps", "4", "--epochs", "1", "--max-tokens", "40",
                 "--n-samples", "4", "--threads", "1", "--no-progress", "--device", "cpu",
                 "--log-every", "1", "--checkpoint-every", "5", "--eval-every", "5"]) == 0
    assert (root / "run" / "best" / "vocab.txt").is_file()
    tags = {"the": "DET", "a": "DET", "cat": "NOUN", "dog": "NOUN", "mat": "NOUN", "house": "NOUN", "play": "VERB",
            "sat": "VERB", "ran": "VERB", "on": "ADP", "to": "ADP", "big": "ADJ", "small": "ADJ"}
    tagged = "\n\n".join("\n".join(f"{word} {tags[word]}" for word in line.split()) for line in text.splitlines())
    (root / "tagged.txt").write_text(tagged + "\n", encoding="utf-8")
    assert main(["task", "train", "--task", "pos", "--train", str(root / "tagged.txt"), "--dev", str(root / "tagged.txt"),
                 "--model", "none", "--out", str(root / "task"), "--max-epochs", "1", "--word-dim", "4",
                 "--hidden-dim", "4", "--no-progress"]) == 0
    return {"root": root, "model": root / "model", "options": root / "options.json", "task": root / "task",
            "tagged": root / "tagged.txt",
            "weights": root / "weights.hdf5", "vocab": root / "vocab.txt", "run": root / "run",
            "model_json": root / "model.json", "corpus": root / "corpus.txt"}


def snapshot(*folders: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `folders`: its size and contents (a change to any byte shows)."""
    return {str(path): (path.stat().st_size, path.read_bytes())
            for folder in folders for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module", autouse=True)
def no_network(tmp_path_factory):
    """Models named by URL or published name come from an empty cache, never from the network."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ELMOKIT_OFFLINE", "1")
        patch.setenv("ELMOKIT_CACHE", str(tmp_path_factory.mktemp("fuzz-cache")))
        patch.delenv("ELMOKIT_MIRROR", raising=False)
        yield


@pytest.fixture(scope="module")
def shared_state(shared):
    before = snapshot(shared["root"])
    yield
    assert snapshot(shared["root"]) == before, "a command changed the shared model, vocabulary or run"


# ---------------------------------------------------------------------------------------------
# Input files: valid, random, truncated or corrupt, plain or gzip
# ---------------------------------------------------------------------------------------------
sentences = st.lists(st.lists(st.sampled_from(WORDS), max_size=12).map(" ".join), max_size=12).map(
    lambda lines: "\n".join(lines) + ("\n" if lines else ""))
random_text = st.text(max_size=300)
random_bytes = st.binary(max_size=300)


@st.composite
def input_files(draw) -> tuple[str, bytes]:
    """(file name, contents): a tokenized corpus, or random text or bytes, each plain, gzipped,
    gzipped and truncated, or named .gz without being gzip."""
    content = draw(st.one_of(sentences.map(str.encode), random_text.map(lambda t: t.encode("utf-8", "replace")),
                             random_bytes))
    form = draw(st.sampled_from(["plain", "plain", "gzip", "truncated-gzip", "fake-gzip"]))
    if form == "plain":
        return "input.txt", content
    if form == "fake-gzip":
        return "input.txt.gz", content
    packed = gzip.compress(content)
    if form == "truncated-gzip":
        packed = packed[:draw(st.integers(0, max(0, len(packed) - 1)))]
    return "input.txt.gz", packed


@st.composite
def json_files(draw) -> bytes:
    """A JSON document of any shape (or not JSON at all)."""
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**12), st.floats(allow_nan=True),
                     st.text(max_size=10))
    value = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                         max_leaves=8)
    return draw(st.one_of(value.map(lambda v: json.dumps(v).encode()), random_bytes))


# ---------------------------------------------------------------------------------------------
# Argument values: paths of every kind, numbers in and out of range, junk
# ---------------------------------------------------------------------------------------------
class Choices:
    """The choices of one example. File contents and free text come from Hypothesis; which
    argument and which value come from a Random that Hypothesis seeds, weighted so that most runs
    get past the argument parser into the files (Hypothesis itself favours first and extreme
    choices, which would make nearly every run a usage error)."""

    def __init__(self, draw, salt: bytes = b""):
        self.draw = draw
        # seeded by a drawn number and `salt` (the example's files): Hypothesis often varies the
        # files alone from one example to the next, and the arguments should vary with them
        seed = hashlib.sha256(draw(st.integers(0, 2**32 - 1)).to_bytes(4, "little") + salt).digest()
        self.rng = random.Random(seed)

    def pick(self, values):
        """A value of `values`: a list (uniform), a (good, bad) pair (good 85% of the time),
        or a Hypothesis strategy."""
        if isinstance(values, tuple):
            good, bad = values
            return self.rng.choice(good if self.rng.random() < 0.85 else bad)
        if isinstance(values, list):
            return self.rng.choice(values)
        return self.draw(values)

    def chance(self, probability: float) -> bool:
        return self.rng.random() < probability

    def options(self, choices: dict[str, object], most: int = 3) -> list[str]:
        """Up to `most` flags of `choices` (flag -> None for a switch, else what `pick` takes)."""
        argv: list[str] = []
        for flag in self.rng.sample(sorted(choices), self.rng.randint(0, min(most, len(choices)))):
            argv.append(flag)
            if choices[flag] is not None:
                argv.append(self.pick(choices[flag]))
        return argv


INTS = (["1", "2", "3", "7", "65", "300"], ["-1", "0", "10000000000000", "x", "1.5", ""])
FLOATS = (["0.5", "1e-3", "0.1"], ["-1", "0", "2", "nan", "inf", "x"])
TEXT = st.one_of(st.sampled_from(["the cat sat", "cat", "play", "the cat", "a big dog ran", "", " "]),
                 st.text(max_size=12))
DEVICES = (["cpu", "auto"], ["meta", "tpu", "cuda", "cuda:9", "cuda:x"])
QUERIES = (["the cat sat", "a big dog ran", "they play on the mat", "cat"], ["", " ", "naïve café 😀"])


class Place:
    """Where each path-valued argument may point, in the example's own folders."""

    def __init__(self, shared: dict[str, Path], work: Path):
        self.shared, self.work = shared, work
        self.inputs, self.out = work / "inputs", work / "out"
        self.inputs.mkdir()
        self.out.mkdir()

    def input_path(self, name: str) -> str:
        return {"input": str(self.inputs / self.input_name), "second": str(self.inputs / "second.txt"),
                "json": str(self.inputs / "config.json"), "missing": str(self.work / "missing.txt"),
                "folder": str(self.inputs), "corpus": str(self.shared["corpus"]), "devnull": "/dev/null",
                "empty": str(self.inputs / "empty.txt")}[name]

    def model_path(self, name: str) -> str:
        return {"model": str(self.shared["model"]), "run": str(self.shared["run"]),
                "best": str(self.shared["run"] / "best"), "checkpoint": str(self.shared["run"] / "checkpoint.pt"),
                "hostile": str(self.inputs / "hostile_model"), "missing": str(self.work / "no_model"),
                "input": str(self.inputs / self.input_name), "folder": str(self.inputs)}[name]

    def an_input(self, choose: Choices) -> str:
        return self.input_path(choose.pick((["input", "input", "corpus", "second"],
                                            ["json", "missing", "folder", "devnull", "empty"])))

    def a_model(self, choose: Choices, good=("model", "model", "hostile", "best")) -> str:
        return self.model_path(choose.pick((list(good), ["missing", "input", "folder"])))


def model_arguments(choose: Choices, place: Place) -> list[str]:
    """--model DIR, or --options-file/--weight-file (either may be random), or nothing (the
    built-in model), or a clash of both."""
    kind = choose.pick((["model", "model", "original"], ["builtin", "clash", "half", "name"]))
    if kind == "model":
        return ["--model", place.a_model(choose)]
    if kind == "name":  # a published name, handle or URL: offline, and not in the cache
        return ["--model", choose.pick(["small", "original-5.5B", "https://tfhub.dev/google/elmo/3",
                                        "https://tfhub.dev/google/elmo/9", "http://127.0.0.1:9/x.json", "gutenberg-en"])]
    options = choose.pick(([str(place.shared["options"])], [place.input_path("json"), place.input_path("missing")]))
    weights = choose.pick(([str(place.shared["weights"]), str(place.inputs / "hostile.hdf5")],
                           [place.input_path("input")]))
    if kind == "original":
        return ["--options-file", options, "--weight-file", weights]
    if kind == "half":
        return ["--weight-file", weights]
    if kind == "clash":
        return ["--model", str(place.shared["model"]), "--options-file", options, "--weight-file", weights]
    return []


def write_inputs(draw, place: Place) -> None:
    """The example's input files: the fuzzed input, a second one, a JSON file, an empty file,
    a hostile model (a native directory and an HDF5 file, damaged at random) and a hostile task run."""
    name, content = draw(input_files())
    place.input_name = name
    (place.inputs / name).write_bytes(content)
    (place.inputs / "second.txt").write_bytes(draw(st.one_of(sentences.map(str.encode), random_bytes)))
    (place.inputs / "config.json").write_bytes(draw(json_files()))
    (place.inputs / "empty.txt").write_bytes(b"")
    hostile = place.inputs / "hostile_model"
    shutil.copytree(place.shared["model"], hostile)
    damage = draw(st.sampled_from(["config", "truncate", "garbage", "none"]))
    if damage == "config":
        (hostile / "config.json").write_bytes(draw(json_files()))
    elif damage == "truncate":
        weights = (hostile / "model.safetensors").read_bytes()
        (hostile / "model.safetensors").write_bytes(weights[:draw(st.integers(0, len(weights) - 1))])
    elif damage == "garbage":
        (hostile / "model.safetensors").write_bytes(draw(random_bytes))
    original = place.shared["weights"].read_bytes()
    (place.inputs / "hostile.hdf5").write_bytes(original[:draw(st.integers(0, len(original)))])
    task = place.inputs / "hostile_task"  # a task run directory, damaged likewise
    shutil.copytree(place.shared["task"], task)
    damage = draw(st.sampled_from(["config", "truncate", "none"]))
    if damage == "config":
        (task / "task_config.json").write_bytes(draw(json_files()))
    elif damage == "truncate":
        weights = (task / "task_model.safetensors").read_bytes()
        (task / "task_model.safetensors").write_bytes(weights[:draw(st.integers(0, len(weights) - 1))])


# ---------------------------------------------------------------------------------------------
# The property
# ---------------------------------------------------------------------------------------------
def check(argv: list[str], place: Place) -> int:
    """Run `elmo argv` in-process and check the property; returns the exit status."""
    inputs_before = snapshot(place.inputs)
    threads = torch.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(argv)
            except SystemExit as exit_:  # argparse: --help, or a usage error
                status = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        torch.set_num_threads(threads)  # --threads must not leak into the next example
    stderr = err.getvalue()
    described = f"elmo {' '.join(argv)}\n--- stderr:\n{stderr[-3000:]}"
    event(f"exit status {status}" + (" (usage)" if "usage:" in stderr else ""))
    if os.environ.get("FUZZ_SHOW_ERRORS") and status:  # which errors the examples reach
        event(re.sub(r"/tmp/\S+", "PATH", stderr.strip().splitlines()[-1])[:90] if stderr.strip() else "no message")
    assert "Traceback" not in stderr, described
    assert snapshot(place.inputs) == inputs_before, f"an input was changed: {described}"
    if status == 0:  # a finished run leaves no temporary file, partial output or lock behind
        leftovers = [str(path.relative_to(place.out)) for path in place.out.rglob("*")
                     if path.name.endswith((".tmp", ".partial", ".lock"))]
        assert leftovers == [], f"a finished run left {leftovers}: {described}"
        return 0
    lines = [line for line in stderr.splitlines() if line.strip() and "\r" not in line]  # no progress bars
    errors = [line for line in lines if ": error: " in line and line.startswith("elmo")]
    assert len(errors) == 1 and lines[-1] == errors[0], f"not one error line: {described}"
    left = sorted(str(path.relative_to(place.out)) for path in place.out.rglob("*"))
    assert left == [], f"a failed run left {left}: {described}"
    return status


def run_example(draw, shared, build) -> int:
    with tempfile.TemporaryDirectory(prefix="fuzz-") as folder:
        place = Place(shared, Path(folder))
        write_inputs(draw, place)
        files = {str(Path(path).relative_to(place.inputs)): content for path, content in snapshot(place.inputs).items()}
        choose = Choices(draw, salt=repr(sorted(files.items())).encode())  # not the folder's random name: a
        # replayed example must draw the same arguments (else Hypothesis stops it as FlakyStrategyDefinition)
        argv = build(choose, place)
        if choose.chance(0.04):  # now and then a stray argument
            argv.insert(choose.rng.randint(1, len(argv)), choose.pick(["--bogus", "-x", "extra", "--"]))
        return check(argv, place)


# ---------------------------------------------------------------------------------------------
# One builder of arguments per subcommand
# ---------------------------------------------------------------------------------------------
def build_embed(choose: Choices, place: Place) -> list[str]:
    output = choose.pick((["o.h5", "o.npz", "o.hdf5"], ["", "sub/o.h5"]))
    argv = ["embed", place.an_input(choose), str(place.out / output), "--quiet"]
    argv += choose.options({"--all": None, "--top": None, "--average": None, "--sentence-vectors": None,
                            "--format": (["hdf5", "npz"], ["csv"]), "--tokenize": None, "--batch-size": INTS,
                            "--max-length": INTS, "--overlap": (["0", "1", "3", "32"], ["-1", "x"]),
                            "--use-sentence-keys": None, "--forget-sentences": None, "--overwrite": None,
                            "--resume": None, "--checkpoint-every": INTS, "--cuda-device": (["-1"], ["-2", "0", "x"]),
                            "--device": DEVICES, "--dtype": (["float32", "bfloat16"], ["float16"]),
                            "--threads": (["1"], ["0", "-1", "x"]), "--lang": (["en"], ["xx", ""])})
    return argv + model_arguments(choose, place)


def build_vocab(choose: Choices, place: Place) -> list[str]:
    inputs = [place.an_input(choose) for _ in range(choose.pick(([1, 1, 2], [0])))]
    argv = ["vocab", *inputs]
    if choose.chance(0.95):
        argv += ["-o", str(place.out / choose.pick((["vocab.txt"], ["", "sub/vocab.txt"])))]
    return argv + choose.options({"--min-count": INTS, "--max-size": INTS})


def build_prepare(choose: Choices, place: Place) -> list[str]:
    inputs = [place.an_input(choose) for _ in range(choose.pick([1, 1, 2]))]
    argv = ["prepare", *inputs, "-o", str(place.out / choose.pick((["shards"], [""]))), "--quiet"]
    return argv + choose.options({"--shard-size": INTS, "--workers": (["1"], ["0", "-1", "x"]), "--pretokenized": None,
                                  "--raw": None, "--lang": (["en"], ["xx"]), "--plain": None,
                                  "--skip-bad-lines": None, "--overwrite": None})


def build_train(choose: Choices, place: Place) -> list[str]:
    shared = place.shared
    argv = ["train", "--output-dir", str(place.out / "run"), "--threads", "1", "--no-progress",
            "--max-tokens", "24", "--unroll-steps", "3", "--n-samples", "4", "--device", "cpu",
            "--train", place.an_input(choose),
            "--vocab", choose.pick(([str(shared["vocab"])], [place.input_path("input"), place.input_path("missing")])),
            "--model", choose.pick(([str(shared["model_json"])], [place.input_path("json"), "no-such-preset"]))]
    return argv + choose.options({
        "--valid": ([str(shared["corpus"]), place.input_path("input")], [place.input_path("missing")]),
        "--config": [place.input_path("json")], "--batch-size": (["2", "3"], ["0", "-2", "x"]),
        "--epochs": (["1"], ["0", "-1", "x", "1.5"]), "--lr": FLOATS, "--dropout": FLOATS, "--grad-clip": FLOATS,
        "--softmax": (["sampled", "full"], ["x"]), "--optimizer": (["adagrad", "adam"], ["sgd"]),
        "--data-split": (["files", "rows"], ["x"]), "--log-every": (["1", "2"], ["0"]),
        "--checkpoint-every": (["2", "4"], ["0", "3"]), "--eval-every": (["0", "1"], ["-1"]),
        "--device": DEVICES, "--resume": None, "--bf16": None, "--overwrite": None,
        "--init-from": ([str(shared["run"] / "best")], [place.model_path("hostile"), place.model_path("missing")]),
        "--seed": INTS, "--warmup-steps": (["0", "2"], ["-1"]), "--lr-decay": FLOATS,
        "--patience": (["0", "1"], ["-1"])})


def build_perplexity(choose: Choices, place: Place) -> list[str]:
    argv = ["perplexity", place.a_model(choose, good=("run", "best", "run", "checkpoint", "model", "hostile"))]
    argv += [place.an_input(choose) for _ in range(choose.pick([1, 1, 2]))]
    return argv + choose.options({"--batch-size": INTS, "--unroll-steps": INTS, "--json": None,
                                  "--max-sentences": INTS,
                                  "--per-sentence": ([str(place.out / "s.tsv"), str(place.out / "s.jsonl")],
                                                     [str(place.out)]),
                                  "--device": DEVICES})


def build_export(choose: Choices, place: Place) -> list[str]:
    source = place.a_model(choose, good=("run", "best", "checkpoint", "model", "hostile"))
    argv = ["export", source] + choose.options({"--last": None, "--no-softmax": None,
                                                "--native": ([str(place.out / "native")], [str(place.out)]),
                                                "--dtype": (["float32", "float16"], ["int8"])})
    if choose.chance(0.7) or "--native" not in argv:
        argv += ["--original", str(place.out / "options.json"), str(place.out / "weights.hdf5")]
    return argv


def build_similar(choose: Choices, place: Place) -> list[str]:
    argv = ["similar", place.an_input(choose)] + query_and_word(choose)
    argv += choose.options({"--any-word": None, "--top-k": INTS, "--layer": (["0", "1", "2"], ["3", "-1"]),
                            "--tokenize": None, "--plot-layer": (["0", "2"], ["5"]),
                            "--plot": ([str(place.out / "p.png")], [str(place.out)]), "--colour-by": TEXT,
                            "--clusters": INTS, "--overwrite": None, "--batch-size": INTS,
                            "--max-length": (["65", "300"], ["0", "2", "64", "x"]), "--device": DEVICES})
    return argv + model_arguments(choose, place)


def query_and_word(choose: Choices) -> list[str]:
    """--query and its word (--word or --position), mostly one that is in the query."""
    query = choose.pick(QUERIES)
    tokens = query.split() or [""]
    if choose.chance(0.7):
        return ["--query", query, "--word", choose.pick((tokens, ["", "zebra", "the cat"]))]
    return ["--query", query, "--position", choose.pick(([str(i) for i in range(len(tokens))], ["-1", "99", "x"]))]


def build_info(choose: Choices, place: Place) -> list[str]:
    return ["info"] + choose.options({"--json": None}) + model_arguments(choose, place)


def build_convert(choose: Choices, place: Place) -> list[str]:
    argv = ["convert"] + model_arguments(choose, place) + choose.options({"--overwrite": None})
    target = choose.pick((["native", "original"], ["both", "none"]))
    if target in ("native", "both"):
        argv += ["--to-native", str(place.out / choose.pick((["native"], [""])))]
    if target in ("original", "both"):
        argv += ["--to-original", str(place.out / "o.json"), str(place.out / "w.hdf5")]
    return argv


def build_demo(choose: Choices, place: Place) -> list[str]:
    asked = query_and_word(choose) if choose.chance(0.5) else []  # else the demo's own query
    return ["demo", *asked] + choose.options({"--top-k": INTS}) + model_arguments(choose, place)


def build_task(choose: Choices, place: Place) -> list[str]:
    shared = place.shared
    run = choose.pick(([str(shared["task"]), str(place.inputs / "hostile_task")],
                       [place.model_path("missing"), place.model_path("folder"), place.model_path("input"),
                        str(shared["model"])]))
    data = ([place.input_path("input"), str(shared["tagged"])],
            [place.input_path(kind) for kind in ("missing", "folder", "empty", "json")])
    formats = (["auto", "conllu", "columns", "tsv", "csv", "jsonl"], ["x"])
    action = choose.pick((["train", "train", "eval", "predict"], ["probe"]))
    if action == "eval":
        return ["task", "eval", run, choose.pick(data), "--no-progress"] + choose.options({
            "--split": ["train", "dev", "test"], "--max-sentences": INTS, "--json": None, "--format": formats,
            "--device": (["cpu"], ["tpu"])})
    if action == "predict":
        return ["task", "predict", run, choose.pick(data), "-o", str(place.out / choose.pick((["p.txt"], [""]))),
                "--no-progress"] + choose.options({"--overwrite": None, "--tokenize": None, "--jsonl": None,
                                                   "--format": (["auto", "text", "columns", "conllu"], ["x"])})
    if action == "probe":
        return ["task", "probe", "--out", str(place.out / "probe"), "--data-dir", str(place.work / "no-data"),
                "--no-progress"] + choose.options({"--probes": (["pos", "wsd"], ["x"]),
                                                   "--max-train-sentences": INTS,
                                                   "--model": [str(shared["model"]), place.model_path("hostile")]})
    argv = ["task", "train", "--task", choose.pick((["pos", "ner", "classify"], ["sst2", "x"])),
            "--out", str(place.out / choose.pick((["task"], [""]))),
            "--model", choose.pick((["none"], [str(shared["model"]), place.model_path("hostile")])),
            "--max-epochs", "1", "--word-dim", "4", "--hidden-dim", "4", "--char-dim", "4", "--char-filters", "4",
            "--no-progress"]
    if choose.chance(0.9):  # files of the user's own, else the bundled data (absent here)
        argv += ["--train", choose.pick(data), "--dev", choose.pick(data)]
    else:
        argv += ["--data-dir", str(place.work / "no-data")]
    return argv + choose.options({"--max-train-sentences": INTS, "--lr": FLOATS, "--batch-size": INTS,
                                  "--dropout": FLOATS, "--seed": INTS, "--test": data, "--format": formats,
                                  "--min-word-count": (["0", "1"], ["-1"]), "--crf": None, "--no-chars": None})


def build_download(choose: Choices, place: Place) -> list[str]:
    names = (["small", "original", "pt", "https://tfhub.dev/google/elmo/2"],
             ["", "gutenberg-en", "http://127.0.0.1:9/a.json", "https://x.org/../../etc/passwd", "ftp://x/y"])
    return ["download"] + [choose.pick(names) for _ in range(choose.pick(([1, 1, 2], [0])))]


def build_cache(choose: Choices, place: Place) -> list[str]:
    return ["cache"] + choose.options({"--remove": (["small", "*", "*5.5B*"], ["", "[", "original"])})


def build_serve(choose: Choices, place: Place) -> list[str]:
    """Only argument errors: the last flag is always out of range, whatever came before it (a
    queue of 1 token was valid after --max-input-tokens 1, and the server started), so no server
    ever starts (a long-running process; tests/test_serve.py runs real ones)."""
    argv = ["serve"] + choose.options({"--host": ["127.0.0.1", "localhost"], "--max-batch-tokens": INTS,
                                       "--max-inputs": INTS, "--max-input-tokens": INTS, "--max-wait-ms": FLOATS,
                                       "--max-body-bytes": INTS, "--device": DEVICES, "--api-key": TEXT,
                                       "--dtype": (["float32", "bfloat16"], ["float16"])})
    argv += model_arguments(choose, place)
    return argv + choose.pick([["--port", choose.pick(["-1", "65536", "x", "99999999999"])],
                               ["--max-inputs", choose.pick(["0", "-3"])], ["--max-wait-ms", choose.pick(["-1", "nan", "inf"])],
                               ["--threads", "0"], ["--api-key", " "], ["--max-queue-tokens", "0"],
                               ["--max-batch-tokens", "0"], ["--max-body-bytes", "-1"],
                               ["--rows", choose.pick(["0", "4097"])]])


BUILDERS = {  # subcommand -> (argument builder, examples): about a minute in all on one thread
    "embed": (build_embed, 90), "vocab": (build_vocab, 60), "prepare": (build_prepare, 40),
    "train": (build_train, 40), "perplexity": (build_perplexity, 50), "export": (build_export, 40),
    "similar": (build_similar, 50), "info": (build_info, 40), "convert": (build_convert, 40),
    "demo": (build_demo, 15), "task": (build_task, 40), "download": (build_download, 20), "cache": (build_cache, 15),
    "serve": (build_serve, 20),
}


def make_test(command: str):
    build, examples = BUILDERS[command]

    @fuzz_settings(examples)
    @given(data=st.data())
    def test(shared, shared_state, data):
        run_example(data.draw, shared, build)

    test.__name__ = f"test_fuzz_{command}"
    test.__doc__ = f"`elmo {command}` with random arguments and input files keeps the property."
    return test


for _command in BUILDERS:
    globals()[f"test_fuzz_{_command}"] = make_test(_command)


def test_every_subcommand_is_fuzzed():
    from elmokit.cli import build_parser

    subcommands = build_parser()._subparsers._group_actions[0].choices
    assert set(subcommands) == set(BUILDERS)
