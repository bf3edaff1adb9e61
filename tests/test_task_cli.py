"""Task models on your own files, from the command line: train -> predict -> eval round trips on
tiny files (without ELMo, and with the tiny biLM), predictions identical to eval's, the run
directory as a self-contained tool, and the recipe pieces (char CNN, early stopping, data folder)."""

from __future__ import annotations

import json

import pytest
import torch

from elmokit import save_pretrained
from elmokit.cli import main
from elmokit.tasks import load
from elmokit.tasks import predict as predict_module
from elmokit.tasks.charcnn import CharWordEncoder, build_char_vocab, encode_chars
from elmokit.tasks.formats import read_examples, resolve_format
from elmokit.tasks.train import EarlyStopping
from tests.test_tasks import synthetic_entities, synthetic_sentiment, synthetic_tagging

TINY = ["--max-epochs", "4", "--patience", "4", "--batch-size", "8", "--word-dim", "8", "--hidden-dim", "12",
        "--char-filters", "6", "--char-dim", "4", "--lr", "0.02", "--min-word-count", "1", "--no-progress"]


def write_columns(path, sentences, separator="\t", iob1=False):
    lines = []
    for sentence in sentences:
        for index, (token, tag) in enumerate(zip(sentence.tokens, sentence.tags)):
            if iob1 and tag.startswith("B-") and not (index and sentence.tags[index - 1][2:] == tag[2:]):
                tag = "I-" + tag[2:]  # IOB1: an entity starts with I- unless it follows one of its type
            lines.append(f"{token}{separator}{tag}")
        lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def train(capsys, *args) -> dict:
    assert main(["task", "train", *args, *TINY, "--json"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out.strip().splitlines()[-1]) | {"stderr": captured.err}


def eval_json(capsys, run, path, *args) -> dict:
    assert main(["task", "eval", str(run), str(path), "--json", "--no-progress", *args]) == 0
    return json.loads(capsys.readouterr().out)


def column_labels(path) -> list[list[str]]:
    blocks = path.read_text(encoding="utf-8").strip("\n").split("\n\n")
    return [[line.split("\t")[-1] for line in block.splitlines()] for block in blocks]


@pytest.fixture
def ner_files(tmp_path):
    return {split: write_columns(tmp_path / f"{split}.conll", synthetic_entities(n, seed), iob1=split == "train")
            for split, n, seed in (("train", 120, 0), ("dev", 30, 1), ("test", 40, 2))}


def test_ner_round_trip_without_elmo(tmp_path, ner_files, capsys, monkeypatch):
    run = tmp_path / "run"
    trained = train(capsys, "--task", "ner", "--train", str(ner_files["train"]), "--dev", str(ner_files["dev"]),
                    "--test", str(ner_files["test"]), "--out", str(run), "--model", "none")
    assert "IOB1 tags read as BIO" in trained["stderr"]
    assert trained["stderr"].count("ner epoch ") == trained["epochs"]  # epoch lines despite --no-progress
    assert trained["test"]["f1"] > 60
    from elmokit.tasks.card import results_table  # what the command prints without --json

    assert "By entity type, test split:" in results_table(trained, run)
    # eval on the test file gives what training reported
    scored = eval_json(capsys, run, ner_files["test"])
    assert scored["f1"] == pytest.approx(trained["test"]["f1"])
    assert set(scored["per_type"]) == {"PER", "LOC"}
    # predict, in chunks smaller than the file: the same labels eval computed internally
    monkeypatch.setattr(predict_module, "CHUNK_BATCHES", 1)
    output = tmp_path / "predicted.conll"
    assert main(["task", "predict", str(run), str(ner_files["test"]), "-o", str(output), "--no-progress"]) == 0
    examples, _ = read_examples(ner_files["test"], "tagger", resolve_format(ner_files["test"], "tagger"), True)
    eval_predictions = load(run).evaluate(examples).predictions
    assert column_labels(output) == eval_predictions
    # the predicted file reads back as gold: scoring it against the model gives 100
    assert eval_json(capsys, run, output)["f1"] == pytest.approx(100.0)


def test_predict_formats_and_api(tmp_path, ner_files, capsys):
    run = tmp_path / "run"
    train(capsys, "--task", "ner", "--train", str(ner_files["train"]), "--dev", str(ner_files["dev"]),
          "--out", str(run), "--model", "none", "--max-epochs", "2")
    sentences = [["mr", "smith", "sees", "new", "york"], ["the", "dog"]]
    expected = load(run).predict_labels(sentences)
    assert [len(row) for row in expected] == [5, 2]
    raw = tmp_path / "raw.txt"
    raw.write_text("mr smith sees new york\nthe dog\n", encoding="utf-8")
    assert main(["task", "predict", str(run), str(raw), "--jsonl", "--no-progress"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows == [{"tokens": s, "labels": labels} for s, labels in zip(sentences, expected)]
    assert main(["task", "predict", str(run), str(raw), "--no-progress"]) == 0  # text in: token<TAB>label out
    out = capsys.readouterr().out
    assert out.split("\n\n")[0].splitlines() == [f"{t}\t{label}" for t, label in zip(sentences[0], expected[0])]
    tokens_only = tmp_path / "tokens.txt"
    tokens_only.write_text("mr\nsmith\nsees\nnew\nyork\n\nthe\ndog\n", encoding="utf-8")
    assert main(["task", "predict", str(run), str(tokens_only), "--no-progress"]) == 0
    assert capsys.readouterr().out == out
    raw.write_text("Mr smith, sees new york.\n", encoding="utf-8")
    assert main(["task", "predict", str(run), str(raw), "--tokenize", "--jsonl", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == ["Mr", "smith", ",", "sees", "new", "york", "."]
    with pytest.raises(ValueError, match="sentence 1 must be a non-empty list"):
        load(run).predict_labels([["a"], []])


def test_round_trip_with_the_tiny_bilm_and_its_fingerprint(tiny_model, tmp_path, ner_files, capsys):
    model_dir = tmp_path / "bilm"
    save_pretrained(tiny_model, model_dir)
    run = tmp_path / "run"
    trained = train(capsys, "--task", "ner", "--train", str(ner_files["train"]), "--dev", str(ner_files["dev"]),
                    "--test", str(ner_files["test"]), "--out", str(run), "--model", str(model_dir))
    saved = json.loads((run / "task_config.json").read_text())
    assert saved["bilm"]["path"] == "../bilm" and saved["bilm"]["absolute_path"] == str(model_dir.resolve())
    assert len(saved["bilm"]["fingerprint"]) == 16
    assert saved["chars"][:2] == ["<pad>", "<unk>"] and saved["labels"] == ["B-LOC", "B-PER", "I-LOC", "O"]
    assert eval_json(capsys, run, ner_files["test"])["f1"] == pytest.approx(trained["test"]["f1"])
    output = tmp_path / "predicted.jsonl"
    assert main(["task", "predict", str(run), str(ner_files["test"]), "-o", str(output), "--jsonl",
                 "--no-progress"]) == 0
    examples, _ = read_examples(ner_files["test"], "tagger", resolve_format(ner_files["test"], "tagger"), True)
    eval_predictions = load(run).evaluate(examples).predictions
    assert [json.loads(line)["labels"] for line in output.read_text().splitlines()] == eval_predictions
    # another biLM saved at the same path: loading the run is an error, not other vectors
    with torch.no_grad():
        next(tiny_model.parameters()).add_(0.01)  # any change to its weights
    save_pretrained(tiny_model, model_dir)
    assert main(["task", "predict", str(run), str(ner_files["test"]), "--no-progress"]) == 2
    assert f"the biLM at {model_dir.resolve()} is not the one this run was trained with" in capsys.readouterr().err


def test_classify_tsv_round_trip(tmp_path, capsys):
    files = {}
    for split, n, seed in (("train", 200, 0), ("dev", 40, 1), ("test", 40, 2)):
        rows = [f"{'positive' if s.label else 'negative'}\t{' '.join(s.tokens)}" for s in synthetic_sentiment(n, seed)]
        files[split] = tmp_path / f"{split}.tsv"
        files[split].write_text("\n".join(rows) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    trained = train(capsys, "--task", "classify", "--train", str(files["train"]), "--dev", str(files["dev"]),
                    "--test", str(files["test"]), "--out", str(run), "--model", "none", "--max-epochs", "6",
                    "--patience", "6")
    assert trained["test"]["accuracy"] > 70
    assert json.loads((run / "task_config.json").read_text())["labels"] == ["negative", "positive"]
    output = tmp_path / "predicted.tsv"
    assert main(["task", "predict", str(run), str(files["test"]), "-o", str(output), "--no-progress"]) == 0
    predicted = [line.split("\t") for line in output.read_text().splitlines()]
    examples, _ = read_examples(files["test"], "classifier", resolve_format(files["test"], "classifier"))
    assert [row[0] for row in predicted] == load(run).evaluate(examples).predictions
    assert [row[1] for row in predicted] == [line.split("\t")[1] for line in files["test"].read_text().splitlines()]
    assert main(["task", "eval", str(run), str(files["test"]), "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith(f"{files['test']} (40 sentences): accuracy {trained['test']['accuracy']:.2f}%")


def test_pos_conllu_column_round_trip(tmp_path, capsys):
    xpos = {"DET": "DT", "NOUN": "NN", "VERB": "VBZ", "ADJ": "JJ", "CCONJ": "CC", "ADV": "RB"}
    files = {}
    for split, n, seed in (("train", 100, 0), ("dev", 30, 1)):
        lines = []
        for sentence in synthetic_tagging(n, seed):
            lines += ["# sent_id = x"] + [f"{i}\t{t}\t{t}\t{tag}\t{xpos[tag]}\t_\t0\tdep\t_\t_"
                                          for i, (t, tag) in enumerate(zip(sentence.tokens, sentence.tags), 1)] + [""]
        files[split] = tmp_path / f"{split}.conllu"
        files[split].write_text("\n".join(lines) + "\n", encoding="utf-8")
    run = tmp_path / "run"
    trained = train(capsys, "--task", "pos", "--train", str(files["train"]), "--dev", str(files["dev"]),
                    "--column", "xpos", "--out", str(run), "--model", "none")
    assert json.loads((run / "task_config.json").read_text())["labels"] == sorted(set(xpos.values()))
    output = tmp_path / "predicted.conllu"
    assert main(["task", "predict", str(run), str(files["dev"]), "-o", str(output), "--no-progress"]) == 0
    lines_in, lines_out = files["dev"].read_text().splitlines(), output.read_text().splitlines()
    assert len(lines_in) == len(lines_out)
    changed = {i for i, (a, b) in enumerate(zip(lines_in, lines_out)) if a != b}
    assert all(lines_in[i].split("\t")[:4] == lines_out[i].split("\t")[:4] for i in changed)  # only XPOS changes
    assert eval_json(capsys, run, files["dev"])["accuracy"] == pytest.approx(trained["dev"]["accuracy"])


def test_cli_errors_name_the_file_and_line(tmp_path, ner_files, capsys):
    bad = tmp_path / "bad.conll"
    bad.write_text("EU\tB-ORG\nrejects\tO\n\nBonn\tB-LOC\tx\n", encoding="utf-8")
    args = ["task", "train", "--task", "ner", "--dev", str(ner_files["dev"]), "--out", str(tmp_path / "r"),
            "--model", "none", "--no-progress"]
    assert main([*args, "--train", str(bad)]) == 2
    assert f"{bad}:4: expected 2 tab-separated columns" in capsys.readouterr().err
    assert main(["task", "train", "--task", "classify", "--out", str(tmp_path / "r"), "--model", "none"]) == 2
    assert "--task classify has no bundled data set: give --train FILE and --dev FILE" in capsys.readouterr().err
    assert main(["task", "train", "--task", "ner", "--out", str(tmp_path / "r"), "--model", "none",
                 "--data-dir", str(tmp_path / "nowhere")]) == 2
    error = capsys.readouterr().err
    assert f"data folder {tmp_path / 'nowhere'} not found" in error and "ELMOKIT_DATA_DIR" in error
    assert main(["task", "predict", str(tmp_path), str(bad)]) == 2
    assert "not a task run directory" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Recipe pieces
# ---------------------------------------------------------------------------------------------
def test_early_stopping_waits_through_ties_at_zero():
    stopping = EarlyStopping(patience=2)
    assert [stopping.update(0.0, epoch) for epoch in (1, 2, 3, 4)] == [True, True, True, True]
    assert not stopping.should_stop and stopping.best_epoch == 4
    assert stopping.update(5.0, 5) and not stopping.update(5.0, 6) and not stopping.update(4.0, 7)
    assert stopping.should_stop and stopping.best_epoch == 5


def test_char_cnn_shapes_padding_and_batch_invariance():
    torch.manual_seed(0)
    vocab = build_char_vocab([["ab", "cab"]])
    index = {char: i for i, char in enumerate(vocab)}
    cnn = CharWordEncoder(len(vocab), char_dim=4, n_filters=5, width=3, dropout=0.0).eval()
    ids = encode_chars([["ab", "c"], ["cabz"]], index, n_positions=3)
    assert ids.shape == (2, 3, 4) and ids[1, 0].tolist() == [index["c"], index["a"], index["b"], 1]
    vectors = cnn(ids)
    assert vectors.shape == (2, 3, 5)
    assert torch.equal(vectors[0, 2], torch.zeros(5)) and torch.equal(vectors[1, 1:], torch.zeros(2, 5))
    alone = cnn(encode_chars([["ab", "c"]], index, n_positions=2))
    torch.testing.assert_close(alone[0], vectors[0, :2])
    with pytest.raises(ValueError, match="odd"):
        CharWordEncoder(4, width=2)


def test_training_batches_cover_every_example_once_with_similar_lengths():
    import random

    from elmokit.tasks.data import shuffled_batches

    lengths = [random.Random(0).randint(1, 60) for _ in range(1000)]
    batches = shuffled_batches(lengths, batch_size=10, rng=random.Random(1), pool_batches=20)
    assert sorted(i for batch in batches for i in batch) == list(range(1000))
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    assert spread < 10  # sorted within pools of 200: a batch spans a few lengths, not the whole 1-60
    assert batches != shuffled_batches(lengths, 10, random.Random(2), 20)  # the order follows the rng


def test_conllu_prediction_keeps_comments_multiword_ranges_and_empty_nodes(tmp_path):
    from elmokit.tasks.formats import iter_records
    from elmokit.tasks.predict import conllu_block
    from tests.test_formats import CONLLU

    path = tmp_path / "a.conllu"
    path.write_text(CONLLU, encoding="utf-8")
    record = next(iter_records(path, resolve_format(path, "tagger"), "tagger"))
    written = conllu_block(record, ["A", "B", "C", "D"], "upos").splitlines()
    original = CONLLU.split("\n\n")[0].splitlines()
    assert len(written) == len(original) + 1 and written[-1] == ""
    assert [line.split("\t")[3] for line in written[2:-1]] == ["A", "_", "B", "C", "D", "PRON"]
    assert written[:2] == original[:2] and written[3] == original[3] and written[7] == original[7]


def test_paths_are_stored_absolute(tmp_path, monkeypatch):
    from elmokit.tasks.task_config import TaskConfig

    monkeypatch.chdir(tmp_path)
    config = TaskConfig(task="ner", data_dir="data", train_file="t.conll", dev_file="d.conll")
    assert config.data_dir == str(tmp_path / "data") and config.train_file == str(tmp_path / "t.conll")
    assert config.split_files() == {"train": tmp_path / "t.conll", "dev": tmp_path / "d.conll"}
    with pytest.raises(ValueError, match="^train and dev go together") as caught:  # Python's spelling
        TaskConfig(task="ner", train_file="t.conll")
    assert caught.value.as_flags().startswith("--train and --dev go together")  # what elmo prints
    with pytest.raises(ValueError, match="^max_epochs must be >= 1, got 0$"):
        TaskConfig(task="ner", max_epochs=0)


def test_a_seed_gives_the_same_run_again_in_the_same_process(tmp_path, ner_files, capsys):
    """A task run depends on its seed alone, not on what the process ran before (scripts/task_results.py
    runs several jobs a worker): seed 1, then seed 2, then seed 1 again."""
    def run(seed: int, name: str) -> list[dict]:
        train(capsys, "--task", "ner", "--train", str(ner_files["train"]), "--dev", str(ner_files["dev"]),
              "--out", str(tmp_path / name), "--model", "none", "--seed", str(seed))
        lines = (tmp_path / name / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
        return [{k: v for k, v in json.loads(line).items() if not k.endswith("_s")} for line in lines]

    first, other, again = run(1, "first"), run(2, "other"), run(1, "again")
    assert again == first
    assert other != first  # the seed matters: the comparison above could fail
