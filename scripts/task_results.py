"""ELMo in real tasks: every task x {no ELMo, ELMo} x seeds, written up as a Markdown table.

    .venv/bin/python scripts/task_results.py --probes        # built-in model, full table -> docs/results.md
    .venv/bin/python scripts/task_results.py --tasks ner wnut17 --runs-dir runs/tasks   # two rows, the rest kept
    .venv/bin/python scripts/task_results.py --model DIR --quick    # smoke test: subsampled, 1 seed
    .venv/bin/python scripts/task_results.py --conditions no_elmo   # only the baselines (no biLM needed)
    OMP_NUM_THREADS=1 .venv/bin/python scripts/task_results.py --probes --jobs 2   # two runs at once (2 cores)

Writes the results page (mean ± sample std over seeds of the test score, or the dev score where
a data set has no public test split; CPU seconds a run), results.json with every run, and one PNG
per task with the learned scalar-mix weights. Run directories go under --runs-dir. The frozen
biLM's layers are computed once per task and shared by all seeds (and cached on disk under
RUNS_DIR/elmo-cache for later runs).
Interrupted, it resumes: rerun the same command and every finished run (its results.json, made
with the same recipe and, with ELMo, the same biLM weights) is reused; --fresh reruns them all.
--jobs N runs N runs (and the probes) at once, each in its own process of --threads threads. While it runs, the page so far is
RUNS_DIR/results-partial.md (--page-only writes OUT from the finished runs). Tasks not run by this
invocation keep the runs recorded in the previous results.json (marked as such on the page).
--quick writes under runs/ unless --out is given, so smoke-test numbers never land in docs/.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

import torch

from elmokit.model.builtin import builtin_model_dir
from elmokit.io import atomic_write_text
from elmokit.tasks.report import plot_layer_weights, plot_probes, probe_findings, probe_tables
from elmokit.tasks.train import DEFAULT_DATA_DIR, RUN_CONFIG, TaskConfig, TaskData, load_splits, train_task
from elmokit.sources.loading import load_model
from elmokit.model.weights import model_fingerprint

QUICK = dict(max_train_sentences=300, max_eval_sentences=200, max_epochs=2, patience=1)
# name -> (task, display name, train/dev/test files under the data folder, or None for the preset's)
EXPERIMENTS = {
    "pos": ("pos", "POS (UD EWT, UPOS acc.)", None),
    "ner": ("ner", "NER (CoNLL-2003, span F1)", None),
    "wnut17": ("ner", "NER (WNUT-17, span F1)", ("wnut17/wnut17train.conll", "wnut17/emerging.dev.conll", None)),
    "sst5": ("sst5", "SST-5 (sentence acc.)", None),
    "sst2": ("sst2", "SST-2 (sentence acc.)", None),
}
TARGETS = {"ner": 85.0, "wnut17": 30.0}  # issue 18: the ELMo score each should reach (on the split shown)
PAPER_BILM_TOKENS = 800_000_000  # the 1B Word Benchmark biLM of Peters et al. (2018)
RUN_ONLY_FIELDS = ("out", "threads", "progress", "cache_dir", "device", "data_dir", "train_file", "dev_file",
                   "test_file")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="biLM directory (config.json + model.safetensors); "
                        "default: the built-in English model")
    parser.add_argument("--conditions", nargs="+", choices=["no_elmo", "elmo"], default=["no_elmo", "elmo"],
                        help="run only these (e.g. the baselines while the biLM trains); the table needs both")
    parser.add_argument("--tasks", nargs="+", choices=list(EXPERIMENTS), default=list(EXPERIMENTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--quick", action="store_true", help="smoke test: subsampled data, 2 epochs, 1 seed")
    parser.add_argument("--probes", action="store_true", help="also run the per-layer POS and WSD probes")
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help=f"(default {DEFAULT_DATA_DIR})")
    parser.add_argument("--runs-dir", type=Path, help="run directories (default runs/task_results[_quick])")
    parser.add_argument("--out", type=Path, help="results page (default docs/results.md; runs/.../results.md with --quick)")
    parser.add_argument("--no-previous", action="store_true", help="leave out the tasks not run now "
                        "(default: keep their runs from OUT's results.json)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each job (default 1)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process (default 1; "
                        "on a machine of C cores, C jobs of one thread)")
    parser.add_argument("--max-epochs", type=int, help="override the epoch cap of every run")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--page-only", action="store_true",
                        help="train nothing: write the page from the runs that finished (e.g. while a table runs)")
    parser.add_argument("--fresh", action="store_true",
                        help="rerun every run (default: a run whose results.json exists is reused, so an "
                             "interrupted table resumes where it stopped)")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.threads < 1:
        parser.error(f"--jobs and --threads must be at least 1 (got --jobs {args.jobs}, --threads {args.threads})")
    if args.quick:
        args.seeds = args.seeds[:1]
    args.runs_dir = args.runs_dir or Path("runs/task_results_quick" if args.quick else "runs/task_results")
    args.out = args.out or (args.runs_dir / "results.md" if args.quick else Path("docs/results.md"))
    return args


def base_config(name: str, args: argparse.Namespace) -> dict:
    """The TaskConfig fields every run of experiment `name` shares."""
    task, _, files = EXPERIMENTS[name]
    overrides = dict(QUICK) if args.quick else {}
    if args.max_epochs is not None:
        overrides["max_epochs"] = args.max_epochs
    if files is not None:
        data_dir = Path(args.data_dir)
        overrides.update(train_file=str(data_dir / files[0]), dev_file=str(data_dir / files[1]),
                         test_file=str(data_dir / files[2]) if files[2] else None)
    return dict(task=task, data_dir=args.data_dir, threads=args.threads, progress=not args.no_progress,
                cache_dir=str(args.runs_dir / "elmo-cache"), **overrides)


def same_recipe(recorded: dict, current: dict) -> bool:
    """Two configs make the same experiment: equal in every field both have, apart from where and
    how the run ran (a field added to TaskConfig since the run keeps its default meaning)."""
    shared = (recorded.keys() & current.keys()) - set(RUN_ONLY_FIELDS) - {"seed", "model"}
    return bool(recorded) and all(recorded[k] == current[k] for k in shared)


def finished_run(out: Path, config: TaskConfig, args: argparse.Namespace, bilm_fingerprint: str | None
                 ) -> dict | None:
    """The recorded results of a finished run of the same recipe (and, with ELMo, the same biLM
    weights: the built-in model keeps its path when a new version replaces it), to reuse; None to
    (re)run it."""
    path = out / "results.json"
    if args.fresh or not path.is_file():
        return None
    result = json.loads(path.read_text(encoding="utf-8"))
    if not same_recipe(result.get("config", {}), asdict(config)):
        print(f"{out}: recorded with another recipe; running it again", flush=True)
        return None
    if bilm_fingerprint is not None:
        run_config = out / RUN_CONFIG
        recorded = (json.loads(run_config.read_text(encoding="utf-8")).get("bilm") or {}).get("fingerprint") \
            if run_config.is_file() else None
        if recorded != bilm_fingerprint:
            print(f"{out}: trained with another biLM (weights fingerprint {recorded}, now {bilm_fingerprint}); "
                  "running it again", flush=True)
            return None
    return result | {"reused": True}


class Runner:
    """Runs of this invocation, one at a time in any order; the data (and the ELMo layers) of
    each task and condition loaded once and shared by its seeds."""

    def __init__(self, bilm, args: argparse.Namespace):
        self.bilm, self.args = bilm, args
        self.fingerprint = model_fingerprint(bilm)[:16] if bilm is not None else None
        self.splits: dict[str, dict] = {}
        self.data: dict[tuple[str, str], TaskData] = {}

    def run(self, name: str, condition: str, seed: int) -> dict | None:
        """One run: reused if finished with the same recipe, else trained (None with --page-only)."""
        base = base_config(name, self.args)
        model = str(self.args.model) if condition == "elmo" else None
        condition_dir = self.args.runs_dir / name / condition
        features_record = condition_dir / "features.json"
        config = TaskConfig(model=model, seed=seed, out=str(condition_dir / f"seed{seed}"), **base)
        result = (finished_run(Path(config.out), config, self.args, self.fingerprint if model else None)
                  if features_record.is_file() else None)
        if result is None and self.args.page_only:
            return None
        if result is None:
            data = self.task_data(name, condition, base, model, features_record)
            result = train_task(config, self.bilm if model else None, data)
        result.update(json.loads(features_record.read_text(encoding="utf-8")), experiment=name)
        print(json.dumps({k: result[k] for k in ("experiment", "elmo", "seed", "dev", "test", "cpu_seconds")}),
              flush=True)
        return result

    def task_data(self, name: str, condition: str, base: dict, model: str | None, features_record: Path) -> TaskData:
        if (name, condition) not in self.data:
            if name not in self.splits:
                self.splits[name] = load_splits(TaskConfig(**base))
            features_record.parent.mkdir(parents=True, exist_ok=True)
            with open(features_record.with_suffix(".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # another job (--jobs) computing these layers: wait, read its cache
                start = time.process_time()
                self.data[name, condition] = TaskData(TaskConfig(model=model, **base), self.splits[name],
                                                      self.bilm if model else None)
                if not features_record.is_file():  # the first computation's cost; later ones read the disk cache
                    atomic_write_text(features_record, json.dumps(
                        {"feature_cpu_seconds": round(time.process_time() - start, 1)}) + "\n")
        return self.data[name, condition]


def shown_split(runs: dict) -> str:
    """'test', or 'dev' where the data set has no public test split."""
    return "test" if runs["elmo"][0].get("test") else "dev"


def scores(runs: dict, condition: str, split: str | None = None) -> list[float]:
    metric = runs["elmo"][0]["metric"]
    return [r[split or shown_split(runs)][metric] for r in runs[condition]]


def reused_cpu_minutes(all_runs: dict) -> float:
    """CPU minutes of the runs this invocation did not make (reused or carried over), from their
    own records (with the ELMo layers' pass when every run of a task was reused)."""
    seconds = 0.0
    for runs in all_runs.values():
        for condition, results in runs.items():
            reused = [r for r in results if r.get("reused") or r.get("carried")]
            seconds += sum(r["cpu_seconds"] for r in reused)
            if condition == "elmo" and reused and len(reused) == len(results):
                seconds += results[0]["feature_cpu_seconds"]
    return seconds / 60


def findings(all_runs: dict, probes: dict | None, args: argparse.Namespace) -> list[str]:
    """What the table shows, stated from the numbers: where ELMo beats the baseline by more than
    the seeds' spread, whether the targets are reached, and which layer each probe prefers."""
    lines = ["## What it shows", ""]
    not_better = []
    for name, runs in all_runs.items():
        values = {c: scores(runs, c) for c in ("no_elmo", "elmo")}
        delta = statistics.mean(values["elmo"]) - statistics.mean(values["no_elmo"])
        spread = max(statistics.stdev(v) if len(v) > 1 else 0.0 for v in values.values())
        if min(len(v) for v in values.values()) < 2:
            verdict = "one seed so far: no spread to weigh the difference against"
        elif delta > spread:
            verdict = "ELMo is better, by more than the seeds' spread"
        else:
            not_better.append(name)
            verdict = ("ELMo is **not** clearly better: the difference is within the seeds' spread" if delta >= -spread
                       else "ELMo is **worse**")
        lines.append(f"* {EXPERIMENTS[name][1]}: {delta:+.2f} (largest std {spread:.2f}): {verdict}.")
        if name in TARGETS:
            mean, split = statistics.mean(values["elmo"]), shown_split(runs)
            reached = "reached" if mean >= TARGETS[name] else f"**not reached** ({TARGETS[name] - mean:.2f} short)"
            lines.append(f"  With ELMo, {split} span F1 {mean:.2f} against the target of {TARGETS[name]:.0f}: {reached}.")
    provenance = builtin_model_dir() / "provenance.json"
    tokens = json.loads(provenance.read_text(encoding="utf-8")).get("tokens") if provenance.is_file() else None
    if args.builtin and not_better and set(not_better) <= {"sst5", "sst2"} and tokens:
        lines += ["", "Why sentiment gains little here (our reading, not tested): the built-in biLM is small and "
                  f"read {tokens / 1e6:.2f}M tokens of 19th-century books, {PAPER_BILM_TOKENS / tokens:.0f} times less "
                  "text than the paper's news biLM, which also fed a larger classifier (BCN). Syntax and entity cues "
                  "(POS, NER) transfer from old books; the sentiment of modern film reviews likely rests on words and "
                  "usages that text rarely holds, and the task's own word vectors, trained on SST itself, already "
                  "learn the frequent ones.", ""]
    lines += probe_findings(probes)
    return lines + [""]


def mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.2f} ± {std:.2f}"


def recipe_text(runs: dict) -> str:
    """A row's recipe, from its first ELMo run's recorded config."""
    config = runs["elmo"][0].get("config")
    if config is None:
        return "not recorded with these runs (made before runs kept their config)"
    task_default = TaskConfig(**{k: v for k, v in config.items()})
    parts = [f"BiLSTM {config['hidden_dim']}", f"words {config['word_dim']}"]
    if task_default.use_chars:
        parts.append(f"char CNN {config['char_filters']}×{config['char_width']}")
    parts.append("CRF" if task_default.spec.kind == "tagger" and task_default.use_crf else
                 "softmax" if task_default.spec.kind == "tagger" else f"{config['pooling']} pooling")
    parts.append(f"≤ {config['max_epochs']} epochs, patience {config['patience']}")
    return ", ".join(parts)


def table(all_runs: dict) -> list[str]:
    lines = ["| task | split | seeds | no ELMo | ELMo | Δ | CPU s a run (no ELMo / ELMo) | ELMo layers CPU s (once) "
             "| epochs kept (ELMo) | recipe |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, runs in all_runs.items():
        split = shown_split(runs)
        cells, means = [], []
        for condition in ("no_elmo", "elmo"):
            test = scores(runs, condition)
            extra = f" ({statistics.mean(scores(runs, condition, 'dev')):.2f})" if split == "test" else ""
            cells.append(f"{mean_std(test)}{extra}")
            means.append(statistics.mean(test))
        cpu = [statistics.mean(r["cpu_seconds"] for r in runs[c]) for c in ("no_elmo", "elmo")]
        mark = " †" if runs["elmo"][0].get("carried") else ""
        epochs = "/".join(str(r["best_epoch"]) for r in runs["elmo"])
        seeds = f"{len(runs['no_elmo'])} / {len(runs['elmo'])}"
        lines.append(f"| {EXPERIMENTS[name][1]}{mark} | {split} | {seeds} | {cells[0]} | {cells[1]} | {means[1] - means[0]:+.2f} | "
                     f"{cpu[0]:.0f} / {cpu[1]:.0f} | {runs['elmo'][0]['feature_cpu_seconds']:.0f} | {epochs} | "
                     f"{recipe_text(runs)} |")
    return lines


def results_page(all_runs: dict, probes: dict | None, args: argparse.Namespace, bilm, total_cpu: float,
                 pending: list[str]) -> str:
    lines = []
    if args.quick:
        lines += ["# Task results — SMOKE TEST", "",
                  "> **Smoke test only (`--quick`): subsampled data "
                  f"({QUICK['max_train_sentences']} train / {QUICK['max_eval_sentences']} dev and test sentences), "
                  f"{QUICK['max_epochs']} epochs, one seed. These numbers show that the pipeline runs end to end; "
                  "they are not results.**", ""]
    else:
        lines += ["# ELMo in real tasks", ""]
    config = TaskConfig(task="pos")
    record = args.bilm_record
    model_name = (f"the built-in model (`gutenberg-en` {record['version']})" if args.builtin else f"`{args.model}`")
    model_name += f", weights fingerprint `{record['fingerprint']}`"
    lines += [f"biLM: {model_name} — {bilm.config.lstm.n_layers} LSTM layers, {bilm.output_dim}-dim outputs, "
              f"{bilm.n_parameters:,} parameters.", "",
              "<!-- results-bilm -->", "<!-- /results-bilm -->", "",  # scripts/sync_pages.py: is it the one that ships?
              "Each cell is the score on the split named, mean ± sample std over the runs (seeds) counted in "
              "the seeds column (no ELMo / ELMo); dev in brackets where the test split is shown. Task models: one BiLSTM layer over task word vectors (random init; "
              "a char CNN beside them where the recipe says so), with ELMo concatenated at the input ([x; ELMo]); "
              "CRF output for NER, softmax for POS, pooling for SST. The biLM is frozen; its layers are computed once "
              f"per sentence. Scalar mix with dropout {config.elmo_dropout} and λ = {config.elmo_l2} on the mix weights "
              f"(Peters et al., 2018). Adam, batch {config.batch_size}, early stopping on dev.", ""]
    lines += table(all_runs)
    if pending:
        lines += ["", "Not finished yet (no run of each condition): " + ", ".join(EXPERIMENTS[n][1] for n in pending)
                  + "; the command under \"How this was made\" resumes them."]
    missing = {name: len(args.seeds) - min(len(r) for r in runs.values()) for name, runs in all_runs.items()
               if name in args.tasks and min(len(r) for r in runs.values()) < len(args.seeds)}
    if missing:
        lines += ["", "Still to run: " + ", ".join(f"{EXPERIMENTS[n][1]}: {k} of {len(args.seeds)} seeds"
                                                   for n, k in missing.items()) + "."]
    if any(runs["elmo"][0].get("carried") for runs in all_runs.values()):
        lines += ["", "† carried over from the previous results.json: runs recorded by an earlier invocation (the "
                  "recipe column says how they were made), not rerun by this one."]
    n_layers = bilm.config.n_output_layers
    lines += ["", "## Learned layer weights (softmax of the scalar mix, mean over seeds)", "",
              "| task | " + " | ".join(f"layer {k}" for k in range(n_layers)) + " |", "| --- |" + " --- |" * n_layers]
    for name, runs in all_runs.items():
        weights = [r["layer_weights"][0] for r in runs["elmo"]]
        mean = [statistics.mean(w[k] for w in weights) for k in range(len(weights[0]))]
        lines.append(f"| {name} | " + " | ".join(f"{w:.3f}" for w in mean) + " |")
    lines += ["", "Plots: " + ", ".join(f"[{name}](results/layer_weights_{name}.png)" if not args.quick else
                                      f"`layer_weights_{name}.png`" for name in all_runs), ""]
    if probes:
        lines += probe_tables(probes, args.quick)
    lines += findings(all_runs, probes, args)
    command = " ".join(["OMP_NUM_THREADS=1 .venv/bin/python scripts/task_results.py",
                        *([] if args.builtin else [f"--model {args.model}"]),
                        *(["--quick"] if args.quick else []), f"--tasks {' '.join(args.tasks)}",
                        f"--runs-dir {args.runs_dir}", *(["--probes"] if args.probes else []),
                        *([f"--jobs {args.jobs}"] if args.jobs > 1 else [])])
    lines += ["## How this was made", "",
              f"`{command}` on {platform.machine()} ({platform.processor() or 'cpu'}), torch {torch.__version__}, "
              f"{args.jobs} job(s) of {args.threads} thread(s); CPU time (process time) of the runs{' and probes' if args.probes else ''} on this page: "
              f"{reused_cpu_minutes(all_runs) + total_cpu / 60:.1f} min ({total_cpu / 60:.1f} min in this invocation; "
              f"finished runs are reused). The runs made here are in `{args.runs_dir}/<task>/<condition>/seed<S>/` "
              "(metrics.jsonl, results.json, and the trained model).", ""]
    return "\n".join(lines)


def bilm_record(bilm, args: argparse.Namespace) -> dict | None:
    """Which biLM made the ELMo runs, recorded in results.json: a new version of the built-in model
    keeps its path, so its weights' fingerprint (and the card's version) say which one it was."""
    if bilm is None:
        return None
    card = Path(args.model) / "provenance.json"
    version = json.loads(card.read_text(encoding="utf-8")).get("version", "v1") if card.is_file() else None
    return {"builtin": args.builtin, "model": "gutenberg-en" if args.builtin else str(args.model),
            "version": version if args.builtin else None, "fingerprint": model_fingerprint(bilm)[:16]}


def previous_results(args: argparse.Namespace) -> tuple[dict, dict | None]:
    """The runs and probes of the previous results.json (not a smoke test's, and made with the same
    biLM weights), marked as carried over."""
    path = args.out.with_suffix(".json")
    if args.no_previous or not path.is_file():
        return {}, None
    previous = json.loads(path.read_text(encoding="utf-8"))
    if previous.get("quick") != args.quick:
        return {}, None
    recorded = (previous.get("bilm") or {}).get("fingerprint")
    if args.bilm_record is not None and recorded != args.bilm_record["fingerprint"]:
        print(f"{path}: made with another biLM (weights fingerprint {recorded}, now "
              f"{args.bilm_record['fingerprint']}): none of its runs or probes are carried over", flush=True)
        return {}, None
    runs = {name: {c: [r | {"carried": True} for r in results] for c, results in conditions.items()}
            for name, conditions in previous["runs"].items() if name in EXPERIMENTS}
    return runs, previous.get("probes")


def main(argv: list[str] | None = None) -> int:
    """Seed by seed (seed 1 of every task and condition first), writing RUNS_DIR/results-partial.md
    after every run once a row has a run of each condition, so that an interrupted table still
    shows what finished; OUT at the end."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.process_time()
    args.builtin = args.model is None
    if args.model is None and "elmo" in args.conditions:
        args.model = builtin_model_dir()
    bilm = load_model(args.model) if "elmo" in args.conditions else None
    args.bilm_record = bilm_record(bilm, args)
    conditions = [c for c in ("elmo", "no_elmo") if c in args.conditions]
    jobs = [(name, condition, seed) for seed in args.seeds for name in args.tasks for condition in conditions]
    if args.probes and not args.page_only and len(conditions) == 2:
        jobs.append(PROBES)
    results: dict[tuple, dict] = {}
    carried, probes = previous_results(args)
    jobs_cpu = 0.0
    for job, result, cpu in run_jobs(jobs, bilm, args):
        jobs_cpu += cpu
        if job == PROBES:
            probes = result
            continue
        if result is not None:
            results[job] = result
        if len(conditions) == 2 and result is not None and not args.page_only:
            write_results(new_runs(results, args.tasks, conditions), carried, probes, args, bilm,
                          time.process_time() - start + jobs_cpu, args.runs_dir / "results-partial.md")
    if len(conditions) < 2:
        print(f"ran {', '.join(args.conditions)} only: no table ({(time.process_time() - start + jobs_cpu) / 60:.1f} CPU min)")
        return 0
    cpu = time.process_time() - start + jobs_cpu
    written = write_results(new_runs(results, args.tasks, conditions), carried, probes, args, bilm, cpu, args.out)
    print(f"wrote {args.out}" if written else "no task has a finished run of each condition yet: no page",
          f"({cpu / 60:.1f} CPU min)")
    return 0


PROBES = ("probes",)


def new_runs(results: dict[tuple, dict], tasks: list[str], conditions: list[str]) -> dict:
    """{task: {condition: [result by seed]}} of the runs finished so far."""
    runs = {name: {c: [] for c in conditions} for name in tasks}
    for (name, condition, _), result in sorted(results.items(), key=lambda item: item[0][2]):
        runs[name][condition].append(result)
    return runs


def run_jobs(jobs: list[tuple], bilm, args: argparse.Namespace):
    """(job, result, CPU seconds of the job's own process when not this one) for every job, in the
    order given with one job at a time, else as they finish. A job is (task, condition, seed) or
    PROBES."""
    if args.jobs == 1 or args.page_only:
        runner = Runner(bilm, args)
        for job in jobs:
            yield job, (compute_probes(bilm, args) if job == PROBES else runner.run(*job)), 0.0
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process that has started OpenMP threads
    pool = ProcessPoolExecutor(args.jobs, mp_context=context, initializer=start_worker, initargs=(args,))
    try:
        futures = [pool.submit(work, job) for job in jobs]
        for future in as_completed(futures):
            yield future.result()
    except BaseException:  # a failed job or Ctrl-C: the queued jobs do not run (finished ones are kept)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


_RUNNER: Runner | None = None  # a worker process's own
_STARTUP_CPU = 0.0  # its start-up (imports, the biLM loaded), counted with its first job


def start_worker(args: argparse.Namespace) -> None:
    global _RUNNER, _STARTUP_CPU
    torch.set_num_threads(args.threads)
    _RUNNER = Runner(load_model(args.model) if "elmo" in args.conditions else None, args)
    _STARTUP_CPU = time.process_time()


def work(job: tuple) -> tuple[tuple, dict | None, float]:
    global _STARTUP_CPU
    start = time.process_time()
    result = compute_probes(_RUNNER.bilm, _RUNNER.args) if job == PROBES else _RUNNER.run(*job)
    startup, _STARTUP_CPU = _STARTUP_CPU, 0.0
    return job, result, time.process_time() - start + startup


def compute_probes(bilm, args: argparse.Namespace) -> dict:
    from elmokit.tasks.probes import pos_probe, wsd_probe

    limits = dict(max_train_sentences=1000, max_eval_sentences=300) if args.quick else {}
    return {"pos": pos_probe(bilm, args.data_dir, cache_dir=args.runs_dir / "elmo-cache",
                             progress=not args.no_progress, **limits),
            "wsd": wsd_probe(bilm, Path(args.data_dir) / "wsd" / "semcor3.0.tsv.gz",
                             max_documents=20 if args.quick else None, progress=not args.no_progress)}


def figure_dir(out: Path, args: argparse.Namespace) -> Path:
    return out.parent / ("results" if not args.quick else "")


def write_results(new_runs: dict, carried: dict, probes: dict | None, args: argparse.Namespace, bilm,
                  cpu_seconds: float, out: Path) -> bool:
    """The page `out`, its plots and results.json beside it, from the recorded runs: this
    invocation's tasks that have a run of each condition (the others are named as not finished)
    and the carried ones. While the table runs, the page after each run goes to the runs folder;
    OUT (docs/results.md) is written at the end, or now with --page-only."""
    ready = {name: runs for name, runs in new_runs.items() if all(runs.values())}
    if not ready:
        return False
    all_runs = {name: ready.get(name) or carried[name] for name in EXPERIMENTS
                if name in ready or (name in carried and name not in new_runs)}
    for name, runs in all_runs.items():
        plot_layer_weights([r["layer_weights"] for r in runs["elmo"]], f"{name}: learned ELMo layer weights",
                           figure_dir(out, args) / f"layer_weights_{name}.png")
    if probes is not None and args.probes:  # computed by this invocation: drawn beside the page that shows them
        plot_probes(probes, figure_dir(out, args) / "probes.png")
    pending = [name for name in new_runs if name not in ready]
    atomic_write_text(out, results_page(all_runs, probes, args, bilm, cpu_seconds, pending))
    records = {name: {c: [{k: v for k, v in r.items() if k not in ("carried", "reused")} for r in results]
                      for c, results in runs.items()} for name, runs in all_runs.items()}
    atomic_write_text(out.with_suffix(".json"),
                      json.dumps({"quick": args.quick, "bilm": args.bilm_record, "runs": records, "probes": probes},
                                 indent=1) + "\n")
    return True


if __name__ == "__main__":
    sys.exit(main())
