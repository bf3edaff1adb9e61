"""The options of a task run, defined once: the fields of `TaskConfig` (`task_option`). The
command line (`elmo task train --max-epochs 5`) and the Python function
(`elmokit.tasks.train(max_epochs=5)`) are both generated from them, and a run's model card shows
the command that remakes it, written back from its config (`command_line`).

    field           flag              keyword
    train_file      --train           train
    data_format     --format          format
    max_epochs      --max-epochs      max_epochs
    progress        --no-progress     progress=False
"""

from __future__ import annotations

import difflib
import shlex
from pathlib import Path
from dataclasses import Field, fields
from typing import Any

from elmokit.model.builtin import BUILTIN_MODEL
from elmokit.tasks.task_config import TaskConfig

DEFAULT_BILM = BUILTIN_MODEL  # what --model and model= mean when not given
NO_BILM = "none"  # --model none: the task model without ELMo
REQUIRED = ("task", "out")  # options without a default on the command line and in Python


def config_fields() -> list[Field]:
    """The fields of TaskConfig, each an option, in the order `--help` lists them."""
    return list(fields(TaskConfig))


def flag(spec: Field) -> str:
    """`--max-epochs` for max_epochs, `--train` for train_file (its metadata's flag)."""
    return "--" + (spec.metadata.get("flag") or spec.name).replace("_", "-")


def keyword(spec: Field) -> str:
    """The keyword of `elmokit.tasks.train` for a field: its flag, with underscores."""
    return flag(spec)[2:].replace("-", "_")


KEYWORDS = {keyword(spec): spec.name for spec in fields(TaskConfig)}  # keyword -> field


def config_from_values(values: dict[str, Any]) -> TaskConfig:
    """A TaskConfig from option values by field name (the command line's namespace, or the
    keywords mapped by `config_from_keywords`): --model defaults to the built-in model, and
    `none` (or None given explicitly from Python) means no ELMo."""
    values = dict(values)
    model = values.get("model", DEFAULT_BILM)
    values["model"] = None if model is None or str(model).lower() == NO_BILM else str(model)
    for name in ("out", "data_dir", "train_file", "dev_file", "test_file", "cache_dir"):
        if values.get(name) is not None:
            values[name] = str(values[name])
    return TaskConfig(**values)


def config_from_keywords(keywords: dict[str, Any]) -> TaskConfig:
    """`config_from_values` of the keywords of `elmokit.tasks.train`; an unknown keyword is a
    TypeError naming the closest ones."""
    unknown = sorted(set(keywords) - set(KEYWORDS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(KEYWORDS), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise TypeError(f"train() got an unexpected keyword argument {unknown[0]!r}{hint}; it takes "
                        f"{', '.join(KEYWORDS)}, overwrite and resume")
    missing = [name for name in REQUIRED if name not in keywords]
    if missing:
        raise TypeError(f"train() needs {' and '.join(f'{name}=' for name in missing)} (e.g. task='ner', "
                        "out='runs/ner')")
    return config_from_values({KEYWORDS[name]: value for name, value in keywords.items()})


def default_value(spec: Field) -> Any:
    """The default of an option on the command line and in Python (the model: the built-in one)."""
    return DEFAULT_BILM if spec.name == "model" else spec.default


def command_line(config: TaskConfig) -> str:
    """`elmo task train ...` with every option whose value is not its default: the command that
    makes this run again (paths as they were resolved: absolute; the data folder only where the
    run read a bundled data set)."""
    words = ["elmo", "task", "train"]
    for spec in fields(TaskConfig):
        value, default = getattr(config, spec.name), default_value(spec)
        if spec.name == "model":
            value = NO_BILM if value is None else value
        if spec.name == "data_dir":  # stored resolved
            default = str(Path(default).expanduser().resolve())
        skip = value == default or spec.name == "progress" or (spec.name == "data_dir" and config.train_file is not None)
        if skip and spec.name not in ("task", "out"):
            continue
        if isinstance(value, bool):
            words.append(flag(spec) if value else "--no-" + flag(spec)[2:])
        else:
            words += [flag(spec), str(value)]
    return shlex.join(words)
