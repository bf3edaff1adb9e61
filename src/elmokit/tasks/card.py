"""What a task run says about itself: its scores as tables a person reads (the end of `elmo task
train`, `elmo task eval`, `Evaluation`'s str) and its model card, OUT/README.md, written by
`train_task` from the run's own results: what it was trained on, its scores, its biLM, the
software and the command that made it, and what it is for and not for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elmokit.io import atomic_write_text
from elmokit.tasks.bilm_ref import describe
from elmokit.tasks.options import command_line
from elmokit.tasks.task_config import TaskConfig
from elmokit.training.model_card import CARD_NAME, markdown_table, software_versions

METRIC_NAMES = {"accuracy": "accuracy", "f1": "span F1"}


def text_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns aligned with spaces: the first left, the others right."""
    cells = [[str(c) for c in header]] + [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def per_type_rows(scores: dict) -> list[tuple]:
    """(type, P, R, F1, gold, predicted) of each entity type of span scores."""
    return [(name, round(s["precision"], 2), round(s["recall"], 2), round(s["f1"], 2), s["n_gold"], s["n_predicted"])
            for name, s in scores["per_type"].items()]


PER_TYPE_HEADER = ("type", "P", "R", "F1", "gold", "predicted")


def format_scores(scored: dict) -> str:
    """Scores of one file or split as lines a person reads: the overall figure, and for spans a
    P/R/F1 table by entity type."""
    source = scored.get("file") or f"{scored['split']} split"
    size = f" ({scored['n']:,} sentences)" if "n" in scored else ""
    if "accuracy" in scored:
        return f"{source}{size}: accuracy {scored['accuracy']:.2f}%"
    head = (f"{source}{size}: span F1 {scored['f1']:.2f}, precision {scored['precision']:.2f}, "
            f"recall {scored['recall']:.2f}")
    return head + "\n" + text_table(PER_TYPE_HEADER, per_type_rows(scored))


def _split_rows(results: dict) -> tuple[tuple, list[tuple]]:
    metric = results["metric"]
    splits = [(name, results[name]) for name in ("dev", "test") if results.get(name)]
    if metric == "accuracy":
        return ("split", "accuracy %"), [(name, round(s["accuracy"], 2)) for name, s in splits]
    return (("split", "span F1", "precision", "recall"),
            [(name, round(s["f1"], 2), round(s["precision"], 2), round(s["recall"], 2)) for name, s in splits])


def results_table(results: dict, out: str | Path) -> str:
    """The end of `elmo task train`: where the run is, its epochs, its scores (by entity type on
    the last split scored), its time and the ELMo layer weights."""
    header, rows = _split_rows(results)
    lines = [f"{results['task']} run in {out}: best dev epoch {results['best_epoch']} of {results['epochs']}, "
             f"{results['n_train']:,} training sentences, {results['cpu_seconds']:.0f} CPU s "
             f"({results['wall_seconds']:.0f} s wall)", "", text_table(header, rows)]
    split = next((name for name in ("test", "dev") if results.get(name)), None)
    if results["metric"] == "f1" and split and results[split]["per_type"]:
        lines += ["", f"By entity type, {split} split:", text_table(PER_TYPE_HEADER, per_type_rows(results[split]))]
    for index, weights in enumerate(results.get("layer_weights") or []):
        lines.append(f"ELMo mix {index + 1}, weights of layers 0..{len(weights) - 1}: "
                     + " ".join(f"{w:.2f}" for w in weights))
    lines.append(f"model card: {Path(out) / CARD_NAME}")
    return "\n".join(lines)


def _bilm_lines(config: TaskConfig, record: dict | None, bilm, layer_weights) -> list[str]:
    if record is None:
        return ["None: this task model reads its own word vectors only (trained without ELMo)."]
    lstm = bilm.config.lstm
    n_parameters = bilm.n_parameters
    how = "fine-tuned with the task (its weights are in task_model.safetensors)" if config.finetune else \
        "frozen (its layers computed once per sentence)"
    lines = [f"- {describe(record)}: {lstm.n_layers} LSTM layers, {2 * lstm.projection_dim}-dim vectors, "
             f"{n_parameters:,} parameters", f"- {how}, products in {config.bilm_dtype}",
             "- loading this run checks that the biLM it finds has this fingerprint; "
             "`elmokit.tasks.load(DIR, bilm=...)` or `--model` point to another copy of it"]
    for index, weights in enumerate(layer_weights or []):
        lines.append(f"- learned weights of the ELMo layers (mix {index + 1}): " + ", ".join(f"{w:.3f}" for w in weights))
    return lines


def _data_rows(files: dict[str, Path] | None, sizes: dict[str, int]) -> list[tuple]:
    """(split, where it came from, sentences): its file, or "given in memory" for splits handed to
    `train_task` as `TaskData` without files."""
    return [(split, f"`{files[split]}`" if files is not None else "given in memory", n)
            for split, n in sizes.items() if files is None or split in files]


def run_card(results: dict, config: TaskConfig, record: dict | None, bilm, sizes: dict[str, int],
             labels: Sequence[str], out: Path, files: dict[str, Path] | None = None) -> str:
    """The README.md of a task run (see the module docstring)."""
    software = software_versions()
    kind = "tagger (a label a token)" if config.spec.kind == "tagger" else "sentence classifier (a label a sentence)"
    header, rows = _split_rows(results)
    last = next((results[name] for name in ("test", "dev") if results.get(name)), None)
    per_type = markdown_table(PER_TYPE_HEADER, per_type_rows(last)) if results["metric"] == "f1" and last else ""
    example = '"Peter Smith lives in Paris."' if config.spec.kind == "tagger" else '"What a wonderful film!"'
    text = [f"# {config.task} {kind.split(' (')[0]} ({'with ELMo' if record else 'without ELMo'})", "",
            f"A {kind} trained by elmokit {software['elmokit_version']} (torch {software['torch_version']}); "
            f"labels: {', '.join(f'`{label}`' for label in labels[:40])}{' ...' if len(labels) > 40 else ''}.", "",
            "## Use it", "", "```python", "import elmokit.tasks", "",
            f'run = elmokit.tasks.load("path/to/{out.name}")',
            f"run.predict({example}, tokenize=True)", "```", "",
            f"or `elmo task predict path/to/{out.name} input.txt -o output.txt [--tokenize]`, and "
            f"`elmo task eval path/to/{out.name} labelled-file` to score it.", "",
            "## Trained on", "", markdown_table(("split", "file", "sentences"), _data_rows(files, sizes)),
            f"Early stopping on dev: epoch {results['best_epoch']} of {results['epochs']} kept.", "",
            "## Scores", "", markdown_table(header, rows), per_type,
            "## The biLM (ELMo)", "", *_bilm_lines(config, record, bilm, results.get("layer_weights")), "",
            "## Software and command", "",
            f"elmokit {software['elmokit_version']}, torch {software['torch_version']}, "
            f"Python {software['python_version']} (also in task_config.json).", "",
            "```", command_line(config), "```", "",
            "## Intended use and limits", "",
            f"- For text like its training file: {results['n_train']:,} sentences. Expect lower scores on other "
            "domains, genres, periods or languages; the scores above are on held-out sentences of the same data.",
            f"- It predicts only the labels above; {'entity spans are read from BIO tags' if config.entity_tags else 'no other label can come out'}.",
            "- It reads tokens: give raw text with `tokenize=True` (the Moses tokenizer) or tokens split as its "
            "training data were.",
            "- Confidences are the model's own probabilities, not calibrated against held-out data.",
            "- It has not been checked for biases of its data; do not use it alone for decisions about people.", ""]
    return "\n".join(text)


def write_run_card(out: Path, config: TaskConfig, results: dict, record: dict | None, bilm,
                   sizes: dict[str, int], labels: Sequence[str], files: dict[str, Path] | None = None) -> Path:
    """OUT/README.md (temp + rename), from the run's config and results; `files`: the file each
    split was read from (None: the splits were given in memory)."""
    atomic_write_text(Path(out) / CARD_NAME, run_card(results, config, record, bilm, sizes, labels, Path(out), files))
    return Path(out) / CARD_NAME
