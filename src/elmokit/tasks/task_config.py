"""What a task run is: the tasks (their model, metric and, for the presets, their data files) and
`TaskConfig`, the one object that defines a run and is saved in its directory."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from elmokit.devices import DTYPES, check_device_name
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


@dataclass
class TaskConfig:
    """Everything that defines a task run; saved in OUT/task_config.json.

    The data are the files `train_file`, `dev_file` (and optionally `test_file`) in any format
    `elmokit.tasks.formats` reads, or, when they are not given, the preset's files under `data_dir`.
    Paths are stored absolute, so that a run directory can be used from anywhere.
    """

    task: str = "pos"
    model: str | None = None  # biLM directory; None = no ELMo
    out: str = "runs/task"
    seed: int = 1
    data_dir: str = DEFAULT_DATA_DIR
    train_file: str | None = None
    dev_file: str | None = None
    test_file: str | None = None
    data_format: str = "auto"  # one of formats.FORMATS, or auto-detected from each file
    column: str = "upos"  # CoNLL-U: the column that holds the label
    max_epochs: int = 50
    patience: int = 5
    batch_size: int = 32
    lr: float = 0.001
    word_dim: int = 100
    hidden_dim: int = 128
    dropout: float = 0.5
    min_word_count: int = 2
    chars: bool | None = None  # char CNN word encoder; None: the task's default (NER yes)
    char_dim: int = 30
    char_filters: int = 50
    char_width: int = 3
    elmo_dropout: float = 0.5
    elmo_l2: float = 0.001  # lambda of Peters et al. (2018) §3.3
    elmo_at_output: bool = False
    crf: bool | None = None  # None: the task's default (NER yes, POS no)
    pooling: str = "max"
    finetune: bool = False
    bilm_lr: float = 1e-4
    max_train_sentences: int | None = None  # subsample (the same subset for every seed)
    max_eval_sentences: int | None = None
    cache_dir: str | None = None  # share the frozen biLM's layers between runs
    threads: int | None = None  # torch intra-op threads; 1 is fastest for small models on a busy CPU
    device: str = "cpu"  # where the biLM and the task model run: cpu, cuda, cuda:N, auto
    bilm_dtype: str = "float32"  # the frozen biLM's products: float32, or bfloat16 (faster, not exact)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"--task must be one of {sorted(TASKS)}, got {self.task!r}")
        if self.pooling not in ("max", "mean"):
            raise ValueError(f"--pooling must be max or mean, got {self.pooling!r}")
        for name in ("max_epochs", "patience", "batch_size", "word_dim", "hidden_dim", "char_dim",
                     "char_filters", "char_width"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_train_sentences", "max_eval_sentences", "threads"):  # None: not limited / torch's
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "bilm_lr"):
            if not 0 < getattr(self, name) < math.inf:  # NaN fails too
                raise ValueError(f"--{name.replace('_', '-')} must be a number > 0, got {getattr(self, name)}")
        for name in ("dropout", "elmo_dropout"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.elmo_l2 < math.inf:
            raise ValueError(f"--elmo-l2 must be a number >= 0, got {self.elmo_l2}")
        if self.min_word_count < 0:
            raise ValueError(f"--min-word-count must be >= 0, got {self.min_word_count}")
        if self.finetune and self.model is None:
            raise ValueError("--finetune needs an ELMo model (--model DIR)")
        check_device_name(self.device)
        if self.bilm_dtype not in DTYPES:
            raise ValueError(f"--bilm-dtype must be one of {sorted(DTYPES)}, got {self.bilm_dtype!r}")
        if self.finetune and self.bilm_dtype != "float32":
            raise ValueError(f"--finetune trains the biLM in float32: --bilm-dtype {self.bilm_dtype} is for a "
                             "frozen biLM")
        if self.data_format not in ("auto", *FORMATS):
            raise ValueError(f"--format must be auto or one of {', '.join(FORMATS)}, got {self.data_format!r}")
        if self.column not in CONLLU_COLUMNS[1:]:
            raise ValueError(f"--column must be one of {', '.join(CONLLU_COLUMNS[1:])}, got {self.column!r}")
        self._check_files()
        self.data_dir = str(Path(self.data_dir).expanduser().resolve())
        for name in ("train_file", "dev_file", "test_file"):
            if getattr(self, name) is not None:
                setattr(self, name, str(Path(getattr(self, name)).expanduser().resolve()))

    def _check_files(self) -> None:
        if (self.train_file is None) != (self.dev_file is None):
            raise ValueError("--train and --dev go together (dev picks the epoch to keep)")
        if self.test_file is not None and self.train_file is None:
            raise ValueError("--test needs --train and --dev")
        if self.train_file is None and self.spec.files is None:
            raise ValueError(f"--task {self.task} has no bundled data set: give --train FILE and --dev FILE")

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
