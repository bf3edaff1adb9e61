"""Threads that fit the CPU a process gets: `elmo embed` of N sentences (UD English EWT dev, the
built-in model, `--top`) with the default threads (`elmokit.devices.default_threads`) against
`--threads 1` and `--threads 2`, and with the command's OpenMP wait policy (sleep at once,
`elmokit_launch.WAIT_POLICY`) against GNU OpenMP's own (spin first: GOMP_SPINCOUNT=300000, its
default), in three settings:

    quiet   nothing else started by this script
    busy    beside as many spinning Python processes as the machine has CPUs
    quota   in a cgroup allowed one CPU (cgroup v1 cpu.cfs_quota_us or v2 cpu.max, 100 ms of each
            100 ms); where no cgroup can be made here, pinned to one CPU (taskset's affinity) instead,
            and the page says so

    .venv/bin/python bench/threads.py                        # -> bench/results/threads.md
    .venv/bin/python bench/threads.py --sentences 100 --repeats 1 --output /tmp/threads.md

Each run is a fresh `python -m elmokit_launch -v embed ...` (the `elmo` command's start), timed
from start to exit (torch's import included: what a user waits for); the configurations of a
setting run interleaved, `--repeats` times, and the page gives the fastest and the median of each,
the default's chosen count (from its -v line), the load average before and after each setting and
the other busy processes. The script needs root for the cgroup.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from embed import UD_DEV, read_conllu_forms
from machine import busy_processes, describe_cpu, page_header

REPO = Path(__file__).resolve().parents[1]
SPIN = {"GOMP_SPINCOUNT": "300000"}  # GNU OpenMP's default spinning, set explicitly: the command then keeps it
CONFIGS = [("default", None, {}), ("default, spin", None, SPIN), ("--threads 1", 1, {}),
           ("--threads 2", 2, {}), ("--threads 2, spin", 2, SPIN)]
CGROUP_V1, CGROUP_V2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")


def embed_once(sentences: Path, threads: int | None, env: dict, place) -> tuple[float, str]:
    """Seconds `elmo embed` took, and the threads it ran ("2", or the default's "1 (default)")."""
    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "elmokit_launch", "-v", "embed", str(sentences),
                   str(Path(folder) / "out.h5"), "--top", "--no-progress"]
        command += ["--threads", str(threads)] if threads else []
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, preexec_fn=place,
                              env={**os.environ, "PYTHONPATH": str(REPO / "src"), **env})
        seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    chosen = re.search(r"default threads: (\d+)", done.stderr)
    return seconds, f"{chosen.group(1)} (default)" if chosen else str(threads)


@contextlib.contextmanager
def spinners(count: int):
    """`count` processes that keep a CPU each busy until the block ends."""
    processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    time.sleep(3)  # started and running
    try:
        yield
    finally:
        for process in processes:
            process.kill()
            process.wait()


@contextlib.contextmanager
def one_cpu_quota():
    """(preexec function that puts a child in a cgroup of one CPU, what the page says of it); a
    child pinned to CPU 0 where no cgroup can be made."""
    for root, limit in ((CGROUP_V1, {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}),
                        (CGROUP_V2, {"cpu.max": "100000 100000"})):
        folder = root / "elmokit-bench"
        try:
            folder.mkdir(exist_ok=True)
            for name, value in limit.items():
                (folder / name).write_text(value)
        except OSError:
            continue
        try:
            yield (lambda: (folder / "cgroup.procs").write_text(str(os.getpid()))), \
                f"a cgroup ({folder}) with {', '.join(f'{k} = {v}' for k, v in limit.items())}: one CPU"
        finally:
            with contextlib.suppress(OSError):
                folder.rmdir()
        return
    yield (lambda: os.sched_setaffinity(0, {0})), "no cgroup could be made here: pinned to CPU 0 instead (affinity)"


def run_setting(sentences: Path, repeats: int, place=None) -> dict[str, tuple[list[float], set[str]]]:
    """Every configuration `repeats` times, interleaved: name -> (seconds, threads seen)."""
    results = {name: ([], set()) for name, _, _ in CONFIGS}
    for _ in range(repeats):
        for name, threads, env in CONFIGS:
            seconds, used = embed_once(sentences, threads, env, place)
            results[name][0].append(seconds)
            results[name][1].add(used)
            print(f"  {name}: {seconds:.1f} s ({used} threads)", flush=True)
    return results


def table(results: dict) -> list[str]:
    best = min(min(times) for times, _ in results.values())
    lines = ["| threads, wait policy | threads run | fastest (s) | median (s) | fastest / best |", "|---|---|---|---|---|"]
    for name, (times, used) in results.items():
        lines.append(f"| {name} | {', '.join(sorted(used))} | {min(times):.1f} | {statistics.median(times):.1f} "
                     f"| {min(times) / best:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settings", default="quiet,busy,quota")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "threads.md")
    args = parser.parse_args()
    sentences = [" ".join(tokens) for tokens in read_conllu_forms(UD_DEV)][:args.sentences]
    cpus = os.cpu_count() or 1
    lines = ["# Threads that fit the CPU the process gets (bench/threads.py)", "",
             page_header("cpu", cpus), "", f"CPU: {describe_cpu()}; torch's OpenMP: {openmp()}.", "",
             f"`elmo embed` (the `elmo` command's start, `python -m elmokit_launch`) of {len(sentences)} sentences "
             f"of UD English EWT dev, the built-in model, `--top`, float32; wall seconds from start to exit, "
             f"torch's import included; each configuration {args.repeats} times, interleaved. \"spin\": "
             "GOMP_SPINCOUNT=300000, GNU OpenMP's own default, instead of the command's wait policy (no spinning).", ""]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "sentences.txt"
        path.write_text("\n".join(sentences) + "\n", encoding="utf-8")
        for setting in args.settings.split(","):
            print(setting, flush=True)
            before = busy_processes()
            if setting == "quiet":
                results, said = run_setting(path, args.repeats), "nothing started by this script"
            elif setting == "busy":
                with spinners(cpus):
                    results = run_setting(path, args.repeats)
                said = f"beside {cpus} Python processes spinning (`while True: pass`), one a CPU"
            else:
                with one_cpu_quota() as (place, said):
                    results = run_setting(path, args.repeats, place)
            lines += [f"## {setting}: {said}", "", f"Before: {before}.", "", *table(results), "",
                      f"After: {busy_processes()}.", ""]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {args.output}")


def openmp() -> str:
    """Which OpenMP torch runs (from `torch.__config__.parallel_info()`) and the library it loaded."""
    code = ("import torch; info = torch.__config__.parallel_info(); "
            "names = {line.rsplit('/', 1)[-1] for line in open('/proc/self/maps') if '/' in line}; "
            "libs = sorted(name.strip() for name in names if 'gomp' in name or 'iomp' in name); "
            "print(info.splitlines()[3].strip(), ';', 'backend', info.split('ATen parallel backend:')[1].strip(), "
            "';', ', '.join(libs))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
