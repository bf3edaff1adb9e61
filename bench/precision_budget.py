"""How far bfloat16 and int8 inference (`ElmoEmbedder(dtype=...)`) land from float32, sentence by
sentence, on several corpora, with the built-in model: the error budget that tests/test_int8.py
asserts on UD English EWT dev and the demo sentences (every layer within 0.05 of the sentence's
largest float32 value of that layer, mean token cosine >= 0.999), measured on text it was not
chosen on.

    .venv/bin/python bench/precision_budget.py                       # -> bench/results/precision-budget.md
    .venv/bin/python bench/precision_budget.py --sentences 200 --output /tmp/budget.md

For each sentence and layer: the largest absolute difference from float32 over the layer's largest
absolute float32 value (the sentence's *error* is its worst layer's), and the mean over tokens of
the cosine between the two (the sentence's *cosine* is its worst layer's). Each sentence runs alone
(stateless, `embed_many`, the engine's default rows). The sets: UD English EWT dev (its word
forms), CoNLL-2003 dev (eng.testa), PTB valid (one sentence a line), WikiText-2 valid (one
paragraph a line, headings and paragraphs over 400 tokens skipped) and gutenberg-en's test split
(the built-in model's own held-out text), split and tokenized as `elmo prepare` does, and as raw
lines split at spaces (untokenized text): the first `--sentences` of each.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed import COSINE_BUDGET, ERROR_BUDGET, read_conllu_forms, sentence_errors  # bench/embed.py
from int8_quality import TEST_SPLIT, first_sentences  # bench/int8_quality.py: gutenberg-en's test split
from machine import busy_processes, page_header  # bench/machine.py

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
DTYPES = ("bfloat16", "int8")
MAX_PARAGRAPH = 400  # tokens: WikiText-2's longer paragraphs skipped


def read_sets(count: int) -> dict[str, list[list[str]]]:
    """The first `count` sentences of each set, as token lists."""
    from elmokit.tasks.readers import read_conll2003

    wikitext = [line.split() for line in (DATA / "wikitext-2" / "valid.txt").read_text(encoding="utf-8").splitlines()
                if line.strip() and not line.strip().startswith("=")]
    return {
        "UD English EWT dev": read_conllu_forms(DATA / "ud-english-ewt" / "en_ewt-ud-dev.conllu")[:count],
        "CoNLL-2003 dev": [sentence.tokens for sentence in read_conll2003(DATA / "conll2003" / "eng.testa")][:count],
        "PTB valid": [line.split() for line in (DATA / "ptb" / "ptb.valid.txt").read_text(encoding="utf-8")
                      .splitlines() if line.split()][:count],
        "WikiText-2 valid (paragraphs)": [tokens for tokens in wikitext if len(tokens) <= MAX_PARAGRAPH][:count],
        "gutenberg-en test": first_sentences(TEST_SPLIT, count),
        "gutenberg-en test, raw lines split at spaces": raw_lines(TEST_SPLIT, count),
    }


def raw_lines(path: Path, count: int) -> list[list[str]]:
    """The first `count` non-empty lines of a gzipped text, split at whitespace only: text as a
    user who skips tokenization sends it (punctuation and quotes stuck to the words)."""
    lines = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.split():
                lines.append(line.split())
                if len(lines) == count:
                    break
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=1000, help="the first N sentences of each set (default 1000)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "precision-budget.md")
    args = parser.parse_args()
    if args.sentences < 1:
        parser.error(f"--sentences must be at least 1, got {args.sentences}")
    torch.set_num_threads(args.threads)
    from elmokit import ElmoEmbedder

    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_before, clock = busy_processes(), time.perf_counter()
    sets = read_sets(args.sentences)
    embedders = {dtype: ElmoEmbedder(dtype=None if dtype == "float32" else dtype, device="cpu")
                 for dtype in ("float32", *DTYPES)}
    rows = []
    for name, sentences in sets.items():
        exact = embedders["float32"].embed_many(sentences)
        for dtype in DTYPES:
            errors, cosines = sentence_errors(exact, embedders[dtype].embed_many(sentences))
            worst = int(errors.argmax())
            rows.append((name, len(sentences), sum(map(len, sentences)), dtype, errors, cosines,
                         " ".join(sentences[worst])))
            print(f"{name} {dtype}: worst error {errors.max():.4f}, over budget {(errors > ERROR_BUDGET).sum()}, "
                  f"lowest cosine {cosines.min():.5f}", flush=True)
    write_page(args, rows, started, load_before, busy_processes(), time.perf_counter() - clock)


def write_page(args, rows, started: str, load_before: str, load_after: str, seconds: float) -> None:
    lines = ["# bfloat16 and int8 against float32, sentence by sentence (`bench/precision_budget.py`)", "",
             page_header("cpu", args.threads), "",
             f"Run of {started} ({seconds:.0f} s). Before: {load_before}. After: {load_after}. (The figures do not "
             "depend on the load.)", "",
             "Model: gutenberg-en (built in). Each sentence alone (`ElmoEmbedder(dtype=...).embed_many`), against "
             "`ElmoEmbedder()` (float32). A sentence's *error*: the largest absolute difference of any of its "
             "layers, as a fraction of that layer's largest float32 value; its *cosine*: the lowest of its layers' "
             f"mean token cosines. The budget tests/test_int8.py asserts (on UD English EWT dev and the demo "
             f"sentences): error <= {ERROR_BUDGET}, cosine >= {COSINE_BUDGET}.", "",
             "| set | sentences | tokens | dtype | median error | 99th percentile | worst error | "
             f"sentences over {ERROR_BUDGET} | lowest cosine | sentences under {COSINE_BUDGET} |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name, n_sentences, n_tokens, dtype, errors, cosines, _ in rows:
        over, under = int((errors > ERROR_BUDGET).sum()), int((cosines < COSINE_BUDGET).sum())
        lines.append(f"| {name} | {n_sentences:,} | {n_tokens:,} | {dtype} | {np.median(errors):.4f} | "
                     f"{np.percentile(errors, 99):.4f} | {errors.max():.4f} | {over} ({over / len(errors):.1%}) | "
                     f"{cosines.min():.5f} | {under} ({under / len(cosines):.1%}) |")
    lines += ["", "The worst sentence of each set and dtype (its tokens, truncated to 200 characters):", ""]
    lines += [f"- {name}, {dtype} ({errors.max():.4f}): `{text[:200]}`"
              for name, _, _, dtype, errors, _, text in rows]
    lines.append("")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    partial = args.output.with_name(args.output.name + ".partial")
    partial.write_text("\n".join(lines), encoding="utf-8")
    partial.replace(args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
