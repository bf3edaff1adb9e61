"""Model cards: the README.md that elmokit writes into every model directory it makes (`elmo
export --native`, a training run's best/) and, through `elmokit.tasks.card`, every task run.

A card says what the model is, what it was trained on and how well it does, which software wrote
it, the command that did, and what it is for and not for. Every figure on it is read from the
files written beside it (provenance.json, config.json), never typed.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from elmokit.io import atomic_write_text

CARD_NAME = "README.md"


def software_versions() -> dict[str, str]:
    """The versions of the software writing a model: recorded in its config and shown on its card."""
    from elmokit import __version__

    return {"elmokit_version": __version__, "torch_version": torch.__version__,
            "python_version": platform.python_version()}


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; numbers right-aligned."""
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.2f}"
        return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)

    aligns = ["---:" if rows and all(isinstance(row[i], (int, float)) or _numeric(row[i]) for row in rows) else "---"
              for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(aligns) + "|"]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _numeric(value: Any) -> bool:
    try:
        float(str(value).replace(",", ""))
    except ValueError:
        return False
    return True


def _shape(config) -> str:
    lstm, cnn = config.lstm, config.char_cnn
    filters = sum(count for _, count in cnn.filters)
    return (f"{lstm.n_layers} LSTM layers of {lstm.cell_dim} cells projected to {lstm.projection_dim} a direction, "
            f"a character CNN of {filters:,} filters and {cnn.n_highway} highway layers: "
            f"{lstm.n_layers + 1} layers of {2 * lstm.projection_dim}-dim vectors a token")


def _training_lines(card: dict[str, Any]) -> list[str]:
    if "tokens" not in card:
        return ["Not recorded: this directory was written from a model that came without its training record "
                "(provenance.json)."]
    files = card.get("train_files") or []
    lines = [f"- written by `{card.get('trained_by', 'elmo train')}` from {card.get('model', 'the best model')}",
             f"- {card['tokens']:,} training tokens in {card['steps']:,} steps ({card.get('epochs', '?')} epochs)",
             f"- training files: {', '.join(f'`{f}`' for f in files) if files else 'not recorded'}",
             f"- vocabulary of the softmax: `{card['vocab']}`" if card.get("vocab") else ""]
    return [line for line in lines if line]


REPORTED_SENTENCES = 5000  # a shipped model's perplexities: `elmo perplexity` on this many first sentences a split


def reported_perplexities(card: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{split: {"forward_ppl", "backward_ppl", "ppl", "n_tokens"}} of the evaluations a model's
    provenance records on the first REPORTED_SENTENCES sentences of its "valid" and "test" splits
    (scripts/build_builtin.sh measures them): the figures the README's model table and the card
    both show. {} when none is recorded."""
    return {split: card[key] for split in ("valid", "test")
            if isinstance(card.get(key := f"{split}_first_{REPORTED_SENTENCES}_sentences"), dict)}


def _metrics_lines(card: dict[str, Any]) -> list[str]:
    reported = reported_perplexities(card)
    if reported:
        rows = [(split, record["forward_ppl"], record["backward_ppl"], record["ppl"], record.get("n_tokens", "?"))
                for split, record in reported.items()]
        return [markdown_table(("split", "forward ppl", "backward ppl", "mean ppl", "tokens"), rows)
                + f"`elmo perplexity` (full softmax) on the first {REPORTED_SENTENCES:,} sentences of each split."]
    rows = [(name, card[f"{key}_forward_ppl"], card[f"{key}_backward_ppl"], card[f"{key}_ppl"])
            for key, name in (("valid", "validation"), ("test", "test")) if f"{key}_ppl" in card]
    if not rows:
        return ["No perplexity recorded with this model (`elmo perplexity DIR FILE` measures it)."]
    files = card.get("valid_files")
    where = f" Validation files: {', '.join(f'`{f}`' for f in files)}." if files else ""
    return [markdown_table(("split", "forward ppl", "backward ppl", "mean ppl"), rows) + where]


def bilm_card(config, card: dict[str, Any], n_parameters: int, files: dict[str, str],
              command: str | None = None, usage: Sequence[str] = ()) -> str:
    """The README.md of a biLM model directory: `config` its ElmoConfig, `card` its provenance
    (with the software versions), `files` name -> what it holds, `command` what wrote it, `usage`
    Markdown lines that open its "Use it" section (another library's way to load it)."""
    made_by = command or card.get("trained_by", "elmokit")
    text = [f"# ELMo biLM ({n_parameters:,} parameters)", "",
            "A bidirectional language model whose layers give contextual word vectors (ELMo). Written by "
            f"elmokit {card['elmokit_version']} with torch {card['torch_version']}.", "",
            "## Use it", "", *usage, "```python", "from elmokit import ElmoEmbedder", "",
            'embedder = ElmoEmbedder("path/to/this/directory")',
            'layers = embedder.embed_sentence(["The", "cat", "sat"])  # (layers, tokens, dims)', "```", "",
            "or `elmo embed FILE --model path/to/this/directory`, or as the biLM of a task model "
            "(`elmo task train --model path/to/this/directory`).", "",
            "## The model", "", _shape(config) + ".", "",
            markdown_table(("file", "holds"), sorted(files.items())),
            "## Training", "", *_training_lines(card), "",
            "## Perplexity", "", *_metrics_lines(card), "",
            "## Software and command", "",
            f"elmokit {card['elmokit_version']}, torch {card['torch_version']}, Python {card['python_version']}.", "",
            "```", made_by, "```", "",
            "## Intended use and limits", "",
            "- For features of text like the text it was trained on (the training files above): its vectors "
            "and perplexity are worse on other domains, genres, periods or languages.",
            "- Its input is tokenized text; tokenize as its training corpus was (elmokit's `--tokenize` uses "
            "the Moses tokenizer).",
            "- A language model repeats the associations of its corpus, biases included; it has not been "
            "checked for them. Do not use its vectors alone for decisions about people.",
            "- Task models record this model's fingerprint: a changed copy of this directory is refused by "
            "the task runs trained on it.", ""]
    return "\n".join(text)


def write_bilm_card(directory: str | Path, config, card: dict[str, Any], n_parameters: int,
                    command: str | None = None, softmax: bool = True) -> Path:
    """Write `bilm_card` as DIRECTORY/README.md (temp + rename), describing the files there."""
    directory = Path(directory)
    weights = "the weights of the biLM and its softmax" if softmax else "the weights of the biLM (no softmax: for embedding)"
    described = {"config.json": "the shapes (ElmoConfig)", "model.safetensors": weights,
                 "vocab.txt": "the vocabulary of the softmax, one word a line",
                 "provenance.json": "what made it: training files, tokens, perplexity, software versions"}
    files = {name: text for name, text in described.items() if (directory / name).is_file()}
    atomic_write_text(directory / CARD_NAME, bilm_card(config, card, n_parameters, files, command))
    return directory / CARD_NAME
