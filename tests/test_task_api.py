"""Task runs from Python (issue 31): predictions with probabilities checked against brute force
over every tag sequence, evaluate on a path or examples, `elmokit.tasks.train` with the options of
`elmo task train`, and the command a run's card records."""

from __future__ import annotations

import itertools
import json
import math
import shlex
from dataclasses import asdict, fields

import pytest
import torch

import elmokit.tasks
from elmokit.cli import build_parser, main
from elmokit.tasks.confidence import span_probability
from elmokit.tasks.crf import CRF
from elmokit.tasks.options import KEYWORDS, command_line, config_from_values
from elmokit.tasks.readers import TaggedSentence
from elmokit.tasks.results import LabelPrediction, Span, TagPrediction
from elmokit.tasks.task_config import TaskConfig
from tests.test_task_cli import TINY, write_columns
from tests.test_tasks import synthetic_entities, synthetic_sentiment, synthetic_tagging

# the options of TINY, as keywords
TINY_KEYWORDS = dict(max_epochs=4, patience=4, batch_size=8, word_dim=8, hidden_dim=12, char_filters=6, char_dim=4,
                     lr=0.02, min_word_count=1, progress=False)


def random_crf(n_tags: int, seed: int) -> CRF:
    torch.manual_seed(seed)
    crf = CRF(n_tags)
    with torch.no_grad():
        for parameter in crf.parameters():
            parameter.normal_()
    return crf


def path_probabilities(crf: CRF, emissions: torch.Tensor, length: int) -> dict[tuple[int, ...], float]:
    """p(path) of every tag path of one sentence, from the CRF's definition in plain Python."""
    start, end, transition = crf.start.tolist(), crf.end.tolist(), crf.transitions.tolist()
    emitted = emissions.tolist()
    scores = {}
    for path in itertools.product(range(crf.n_tags), repeat=length):
        score = start[path[0]] + end[path[-1]] + sum(emitted[t][tag] for t, tag in enumerate(path))
        scores[path] = score + sum(transition[a][b] for a, b in zip(path, path[1:]))
    top = max(scores.values())
    total = sum(math.exp(s - top) for s in scores.values())
    return {path: math.exp(s - top) / total for path, s in scores.items()}


def test_crf_marginals_match_every_path_enumerated():
    n_tags, n_positions = 3, 5
    crf = random_crf(n_tags, 0)
    emissions = torch.randn(3, n_positions, n_tags)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False], [True, False, False, False, False]])
    emissions[~mask] = 50.0  # padding that would dominate if it were read
    marginals = crf.marginals(emissions, mask)
    for row in range(3):
        length = int(mask[row].sum())
        paths = path_probabilities(crf, emissions[row, :length], length)
        for t in range(length):
            for tag in range(n_tags):
                expected = sum(p for path, p in paths.items() if path[t] == tag)
                assert marginals[row, t, tag].item() == pytest.approx(expected, abs=1e-5)
        assert torch.allclose(marginals[row, :length].sum(-1), torch.ones(length), atol=1e-5)
        assert marginals[row, length:].abs().sum() == 0  # zero at padding
    assert ((marginals >= 0) & (marginals <= 1 + 1e-6)).all()


def test_span_probability_matches_every_path_enumerated():
    """p(tokens 1..2 carry exactly tags (B=0, I=1) and token 3 is not I=1), by the restricted
    partition function, against the sum over the paths that satisfy it; and without a CRF
    against the product of independent softmaxes."""
    crf = random_crf(3, 1)  # tags: 0 B-X, 1 I-X, 2 O
    emissions = torch.randn(5, 3)
    allowed = torch.ones(5, 3, dtype=torch.bool)
    allowed[1] = torch.tensor([True, False, False])
    allowed[2] = torch.tensor([False, True, False])
    allowed[3, 1] = False

    class WithCRF:
        pass

    tagger = WithCRF()
    tagger.crf = crf
    paths = path_probabilities(crf, emissions, 5)
    expected = sum(p for path, p in paths.items() if path[1] == 0 and path[2] == 1 and path[3] != 1)
    assert span_probability(tagger, emissions, allowed) == pytest.approx(expected, abs=1e-5)
    tagger.crf = None
    softmax = torch.softmax(emissions, -1).tolist()
    independent = sum(math.prod(softmax[t][tag] for t, tag in enumerate(path))
                      for path in itertools.product(range(3), repeat=5) if path[1] == 0 and path[2] == 1 and path[3] != 1)
    assert span_probability(tagger, emissions, allowed) == pytest.approx(independent, abs=1e-5)


@pytest.fixture
def ner_files(tmp_path):
    return {split: write_columns(tmp_path / f"{split}.conll", synthetic_entities(n, seed))
            for split, n, seed in (("train", 120, 0), ("dev", 30, 1), ("test", 40, 2))}


@pytest.fixture
def ner_run(tmp_path, ner_files, tiny_model):
    from elmokit import save_pretrained

    save_pretrained(tiny_model, tmp_path / "bilm")
    return elmokit.tasks.train(task="ner", train=ner_files["train"], dev=ner_files["dev"], test=ner_files["test"],
                               out=tmp_path / "run", model=tmp_path / "bilm", **TINY_KEYWORDS)


def test_ner_predictions_hold_spans_and_the_crf_marginals(ner_run, ner_files):
    tokens = ["mr", "smith", "sees", "new", "york", "."]
    prediction = ner_run.predict(tokens)
    assert isinstance(prediction, TagPrediction) and prediction.tags == ner_run.predict_labels([tokens])[0]
    # the confidences are the marginals of the predicted tags, recomputed from the model's own scores
    batch = next(ner_run._batches([tokens], None, False))[1]
    marginals = ner_run.model.crf.marginals(ner_run.model(batch), batch.mask)[0]
    ids = [ner_run.labels.index(tag) for tag in prediction.tags]
    assert prediction.confidences == pytest.approx([marginals[t, i].item() for t, i in enumerate(ids)], abs=1e-5)
    assert [(s.label, s.start, s.end, s.text) for s in prediction.spans] == [("PER", 1, 2, "smith"),
                                                                            ("LOC", 3, 5, "new york")]
    assert all(0 < s.confidence <= min(prediction.confidences[s.start:s.end]) + 1e-6 for s in prediction.spans)
    assert "Span(LOC 'new york' [3:5]" in repr(prediction)
    assert json.loads(json.dumps(prediction.to_dict()))["spans"][1]["text"] == "new york"
    # a raw string, tokenized or split on whitespace, and a batch: the same prediction
    assert ner_run.predict("mr smith sees new york.", tokenize=True).tags == prediction.tags
    assert ner_run.predict("mr smith sees new york .").tags == prediction.tags
    batch_predictions = ner_run.predict([tokens, ["the", "dog"]])
    assert [p.tags for p in batch_predictions] == ner_run.predict_labels([tokens, ["the", "dog"]])
    with pytest.raises(ValueError, match="tokenize=True is for raw text"):
        ner_run.predict(tokens, tokenize=True)
    with pytest.raises(ValueError, match="the text is empty"):
        ner_run.predict("   ")


def test_evaluate_a_path_examples_or_pairs(ner_run, ner_files):
    by_path = ner_run.evaluate(ner_files["test"])
    assert by_path.score == pytest.approx(ner_run.results["test"]["f1"]) and by_path.n == 40
    examples, _ = ner_run.read_file(ner_files["test"])
    by_examples = ner_run.evaluate(examples)
    by_pairs = ner_run.evaluate([(e.tokens, e.tags) for e in examples])
    assert by_examples.scores == by_path.scores == by_pairs.scores
    assert by_examples.predictions == ner_run.predict_labels([e.tokens for e in examples])
    assert str(by_path).startswith(f"{ner_files['test']} (40 sentences): span F1 ")
    assert repr(by_path) == f"Evaluation(span F1 {by_path.score:.2f} on 40 sentences of {ner_files['test']})"
    # other gold labels, another score: the evaluation reads the labels it is given
    no_entities = [TaggedSentence(e.tokens, ["O"] * len(e.tokens)) for e in examples]
    assert by_path.score > 0 and ner_run.evaluate(no_entities).score == 0


def test_pos_and_classifier_probabilities(tmp_path):
    files = {split: write_columns(tmp_path / f"{split}.tsv", synthetic_tagging(n, seed))
             for split, n, seed in (("train", 60, 0), ("dev", 20, 1))}
    pos = elmokit.tasks.train(task="pos", train=files["train"], dev=files["dev"], out=tmp_path / "pos", model=None,
                              **TINY_KEYWORDS)
    tagged = pos.predict(["the", "dog", "runs", "fast"])
    assert tagged.spans is None and all(0 < c <= 1 for c in tagged.confidences)
    batch = next(pos._batches([tagged.tokens], None, False))[1]
    softmax = torch.softmax(pos.model(batch), -1)[0]
    assert tagged.confidences == pytest.approx([softmax[t].max().item() for t in range(4)], abs=1e-6)

    for split, n, seed in (("train", 80, 0), ("dev", 20, 1)):
        rows = [f"{'positive' if s.label else 'negative'}\t{' '.join(s.tokens)}" for s in synthetic_sentiment(n, seed)]
        (tmp_path / f"{split}.txt").write_text("\n".join(rows) + "\n", encoding="utf-8")
    classifier = elmokit.tasks.train(task="classify", train=tmp_path / "train.txt", dev=tmp_path / "dev.txt",
                                     format="tsv", out=tmp_path / "cls", model="none", **TINY_KEYWORDS)
    labelled = classifier.predict("a good dog")
    assert isinstance(labelled, LabelPrediction) and set(labelled.probabilities) == {"negative", "positive"}
    assert sum(labelled.probabilities.values()) == pytest.approx(1.0)
    assert labelled.label == max(labelled.probabilities, key=labelled.probabilities.get)
    assert labelled.confidence == labelled.probabilities[labelled.label]
    assert labelled.label == classifier.predict_labels([["a", "good", "dog"]])[0]
    assert repr(labelled).startswith(f"LabelPrediction({labelled.label!r} ")


def test_python_train_is_the_command_line(tmp_path, ner_files, capsys):
    """The same options by keyword and by flag give the same run, epoch by epoch, and the same weights."""
    args = ["--task", "ner", "--train", str(ner_files["train"]), "--dev", str(ner_files["dev"]), "--model", "none"]
    assert main(["task", "train", *args, "--out", str(tmp_path / "cli"), *TINY]) == 0
    table = capsys.readouterr().out
    assert "span F1" in table and f"model card: {tmp_path / 'cli' / 'README.md'}" in table  # a table, not JSON
    run = elmokit.tasks.train(task="ner", train=str(ner_files["train"]), dev=str(ner_files["dev"]), model="none",
                              out=tmp_path / "api", **TINY_KEYWORDS)

    def epochs(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k != "cpu_s"} for line in lines]

    assert epochs("api") == epochs("cli")
    assert (tmp_path / "api" / "task_model.safetensors").read_bytes() == \
        (tmp_path / "cli" / "task_model.safetensors").read_bytes()
    assert run.results["dev"] == json.loads((tmp_path / "cli" / "results.json").read_text())["dev"]
    with pytest.raises(TypeError, match="did you mean max_epochs"):
        elmokit.tasks.train(task="ner", out=tmp_path / "x", max_epoch=3)
    with pytest.raises(TypeError, match="needs out="):
        elmokit.tasks.train(task="ner")
    with pytest.raises(FileExistsError, match="overwrite=True replaces it"):
        elmokit.tasks.train(task="ner", train=ner_files["train"], dev=ner_files["dev"], out=tmp_path / "api")


def test_every_option_is_a_field_and_a_keyword():
    train = next(sub for _, sub in _subparsers(build_parser(), ["task", "train"]))
    evaluate = next(sub for _, sub in _subparsers(build_parser(), ["task", "eval"]))
    dests = {action.dest for action in train._actions}
    names = {spec.name for spec in fields(TaskConfig)}
    assert names <= dests and names == set(KEYWORDS.values())
    # beside the fields, only what every task command has (help, --json, -v/-q) and --overwrite
    assert dests - names - {action.dest for action in evaluate._actions} == {"overwrite", "resume"}
    assert KEYWORDS["train"] == "train_file" and KEYWORDS["format"] == "data_format"


def _subparsers(parser, names):
    import argparse

    for name in names:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    yield None, parser


def test_the_recorded_command_makes_the_same_config(tmp_path):
    config = TaskConfig(task="ner", model=None, out=str(tmp_path / "r"), train_file=str(tmp_path / "t.conll"),
                        dev_file=str(tmp_path / "d.conll"), max_epochs=7, crf=False, elmo_at_output=True, lr=0.003,
                        device="cpu", progress=False)  # a device named: the command line's default is read at run time
    words = shlex.split(command_line(config))
    assert words[:3] == ["elmo", "task", "train"] and "--max-epochs" in words and "--no-crf" in words
    args = build_parser().parse_args(words[1:])
    again = config_from_values({spec.name: getattr(args, spec.name) for spec in fields(TaskConfig)})
    assert asdict(again) == {**asdict(config), "progress": True}  # progress is not part of the recipe
    builtin = TaskConfig(task="pos", model="gutenberg-en", out="r")
    assert "--model" not in shlex.split(command_line(builtin))  # the default


def test_span_repr_and_dict():
    span = Span("LOC", 3, 5, "new york", 0.91234)
    assert repr(span) == "Span(LOC 'new york' [3:5] 0.91)"
    tags = TagPrediction(["a"], ["NOUN"], [0.5])
    assert repr(tags) == "TagPrediction(a/NOUN 0.50)" and "spans" not in tags.to_dict()


def test_lines_of_text_with_equal_lengths_are_text(tmp_path):
    """Two sentences of five words are text to label, not a one-sentence column file of five
    columns; two to four columns on every line still read as columns."""
    from elmokit.tasks.formats import detect_format

    text = tmp_path / "new.txt"
    text.write_text("mr smith sees new york\nthe dog and mr jones\n", encoding="utf-8")
    assert detect_format(text, "tagger") == "text"
    columns = tmp_path / "one-sentence.txt"
    columns.write_text("mr O\nsmith B-PER\n", encoding="utf-8")
    assert detect_format(columns, "tagger") == "columns"


def test_the_tasks_page_is_on_the_site_and_types_no_figure():
    """docs/tasks.md is in the site's nav (the strict build in test_docs builds it) and shows no
    score: figures are on the results page, written by scripts/task_results.py."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    assert "  - Tasks: tasks.md\n" in (repo / "mkdocs.yml").read_text(encoding="utf-8")
    page = (repo / "docs" / "tasks.md").read_text(encoding="utf-8")
    assert not re.findall(r"\d+\.\d+|\d+ ?%", page), "a figure typed on docs/tasks.md"
    assert "(results.md)" in page and "::: elmokit.tasks.api.train_task_model" in page


def test_task_training_interrupted_and_resumed_takes_the_uninterrupted_run_s_epochs(tmp_path, ner_files, tiny_model,
                                                                                   capsys, monkeypatch):
    """Ctrl-C after epoch 2 keeps OUT/task_checkpoint.pt; `--resume` takes epochs 3 and 4 as the
    uninterrupted run does: the same metrics lines (CPU time aside), the same weights byte for
    byte, and no checkpoint left once the run is whole. Other options are refused by name."""
    import importlib

    from elmokit import save_pretrained

    loop = importlib.import_module("elmokit.tasks.train")  # the module: elmokit.tasks.train is also a function
    save_pretrained(tiny_model, tmp_path / "bilm")  # with ELMo: the mix and its dropout are in the state
    args = ["--task", "ner", "--train", str(ner_files["train"]), "--dev", str(ner_files["dev"]),
            "--model", str(tmp_path / "bilm"), *TINY, "--dropout", "0.3"]
    assert main(["task", "train", *args, "--out", str(tmp_path / "whole")]) == 0

    real_report = loop.report

    def interrupted_after_epoch_2(line: str) -> None:
        real_report(line)
        if " epoch 2/" in line:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(loop, "report", interrupted_after_epoch_2)
        assert main(["task", "train", *args, "--out", str(tmp_path / "cut")]) == 130
    assert (tmp_path / "cut" / loop.CHECKPOINT).is_file() and not (tmp_path / "cut" / "results.json").exists()
    assert main(["task", "train", *args, "--out", str(tmp_path / "cut"), "--lr", "0.5", "--resume"]) == 2
    assert "trained with other lr (0.02, now 0.5)" in capsys.readouterr().err
    kept = ner_files["train"].read_bytes()
    ner_files["train"].write_bytes(kept.split(b"\n\n", 1)[1])  # the same path, its first sentence gone
    assert main(["task", "train", *args, "--out", str(tmp_path / "cut"), "--resume"]) == 2
    assert "its train data changed since it was interrupted" in capsys.readouterr().err
    ner_files["train"].write_bytes(kept)
    assert main(["task", "train", *args, "--out", str(tmp_path / "cut"), "--resume", "--overwrite"]) == 2
    assert main(["task", "train", *args, "--out", str(tmp_path / "cut"), "--resume"]) == 0
    assert "resuming" in capsys.readouterr().err

    def epochs(name: str) -> list[dict]:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k != "cpu_s"} for line in lines]

    assert len(epochs("whole")) == 4 and epochs("cut") == epochs("whole")
    assert (tmp_path / "cut" / "task_model.safetensors").read_bytes() == \
        (tmp_path / "whole" / "task_model.safetensors").read_bytes()
    assert not (tmp_path / "cut" / loop.CHECKPOINT).exists() and not (tmp_path / "whole" / loop.CHECKPOINT).exists()
    assert main(["task", "train", *args, "--out", str(tmp_path / "whole"), "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
