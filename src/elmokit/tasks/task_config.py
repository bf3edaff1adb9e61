"""What a task run is: the tasks (their model, metric and, for the presets, their data files) and
`TaskConfig`, the one object that defines a run and is saved in its directory."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

from elmokit.devices import DEVICE_HELP, DTYPES, check_device_name
from elmokit.training.config import max_threads
from elmokit.tasks.formats import CONLLU_COLUMNS, FORMATS

DATA_DIR_VARIABLE = "ELMOKIT_DATA_DIR"
DEFAULT_DATA_DIR = os.environ.get(DATA_DIR_VARIABLE, "../shared/data")
SPLITS = ("train", "dev", "test")


@dataclass(frozen=True)
class TaskSpec:
    """A task: its model ('tagger' or 'classifier'), its metric ('accuracy' or 'f1' over entity
    spans), its defaults, and for a preset the train/dev/test files under the data folder."""

    kind: str
    metric: str
    files: tuple[str, str, str] | None = None
    use_crf: bool = False
    use_chars: bool = False


TASKS = {
    "pos": TaskSpec("tagger", "accuracy", ("ud-english-ewt/en_ewt-ud-train.conllu.gz",
                                           "ud-english-ewt/en_ewt-ud-dev.conllu",
                                           "ud-english-ewt/en_ewt-ud-test.conllu")),
    "ner": TaskSpec("tagger", "f1", ("conll2003/eng.train", "conll2003/eng.testa", "conll2003/eng.testb"),
                    use_crf=True, use_chars=True),
    "classify": TaskSpec("classifier", "accuracy"),
    "sst5": TaskSpec("classifier", "accuracy", ("sst/train.txt", "sst/dev.txt", "sst/test.txt")),
    "sst2": TaskSpec("classifier", "accuracy", ("sst/train.txt", "sst/dev.txt", "sst/test.txt")),
}


def task_option(default, help: str, flag: str | None = None, choices: tuple | None = None):
    """A TaskConfig field that is also an option of `elmo task train` (`--FLAG`, by default the
    field's name with dashes) and a keyword of `elmokit.tasks.train` (the flag with underscores):
    the command line and the Python function are both generated from the fields."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices})


class TaskOptionError(ValueError):
    """A task option with a value that cannot be used. `str()` names the options as Python spells
    them, the keywords of `elmokit.tasks.train` (`max_epochs`); `as_flags()` as the command line
    does (`--max-epochs`): `elmo` prints that one. The message is written with each option as
    `<field>` (`"<max_epochs> must be >= 1"`)."""

    def __init__(self, template: str):
        self.template = template
        super().__init__(self._spelled(lambda name: _spelling(name)))

    def as_flags(self) -> str:
        return self._spelled(lambda name: "--" + _spelling(name).replace("_", "-"))

    def _spelled(self, spell) -> str:
        return re.sub(r"<(\w+)>", lambda m: spell(m.group(1)) if m.group(1) in {f.name for f in fields(TaskConfig)} else m.group(0),
                      self.template)


def _spelling(name: str) -> str:
    """The keyword of a TaskConfig field: its flag's name (train for train_file), with underscores."""
    return next(spec.metadata.get("flag") or spec.name for spec in fields(TaskConfig) if spec.name == name)


@dataclass
class TaskConfig:
    """Everything that defines a task run; saved in OUT/task_config.json.

    The data are the files `train_file`, `dev_file` (and optionally `test_file`) in any format
    `elmokit.tasks.formats` reads, or, when they are not given, the preset's files under `data_dir`.
    Paths are stored absolute, so that a run directory can be used from anywhere. Every field is an
    option of `elmo task train` and a keyword of `elmokit.tasks.train` (`task_option`).
    """

    task: str = task_option("pos", "ner (span F1, char CNN + CRF), pos (any token tagging, accuracy), classify "
                            "(one label a sentence), or a bundled data set: sst5, sst2", choices=tuple(sorted(TASKS)))
    model: str | None = task_option(
        None, "the biLM whose layers feed the task model: gutenberg-en (the built-in model), a published "
        "name, or a model directory; none for the model without ELMo")
    out: str = task_option("runs/task", "run directory to write (new or empty)")
    seed: int = task_option(1, "random seed")
    data_dir: str = task_option(DEFAULT_DATA_DIR, f"folder of the bundled data sets (or ${DATA_DIR_VARIABLE})")
    train_file: str | None = task_option(None, "training file", flag="train")
    dev_file: str | None = task_option(None, "development file (picks the epoch to keep)", flag="dev")
    test_file: str | None = task_option(None, "test file, scored once at the end", flag="test")
    data_format: str = task_option("auto", "format of the files (auto: detected from each file)", flag="format",
                                   choices=("auto", *FORMATS[:-1]))
    column: str = task_option("upos", "CoNLL-U: the column that holds the label", choices=CONLLU_COLUMNS[1:])
    max_epochs: int = task_option(50, "stop after this many epochs")
    patience: int = task_option(5, "stop after this many epochs without a better dev score")
    batch_size: int = task_option(32, "sentences a batch")
    lr: float = task_option(0.001, "Adam learning rate of the task model")
    word_dim: int = task_option(100, "size of the task's own (randomly initialised) word vectors")
    hidden_dim: int = task_option(128, "BiLSTM hidden size a direction")
    dropout: float = task_option(0.5, "dropout on the BiLSTM input and output")
    min_word_count: int = task_option(2, "task vocabulary: words seen at least this often in train")
    chars: bool | None = task_option(None, "char CNN word encoder in the tagger (default: on for NER, off for POS)")
    char_dim: int = task_option(30, "char CNN: character embedding size")
    char_filters: int = task_option(50, "char CNN: filters (the size of its word vectors)")
    char_width: int = task_option(3, "char CNN: convolution width in characters (odd)")
    elmo_dropout: float = task_option(0.5, "dropout on the ELMo representation")
    elmo_l2: float = task_option(0.001, "lambda of the L2 penalty on the scalar-mix weights (Peters et al. 2018)")
    elmo_at_output: bool = task_option(False, "also concatenate a second mix to the BiLSTM output")
    crf: bool | None = task_option(None, "CRF output layer for taggers (default: on for NER, off for POS)")
    pooling: str = task_option("max", "sentence pooling of the classifier", choices=("max", "mean"))
    finetune: bool = task_option(False, "fine-tune the biLM (with --bilm-lr)")
    bilm_lr: float = task_option(1e-4, "learning rate of the biLM with --finetune")
    max_train_sentences: int | None = task_option(None, "train on a fixed random subset of this many sentences")
    max_eval_sentences: int | None = task_option(None, "score dev and test on fixed subsets of this many sentences")
    cache_dir: str | None = task_option(None, "keep the frozen biLM's layers here to share between runs")
    threads: int | None = task_option(None, "torch threads (default: torch's; 1 is best for small models)")
    device: str = task_option("auto", f"where the biLM and the task model run: {DEVICE_HELP}; auto: the GPU "
                              "when torch sees one, else the CPU")
    bilm_dtype: str = task_option("float32", "the frozen biLM's products in bfloat16 (faster on CPUs with "
                                  "AVX512-BF16 and on GPUs, not exact), int8 (the LSTM's products; CPUs with "
                                  "VNNI or AMX, not exact) or float32", choices=tuple(sorted(DTYPES)))
    progress: bool = task_option(True, "progress bars (epoch lines are printed either way)")

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise TaskOptionError(f"<task> must be one of {sorted(TASKS)}, got {self.task!r}")
        if self.pooling not in ("max", "mean"):
            raise TaskOptionError(f"<pooling> must be max or mean, got {self.pooling!r}")
        for name in ("max_epochs", "patience", "batch_size", "word_dim", "hidden_dim", "char_dim",
                     "char_filters", "char_width"):
            if getattr(self, name) < 1:
                raise TaskOptionError(f"<{name}> must be >= 1, got {getattr(self, name)}")
        for name in ("max_train_sentences", "max_eval_sentences", "threads"):  # None: not limited / torch's
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise TaskOptionError(f"<{name}> must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.seed < 2 ** 32:
            raise TaskOptionError(f"<seed> must be in [0, 2**32) (the range torch seeds), got {self.seed}")
        if self.threads is not None and self.threads > max_threads():
            raise TaskOptionError(f"<threads> must be at most {max_threads()} (4 a CPU core of this machine, at "
                                  f"least 64), got {self.threads}")
        for name in ("lr", "bilm_lr"):
            if not 0 < getattr(self, name) < math.inf:  # NaN fails too
                raise TaskOptionError(f"<{name}> must be a number > 0, got {getattr(self, name)}")
        for name in ("dropout", "elmo_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise TaskOptionError(f"<{name}> must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.elmo_l2 < math.inf:
            raise TaskOptionError(f"<elmo_l2> must be a number >= 0, got {self.elmo_l2}")
        if self.min_word_count < 0:
            raise TaskOptionError(f"<min_word_count> must be >= 0, got {self.min_word_count}")
        if self.finetune and self.model is None:
            raise TaskOptionError("<finetune> needs an ELMo model (<model>: a name or a model directory)")
        check_device_name(self.device)
        if self.bilm_dtype not in DTYPES:
            raise TaskOptionError(f"<bilm_dtype> must be one of {sorted(DTYPES)}, got {self.bilm_dtype!r}")
        if self.finetune and self.bilm_dtype != "float32":
            raise TaskOptionError(f"<finetune> trains the biLM in float32: <bilm_dtype> {self.bilm_dtype} is for a "
                             "frozen biLM")
        if self.data_format not in ("auto", *FORMATS):
            raise TaskOptionError(f"<data_format> must be auto or one of {', '.join(FORMATS)}, got {self.data_format!r}")
        if self.column not in CONLLU_COLUMNS[1:]:
            raise TaskOptionError(f"<column> must be one of {', '.join(CONLLU_COLUMNS[1:])}, got {self.column!r}")
        self._check_files()
        self.data_dir = str(Path(self.data_dir).expanduser().resolve())
        for name in ("train_file", "dev_file", "test_file"):
            if getattr(self, name) is not None:
                try:
                    setattr(self, name, str(Path(getattr(self, name)).expanduser().resolve()))
                except (RuntimeError, OSError):  # a loop of symbolic links (RuntimeError before Python 3.13)
                    raise TaskOptionError(f"<{name}> {getattr(self, name)} is a symbolic link in a loop of links; "
                                          "give the file itself") from None

    def _check_files(self) -> None:
        if (self.train_file is None) != (self.dev_file is None):
            raise TaskOptionError("<train_file> and <dev_file> go together (dev picks the epoch to keep)")
        if self.test_file is not None and self.train_file is None:
            raise TaskOptionError("<test_file> needs <train_file> and <dev_file>")
        if self.train_file is None and self.spec.files is None:
            raise TaskOptionError(f"<task> {self.task} has no bundled data set: give <train_file> FILE and <dev_file> FILE")

    @property
    def spec(self) -> TaskSpec:
        return TASKS[self.task]

    @property
    def use_crf(self) -> bool:
        return self.spec.use_crf if self.crf is None else self.crf

    @property
    def use_chars(self) -> bool:
        return self.spec.use_chars if self.chars is None else self.chars

    @property
    def entity_tags(self) -> bool:
        """Labels are entity tags scored as spans (NER): their scheme is detected and normalized."""
        return self.spec.metric == "f1"

    def split_files(self) -> dict[str, Path]:
        """The file of each split this run has: the given files, else the preset's under data_dir
        (a clear error naming --data-dir and $ELMOKIT_DATA_DIR when that folder is missing)."""
        if self.train_file is not None:
            files = {"train": self.train_file, "dev": self.dev_file, "test": self.test_file}
            return {split: Path(path) for split, path in files.items() if path is not None}
        data_dir = Path(self.data_dir)
        if not data_dir.is_dir():
            raise FileNotFoundError(f"data folder {data_dir} not found (--task {self.task} reads its bundled data "
                                    f"from it): give --data-dir DIR or set {DATA_DIR_VARIABLE}, or give your own "
                                    "files with --train and --dev")
        return {split: data_dir / relative for split, relative in zip(SPLITS, self.spec.files)}
