"""Task models learn tiny synthetic tasks (with a tiny random biLM and without ELMo); the CRF
matches brute force; the ELMo layer cache is exact; `elmo task` train/eval/probe run end to end."""

from __future__ import annotations

import gzip
import itertools
import json
import math
import random

import pytest
import torch

from elmokit import save_pretrained
from elmokit.cli import main
from elmokit.tasks.crf import CRF
from elmokit.tasks.features import bilm_layers, cached_layers, compute_layers
from elmokit.tasks.probes import nearest_neighbour_senses, score_senses
from elmokit.tasks.readers import LabelledSentence, TaggedSentence
from elmokit.tasks.train import TaskConfig, TaskData, train_task





WORDS = ["the", "a", "cat", "dog", "runs", "sees", "big", "red", "and", "fast"]


def synthetic_tagging(n: int, seed: int) -> list[TaggedSentence]:
    """Tag = the word's class, except "fast" after "runs" is ADV and elsewhere ADJ (context)."""
    classes = {"the": "DET", "a": "DET", "cat": "NOUN", "dog": "NOUN", "runs": "VERB", "sees": "VERB",
               "big": "ADJ", "red": "ADJ", "and": "CCONJ"}
    rng = random.Random(seed)
    sentences = []
    for _ in range(n):
        tokens = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
        tags = [("ADV" if i and tokens[i - 1] == "runs" else "ADJ") if t == "fast" else classes[t]
                for i, t in enumerate(tokens)]
        sentences.append(TaggedSentence(tokens, tags))
    return sentences


def synthetic_entities(n: int, seed: int) -> list[TaggedSentence]:
    """'mr X' makes X a one-token PER; 'new york' is a two-token LOC."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(n):
        tokens, tags = [], []
        for _ in range(rng.randint(2, 5)):
            kind = rng.random()
            if kind < 0.3:
                tokens += ["mr", rng.choice(["smith", "jones"])]
                tags += ["O", "B-PER"]
            elif kind < 0.5:
                tokens += ["new", "york"]
                tags += ["B-LOC", "I-LOC"]
            else:
                tokens.append(rng.choice(WORDS))
                tags.append("O")
        sentences.append(TaggedSentence(tokens, tags))
    return sentences


def synthetic_sentiment(n: int, seed: int) -> list[LabelledSentence]:
    """Positive iff "good" occurs and is not right after "not"."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(n):
        tokens = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
        if rng.random() < 0.5:
            tokens.insert(rng.randrange(len(tokens) + 1), "good")
            if rng.random() < 0.5:
                index = tokens.index("good")
                tokens.insert(index, "not")
        label = int("good" in tokens and (tokens.index("good") == 0 or tokens[tokens.index("good") - 1] != "not"))
        sentences.append(LabelledSentence(tokens, label))
    return sentences


def quick_config(task: str, tmp_path, use_elmo: bool, **overrides) -> TaskConfig:
    values = dict(task=task, model="tiny" if use_elmo else None, out=str(tmp_path / task), seed=1,
                  max_epochs=12, patience=12, batch_size=16, word_dim=16, hidden_dim=24, dropout=0.0,
                  elmo_dropout=0.0, min_word_count=1, lr=0.02, progress=False)
    values.update(overrides)
    return TaskConfig(**values)


@pytest.mark.parametrize("use_elmo", [False, True])
def test_pos_tagger_learns_context(tiny_model, tmp_path, use_elmo):
    config = quick_config("pos", tmp_path, use_elmo)
    splits = {"train": synthetic_tagging(160, 0), "dev": synthetic_tagging(40, 1), "test": synthetic_tagging(40, 2)}
    bilm = tiny_model if use_elmo else None
    results = train_task(config, bilm, TaskData(config, splits, bilm))
    assert results["test"]["accuracy"] > 90  # chance is about 1/6
    card = (tmp_path / "pos" / "README.md").read_text(encoding="utf-8")
    assert "given in memory" in card and "shared" not in card  # splits handed over, no data folder read
    if use_elmo:
        assert len(results["layer_weights"]) == 1 and sum(results["layer_weights"][0]) == pytest.approx(1.0)
    lines = (tmp_path / "pos" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["epoch"] == 1


@pytest.mark.parametrize("use_elmo", [False, True])
def test_ner_crf_tagger_learns_spans(tiny_model, tmp_path, use_elmo):
    config = quick_config("ner", tmp_path, use_elmo, elmo_at_output=True)
    splits = {"train": synthetic_entities(160, 0), "dev": synthetic_entities(40, 1), "test": synthetic_entities(40, 2)}
    bilm = tiny_model if use_elmo else None
    results = train_task(config, bilm, TaskData(config, splits, bilm))
    assert results["test"]["f1"] > 90
    if use_elmo:
        assert len(results["layer_weights"]) == 2  # [x; ELMo] and [h; ELMo]


@pytest.mark.parametrize("use_elmo", [False, True])
def test_classifier_learns_negation(tiny_model, tmp_path, use_elmo):
    config = quick_config("sst2", tmp_path, use_elmo, max_epochs=15, patience=15)
    splits = {"train": synthetic_sentiment(300, 0), "dev": synthetic_sentiment(60, 1), "test": synthetic_sentiment(80, 2)}
    bilm = tiny_model if use_elmo else None
    results = train_task(config, bilm, TaskData(config, splits, bilm))
    assert results["test"]["accuracy"] > 80  # chance is about 50-75


def test_finetuning_updates_the_bilm_with_its_own_learning_rate(tiny_model, tmp_path):
    config = quick_config("pos", tmp_path, True, finetune=True, max_epochs=1, bilm_lr=1e-3)
    splits = {"train": synthetic_tagging(32, 0), "dev": synthetic_tagging(8, 1), "test": synthetic_tagging(8, 2)}
    before = {name: t.clone() for name, t in tiny_model.state_dict().items()}
    train_task(config, tiny_model, TaskData(config, splits, tiny_model))
    assert all(torch.equal(before[name], t) for name, t in tiny_model.state_dict().items())  # caller's copy untouched
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "pos" / "task_model.safetensors"))
    changed = [name for name in before if not torch.equal(saved[f"encoder.bilm.{name}"], before[name])]
    assert changed


def test_crf_matches_brute_force():
    """log Z, Viterbi, path_score and the NLL against every tag path enumerated and scored in
    plain Python from the CRF's definition: start[y0] + sum_t emission[t][y_t] +
    sum_t transition[y_{t-1}][y_t] + end[y_last], over the real positions only."""
    torch.manual_seed(0)
    n_tags, n_positions = 3, 5
    crf = CRF(n_tags)
    with torch.no_grad():
        for parameter in crf.parameters():
            parameter.normal_()
    emissions = torch.randn(3, n_positions, n_tags)
    mask = torch.tensor([[True] * 5, [True, True, False, False, False], [True, False, False, False, False]])
    emissions[~mask] = 50.0  # padding that would dominate every score if it were not ignored
    start, end, transition = crf.start.tolist(), crf.end.tolist(), crf.transitions.tolist()

    def score(row: int, path: tuple[int, ...]) -> float:
        emitted = emissions[row].tolist()
        total = start[path[0]] + end[path[-1]] + sum(emitted[t][tag] for t, tag in enumerate(path))
        return total + sum(transition[a][b] for a, b in zip(path, path[1:]))

    log_z, best = crf.log_partition(emissions, mask), crf.viterbi(emissions, mask)
    for row in range(3):
        length = int(mask[row].sum())
        paths = list(itertools.product(range(n_tags), repeat=length))
        scores = [score(row, path) for path in paths]
        top = max(scores)
        assert log_z[row].item() == pytest.approx(top + math.log(sum(math.exp(s - top) for s in scores)), abs=1e-5)
        assert best[row] == list(paths[scores.index(top)])
        for path in (paths[0], paths[-1], paths[len(paths) // 2]):
            padded = torch.tensor([list(path) + [n_tags - 1] * (n_positions - length)])
            assert crf.path_score(emissions[row:row + 1], padded, mask[row:row + 1]).item() == \
                pytest.approx(score(row, path), abs=1e-5)
            nll = crf.neg_log_likelihood(emissions[row:row + 1], padded, mask[row:row + 1]).item()
            assert nll == pytest.approx(log_z[row].item() - score(row, path), abs=1e-5)


def test_cached_layers_equal_the_biLM_and_are_reused(tiny_model, tmp_path):
    sentences = [["a", "cat"], ["the", "dog", "runs", "fast"], ["x"]]
    layers = compute_layers(tiny_model, sentences, batch_size=2, dtype=torch.float32, progress=False)
    direct = bilm_layers(tiny_model, sentences)  # (B, L+1, T, 2P)
    for row, sentence in enumerate(sentences):
        torch.testing.assert_close(layers[row], direct[row, :, :len(sentence)], atol=1e-5, rtol=1e-5)
    first = cached_layers(tiny_model, sentences, tmp_path, progress=False)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    second = cached_layers(tiny_model, sentences, tmp_path, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert first[1].shape == (3, 4, tiny_model.output_dim) and first[1].dtype == torch.float16


def test_nearest_neighbour_senses_and_scores():
    train_keys = [("bank%1:14:00::",), ("bank%1:17:01::",), ("run%2:38:00::",)]
    train = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    test_keys = [("bank%1:17:01::",), ("bank%1:14:00::",), ("walk%2:38:00::",)]
    test = torch.tensor([[0.1, 0.9], [0.2, 0.9], [1.0, 0.0]])
    predictions = nearest_neighbour_senses(train, train_keys, test, test_keys)
    assert predictions == ["bank%1:17:01::", "bank%1:17:01::", None]
    scores = score_senses(predictions, test_keys, backoff={"walk%2": "walk%2:38:00::"})
    assert scores["accuracy_covered"] == pytest.approx(50.0)
    assert scores["coverage"] == pytest.approx(200 / 3)
    assert scores["accuracy_all_no_backoff"] == pytest.approx(100 / 3)
    assert scores["accuracy_all_with_backoff"] == pytest.approx(200 / 3)


def _write_conllu(path, sentences):
    lines = []
    for sentence in sentences:
        lines += [f"{i}\t{t}\t{t}\t{tag}\t_\t_\t0\tdep\t_\t_" for i, (t, tag) in
                  enumerate(zip(sentence.tokens, sentence.tags), start=1)] + [""]
    text = "\n".join(lines) + "\n"
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(text)
    else:
        path.write_text(text, encoding="utf-8")


def test_cli_task_train_eval_probe(tiny_model, tmp_path, capsys):
    model_dir = tmp_path / "model"
    save_pretrained(tiny_model, model_dir)
    data = tmp_path / "data"
    (data / "ud-english-ewt").mkdir(parents=True)
    upos = {"DET": "DET", "NOUN": "NOUN", "VERB": "VERB", "ADJ": "ADJ", "CCONJ": "CCONJ", "ADV": "ADV"}
    for name, seed in (("en_ewt-ud-train.conllu.gz", 0), ("en_ewt-ud-dev.conllu", 1), ("en_ewt-ud-test.conllu", 2)):
        sentences = synthetic_tagging(30, seed)
        for s in sentences:
            s.tags = [upos[t] for t in s.tags]
        _write_conllu(data / "ud-english-ewt" / name, sentences)
    (data / "wsd").mkdir()
    with gzip.open(data / "wsd" / "semcor3.0.tsv.gz", "wt", encoding="utf-8") as handle:
        for doc in range(5):
            handle.write(f"# doc = brown1/d{doc}\n# sent_id = s\n1\tthe\tthe\tDT\t_\t_\n"
                         f"2\tbank\tbank\tNN\tbank%1:1{doc % 2}:00::\t_\n3\tran_off\trun_off\tVB\trun_off%2:38:00::\t_\n\n")
    run = tmp_path / "run"
    assert main(["task", "train", "--task", "pos", "--model", str(model_dir), "--out", str(run),
                 "--data-dir", str(data), "--max-epochs", "2", "--no-progress", "--hidden-dim", "16", "--json"]) == 0
    trained = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert trained["elmo"] and (run / "results.json").is_file()
    assert main(["task", "eval", str(run), "--split", "dev", "--json", "--no-progress"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["accuracy"] == pytest.approx(trained["dev"]["accuracy"])
    assert main(["task", "train", "--task", "pos", "--model", "none", "--out", str(tmp_path / "plain"),
                 "--data-dir", str(data), "--max-epochs", "1", "--no-progress"]) == 0
    capsys.readouterr()
    probe_out = tmp_path / "probes"
    assert main(["task", "probe", "--model", str(model_dir), "--out", str(probe_out), "--data-dir", str(data),
                 "--no-progress"]) == 0
    probes = json.loads((probe_out / "probes.json").read_text())
    assert set(probes["pos"]) == {"layer_0", "layer_1", "layer_2"}
    assert probes["wsd"]["layer_0"]["n_test"] == 2  # one held-out document, two tagged tokens
    assert (probe_out / "probes.png").stat().st_size > 0


def test_cli_reports_bad_data(tmp_path, capsys):
    data = tmp_path / "data" / "ud-english-ewt"
    data.mkdir(parents=True)
    with gzip.open(data / "en_ewt-ud-train.conllu.gz", "wt", encoding="utf-8") as handle:
        handle.write("1\tcat\n")
    assert main(["task", "train", "--task", "pos", "--model", "none", "--out", str(tmp_path / "r"),
                 "--data-dir", str(tmp_path / "data"), "--no-progress"]) == 2
    assert "en_ewt-ud-train.conllu.gz:1: expected 10" in capsys.readouterr().err
