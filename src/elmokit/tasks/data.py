"""A task's data: reading its splits, its vocabularies (words, characters, labels), and batches.

Labels are strings everywhere (tags, or class names such as SST's "0".."4"); the models see
their index in the label list saved with the run.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from elmokit.devices import resolve_device
from elmokit.model.bilm import BiLM
from elmokit.tasks import readers
from elmokit.tasks.charcnn import build_char_vocab, encode_chars
from elmokit.tasks.encoder import Batch
from elmokit.tasks.features import cached_layers, pad_layers
from elmokit.tasks.formats import read_examples, resolve_format
from elmokit.tasks.task_config import TaskConfig

PAD, UNK = "<pad>", "<unk>"


# ---------------------------------------------------------------------------------------------
# Reading the splits
# ---------------------------------------------------------------------------------------------
def read_split(config: TaskConfig, path: Path) -> tuple[list, dict]:
    """The examples of one file and what was found in it ({'format', 'n', 'scheme'}): the
    presets' own files through their readers, any other file through `formats`."""
    if config.train_file is None:
        if config.task == "pos":
            return readers.read_conllu(path), {"format": "conllu"}
        if config.task == "ner":
            return readers.read_conll2003(path), {"format": "conll2003", "scheme": "iob1"}
        return readers.read_sst_trees(path, binary=config.task == "sst2"), {"format": "sst trees"}
    fmt = resolve_format(path, config.spec.kind, config.data_format, config.column)
    return read_examples(path, config.spec.kind, fmt, entity_tags=config.entity_tags)


def subsample(examples: list, limit: int | None) -> list:
    """A fixed random subset (seed 0, file order kept) of at most `limit` examples."""
    if limit is None or len(examples) <= limit:
        return examples
    keep = sorted(random.Random(0).sample(range(len(examples)), limit))
    return [examples[i] for i in keep]


def load_splits(config: TaskConfig, log=None) -> dict[str, list]:
    """Every split the run has, subsampled if asked. `log(line)` hears what each file held."""
    splits = {}
    for split, path in config.split_files().items():
        examples, info = read_split(config, path)
        limit = config.max_train_sentences if split == "train" else config.max_eval_sentences
        splits[split] = subsample(examples, limit)
        if log is not None:
            scheme = info.get("scheme")
            scheme = "" if scheme is None else ", BIO tags" if scheme == "bio" else f", {scheme.upper()} tags read as BIO"
            log(f"{split}: {path} ({info['format']}{scheme}): {len(splits[split])} examples")
    return splits


# ---------------------------------------------------------------------------------------------
# Vocabularies and batches
# ---------------------------------------------------------------------------------------------
def gold_labels(example) -> list[str] | str:
    """A tagged sentence's tags, or a labelled sentence's label, as strings."""
    return list(example.tags) if hasattr(example, "tags") else str(example.label)


def build_words(examples: Sequence, min_count: int) -> list[str]:
    counts = Counter(token for example in examples for token in example.tokens)
    return [PAD, UNK, *sorted(word for word, count in counts.items() if count >= min_count)]


def build_labels(config: TaskConfig, examples: Sequence) -> list[str]:
    """The label set: SST's fixed classes, else every label of the training examples, sorted."""
    if config.train_file is None and config.task in ("sst5", "sst2"):
        return [str(k) for k in range(2 if config.task == "sst2" else 5)]
    if config.spec.kind == "classifier":
        return sorted({str(example.label) for example in examples})
    return sorted({tag for example in examples for tag in example.tags})


@dataclass
class Vocabularies:
    """The words, labels and (for a char CNN) characters a task model indexes; saved with it."""

    words: list[str]
    labels: list[str]
    chars: list[str] | None = None
    word_index: dict[str, int] = field(init=False, repr=False)
    label_index: dict[str, int] = field(init=False, repr=False)
    char_index: dict[str, int] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.word_index = {word: i for i, word in enumerate(self.words)}
        self.label_index = {label: i for i, label in enumerate(self.labels)}
        self.char_index = {char: i for i, char in enumerate(self.chars)} if self.chars is not None else None

    @classmethod
    def build(cls, config: TaskConfig, train: Sequence) -> Vocabularies:
        chars = build_char_vocab([e.tokens for e in train]) if config.use_chars else None
        return cls(build_words(train, config.min_word_count), build_labels(config, train), chars)

    def batch(self, sentences: Sequence[Sequence[str]], labels: Sequence | None = None,
              layers: Sequence[torch.Tensor] | None = None, tagging: bool = True,
              device: torch.device | str = "cpu") -> Batch:
        """A Batch of token lists; `labels` (strings; an unknown one becomes 0) or none (prediction:
        zeros); `layers` the sentences' cached ELMo layers, or None."""
        lengths = [len(sentence) for sentence in sentences]
        n_positions = max(lengths)
        word_ids = [[self.word_index.get(t, 1) for t in s] + [0] * (n_positions - len(s)) for s in sentences]
        word_ids = torch.tensor(word_ids, dtype=torch.long, device=device)  # (B, T)
        mask = torch.arange(n_positions, device=device) < torch.tensor(lengths, device=device).unsqueeze(1)
        if not tagging:
            label_ids = [self.label_index.get(label, 0) for label in labels] if labels else [0] * len(sentences)
            label_tensor = torch.tensor(label_ids, dtype=torch.long, device=device)  # (B,)
        else:
            rows = [[self.label_index.get(t, 0) for t in row] + [0] * (n_positions - len(row))
                    for row in labels] if labels else [[0] * n_positions for _ in sentences]
            label_tensor = torch.tensor(rows, dtype=torch.long, device=device)  # (B, T)
        char_ids = encode_chars(sentences, self.char_index, n_positions, device) if self.chars is not None else None
        return Batch(word_ids, mask, label_tensor, [list(s) for s in sentences],
                     pad_layers(layers).to(device) if layers is not None else None, char_ids)


class TaskData:
    """Examples, vocabularies and (for a frozen biLM) the cached layers of every split; `files`,
    the file each split was read from (None: given in memory; the run's card says which)."""

    def __init__(self, config: TaskConfig, splits: dict[str, list], bilm: BiLM | None,
                 layers: dict[str, list[torch.Tensor]] | None = None, vocabularies: Vocabularies | None = None,
                 files: dict[str, Path] | None = None):
        self.splits = splits
        self.files = files
        self.tagging = config.spec.kind == "tagger"
        self.device = resolve_device(config.device)  # where batches go
        self.vocabularies = vocabularies or Vocabularies.build(config, splits["train"])
        self.layers = layers
        if layers is None and bilm is not None and not config.finetune:
            self.layers = {split: cached_layers(bilm, [e.tokens for e in examples], config.cache_dir,
                                                progress=config.progress, desc=f"ELMo {split}", device=self.device,
                                                bilm_dtype=config.bilm_dtype)
                           for split, examples in splits.items()}

    @property
    def vocab(self) -> list[str]:
        return self.vocabularies.words

    @property
    def labels(self) -> list[str]:
        return self.vocabularies.labels

    def batches(self, split: str, batch_size: int, shuffle: bool = False, rng: random.Random | None = None):
        """Batches of `split` in file order, or shuffled with `rng` (`shuffled_batches`)."""
        examples = self.splits[split]
        if shuffle:
            order = shuffled_batches([len(e.tokens) for e in examples], batch_size, rng)
        else:
            order = [list(range(start, min(start + batch_size, len(examples))))
                     for start in range(0, len(examples), batch_size)]
        for indices in order:
            layers = [self.layers[split][i] for i in indices] if self.layers is not None else None
            chosen = [examples[i] for i in indices]
            yield self.vocabularies.batch([e.tokens for e in chosen], [gold_labels(e) for e in chosen], layers,
                                          self.tagging, self.device)


def shuffled_batches(lengths: Sequence[int], batch_size: int, rng: random.Random, pool_batches: int = 50
                     ) -> list[list[int]]:
    """Training batches: the examples shuffled, then sorted by length within pools of
    `pool_batches` batches so that a batch holds sentences of similar length (little padding
    for the CRF and the mixes to step through), and the batches shuffled."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches = []
    pool_size = batch_size * pool_batches
    for start in range(0, len(order), pool_size):
        pool = sorted(order[start:start + pool_size], key=lambda i: lengths[i])
        batches += [pool[k:k + batch_size] for k in range(0, len(pool), batch_size)]
    rng.shuffle(batches)
    return batches
