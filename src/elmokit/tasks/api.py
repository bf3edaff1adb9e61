"""Training a task model from Python with the options of `elmo task train`:

    import elmokit.tasks

    run = elmokit.tasks.train(task="ner", train="train.conll", dev="dev.conll", out="runs/ner", max_epochs=10)
    run.predict("Peter Smith lives in Paris.", tokenize=True)

Every keyword is a flag of `elmo task train` with underscores (`--max-epochs 10` is
`max_epochs=10`, `--no-crf` is `crf=False`, `--no-progress` is `progress=False`): both are made
from the fields of `TaskConfig` (`elmokit.tasks.options`), and both run `train_into` below.
"""

from __future__ import annotations

from pathlib import Path

from elmokit.io import output_lock, refuse_overwrite, removed_if_unfinished
from elmokit.tasks.options import config_from_keywords
from elmokit.tasks.run import TaskRun, load
from elmokit.tasks.task_config import TaskConfig
from elmokit.tasks.train import CHECKPOINT, RUN_LOCK, train_task


def train_into(config: TaskConfig, overwrite: bool = False, resume: bool = False) -> dict:
    """Train `config` into `config.out`, which must be new or empty unless `overwrite`; a run that
    fails before its first epoch is done leaves nothing half-made there, one interrupted later
    keeps OUT/task_checkpoint.pt, which `resume` continues. One process at a time writes a run:
    OUT/task.lock (`elmokit.io.output_lock`) is held throughout, and `load` refuses a run while it
    is held. Returns the results (OUT/results.json)."""
    out = Path(config.out)
    if resume and overwrite:  # as elmo train and elmo embed
        raise ValueError("give resume=True (continue the interrupted run) or overwrite=True (start over), not both")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file (out= in Python); give the directory to write the run in")
    with output_lock(out / RUN_LOCK, f"run directory {out}"):
        if resume and not (out / CHECKPOINT).is_file():
            raise FileNotFoundError(f"nothing to resume in {out}: no {CHECKPOINT} there (a run interrupted after "
                                    "its first epoch has one; a finished run has none)")
        if not resume:
            earlier = [path for path in sorted(out.iterdir()) if path.name != RUN_LOCK]
            refuse_overwrite(earlier, overwrite, f"a run in {out}")
            (out / CHECKPOINT).unlink(missing_ok=True)  # an earlier run's: not this one's to keep
        with removed_if_unfinished(out, keep_if=("results.json", CHECKPOINT)):
            return train_task(config, resume=resume)


def train_task_model(*, overwrite: bool = False, resume: bool = False, **options) -> TaskRun:
    """Train a task model as `elmo task train` does and return it loaded (`TaskRun`; its
    `results` hold the scores). Keywords: the flags of `elmo task train` with underscores, e.g.
    `task="ner", train="train.conll", dev="dev.conll", test=None, out="runs/ner", model="gutenberg-en"`
    (None or "none": no ELMo), `max_epochs=50`, `crf=None`, `progress=True`; see `elmo task
    train --help` for all of them and their defaults. `overwrite` replaces a run already in `out`;
    `resume` continues one that was interrupted (the same options)."""
    config = config_from_keywords(options)
    train_into(config, overwrite, resume)
    return load(config.out, config.device)
