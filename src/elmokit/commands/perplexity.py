"""`elmo perplexity`: forward, backward and average perplexity of text under a trained biLM."""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

from elmokit.commands.common import add_device_arguments, add_progress_argument, device_from_args


def register(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "perplexity", help="perplexity of tokenized text under a trained language model",
        usage="elmo perplexity [MODEL] FILE [FILE ...] [options]",
        description="Print the forward, backward and average perplexity (full softmax) of tokenized "
                    "files, one sentence a line, with sentences packed into rows and the LSTM state "
                    "carried as in training. MODEL, when the first argument is a directory, is a model "
                    "directory with its softmax and vocab.txt (a run's best/) or a training run "
                    "directory; without it, the built-in English model scores the files.")
    parser.add_argument("inputs", nargs="+", metavar="[MODEL] FILE",
                        help="an optional model or run directory, then tokenized files or globs (plain or .gz)")
    parser.add_argument("--model", type=Path, metavar="MODEL",
                        help="the model or run directory, as the optional first argument (then every "
                             "argument is a file)")
    parser.add_argument("--max-sentences", type=int, metavar="N",
                        help="score only the first N sentences of the files (in the order given)")
    parser.add_argument("--batch-size", type=int, default=64, help="rows of a batch (default: 64)")
    parser.add_argument("--unroll-steps", type=int, default=20, help="positions of a window (default: 20)")
    parser.add_argument("--per-sentence", type=Path, metavar="OUT",
                        help="also score every sentence alone (fresh state) into OUT: TSV, or JSON "
                             "lines if OUT ends in .jsonl")
    parser.add_argument("--overwrite", action="store_true", help="replace the --per-sentence file if it exists")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_progress_argument(parser)
    add_device_arguments(parser)
    parser.set_defaults(func=run)


def resolve_model_dir(path: Path) -> Path:
    """A model directory itself, or the best/ model of a training run directory."""
    from elmokit.training.checkpoint import is_model_dir
    from elmokit.training.loop import BEST_DIR

    if is_model_dir(path):
        return path
    if is_model_dir(path / BEST_DIR):
        return path / BEST_DIR
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    from elmokit.sources.tfhub import advice

    raise FileNotFoundError(f"{path}: neither a model directory (config.json + model.safetensors) "
                            f"nor a training run with a {BEST_DIR}/ model" + advice(path))


def split_inputs(inputs: list[str]) -> tuple[Path | None, list[str]]:
    """(model directory, file patterns): the first input when it is a directory, else None (the
    built-in model). A first input that does not exist, is no glob and has files after it was
    meant as MODEL: an error naming it."""
    first = Path(inputs[0])
    if first.is_dir():
        if len(inputs) == 1:
            raise ValueError(f"{inputs[0]} is a directory (taken as MODEL) and no FILE follows it; "
                             "give the tokenized files to score after the model")
        return resolve_model_dir(first), inputs[1:]
    if len(inputs) > 1 and not first.exists() and not glob.has_magic(inputs[0]):
        raise FileNotFoundError(f"{inputs[0]}: no such model directory or file (MODEL, when given, is a "
                                "model directory or a training run directory)")
    return None, inputs


def builtin_scoring_model() -> Path:
    """The built-in model's directory, if it ships with its softmax (it can score text)."""
    from safetensors import safe_open

    from elmokit.model.builtin import builtin_model_dir

    try:
        directory = builtin_model_dir()
    except FileNotFoundError:  # its own advice (an options file) does not apply to scoring
        raise FileNotFoundError("this installation has no built-in model; give a MODEL directory (a run "
                                "directory, or `elmo export RUN --native DIR`) before the files") from None
    with safe_open(directory / "model.safetensors", "pt") as weights:
        if "softmax.weight" not in weights.keys():
            raise ValueError(f"the built-in model of this installation ({directory}) ships without its softmax, "
                             "so it cannot score text; give a MODEL directory that has one (a run directory, "
                             "or `elmo export RUN --native DIR`) before the files")
    return directory


def run(args: argparse.Namespace) -> int:
    from elmokit.training.checkpoint import load_model_dir
    from elmokit.textfiles import expand_paths
    from elmokit.io import refuse_output_over_input, refuse_overwrite
    from elmokit.training.perplexity import corpus_perplexity
    from elmokit.training.vocab import Vocabulary

    if args.max_sentences is not None and args.max_sentences < 1:
        raise ValueError(f"--max-sentences must be at least 1, got {args.max_sentences}")
    if args.per_sentence is not None:
        refuse_overwrite([args.per_sentence], args.overwrite)
    model_dir, patterns = (resolve_model_dir(args.model), args.inputs) if args.model else split_inputs(args.inputs)
    files = expand_paths(patterns)  # a missing file is named before any model is loaded
    refuse_output_over_input([*files, *([model_dir] if model_dir else [])], [args.per_sentence] if args.per_sentence else [])
    model, vocab_path = load_model_dir(model_dir or builtin_scoring_model())
    vocab = Vocabulary.load(vocab_path)
    device = device_from_args(args)
    result = corpus_perplexity(model, vocab, files, args.batch_size, args.unroll_steps, device, args.max_sentences,
                               progress=not args.no_progress)
    if args.per_sentence is not None:
        write_sentence_scores(model, vocab, files, args.per_sentence, args.batch_size, device, args.max_sentences,
                              progress=not args.no_progress)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"forward perplexity   {result['forward_ppl']:.3f}")
        print(f"backward perplexity  {result['backward_ppl']:.3f}")
        print(f"average perplexity   {result['ppl']:.3f}   ({result['n_tokens']:,} targets per direction)")
    return 0


def write_sentence_scores(model, vocab, files: list[Path], out: Path, batch_size: int, device: str,
                          max_sentences: int | None = None, progress: bool = False) -> None:
    """One line per non-blank input line (the first `max_sentences`): file, line number, targets,
    NLLs and perplexities."""
    from elmokit.textfiles import open_text
    from elmokit.io import atomic_path
    from elmokit.progress import progress_bar
    from elmokit.training.perplexity import sentence_scores

    located, sentences = [], []
    for path in files:
        if max_sentences is not None and len(sentences) >= max_sentences:
            break
        with open_text(path) as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    located.append((str(path), number))
                    sentences.append(line.split())
                    if max_sentences is not None and len(sentences) >= max_sentences:
                        break
    as_json = out.suffix == ".jsonl"
    bar = progress_bar(total=len(sentences), unit="sentences", desc="scoring each sentence", enabled=progress)
    with bar, atomic_path(out) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        if not as_json:
            handle.write("file\tline\tn_targets\tforward_nll\tbackward_nll\tforward_ppl\tbackward_ppl\tppl\n")
        for (path, number), score in zip(located, sentence_scores(model, vocab, sentences, batch_size, device)):
            values = {"file": path, "line": number, "n_targets": score.n_targets,
                      "forward_nll": round(score.forward_nll, 4), "backward_nll": round(score.backward_nll, 4),
                      "forward_ppl": round(score.forward_ppl, 3), "backward_ppl": round(score.backward_ppl, 3),
                      "ppl": round(score.ppl, 3)}
            handle.write(json.dumps(values) + "\n" if as_json else "\t".join(map(str, values.values())) + "\n")
            bar.update(1)
