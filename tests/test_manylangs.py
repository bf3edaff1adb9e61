"""ELMoForManyLangs model folders (elmokit.model.manylangs): their numbers, their quirks, safe
loading, conversion; and `elmo prepare --lang zh`.

The expected vectors in tests/fixtures/manylangs/ come from their own `Embedder.sents2elmo` on
models their own training script wrote (scripts/make_manylangs_fixture.py says how).
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elmokit import Elmo, ElmoEmbedder, batch_to_ids, hub
from elmokit.cli import main
from elmokit.extras import MissingExtraError
from elmokit.model.config import ConfigError, ManyLangsConfig
from elmokit.model.manylangs import ManyLangsBiLM, is_manylangs_dir, load_manylangs
from elmokit.model.manylangs_files import KNOWN_CONFIGS, read_dictionary, read_model_config
from elmokit.sources.loading import load_model
from elmokit.model.weights import WeightFileError, load_pretrained
from elmokit.training.corpus import prepare_corpus
from tests.conftest import DATA, one_error_line, require_shared

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "manylangs"
MODELS = ("words", "chars-only")  # with a word embedding (zip pickles); without (legacy pickles)
OUTPUT_LAYERS = (-1, -2, 0, 1, 2)  # theirs: average, all, token layer, LSTM 1, LSTM 2
TOLERANCE = 1e-5
SENTENCES = json.loads((FIXTURES / "sentences.json").read_text(encoding="utf-8"))


def their_output(layers: np.ndarray, output_layer: int) -> np.ndarray:
    """What their sents2elmo returns for one sentence, from elmokit's (L+1, n, 2P)."""
    if output_layer == -1:
        return layers.mean(axis=0)
    return layers if output_layer == -2 else layers[output_layer]


def max_difference(per_sentence: list[np.ndarray], name: str, output_layer: int, shaped: bool = False) -> float:
    """Largest |elmokit - theirs| over the fixture sentences; `per_sentence` holds elmokit's
    (L+1, n, 2P) arrays, or with `shaped` arrays already in their output_layer's shape."""
    with np.load(FIXTURES / f"{name}-expected.npz") as expected:
        differences = []
        for index, ours in enumerate(per_sentence):
            theirs = expected[f"layer{output_layer}_{index}"]
            ours = ours if shaped else their_output(ours, output_layer)
            assert ours.shape == theirs.shape, (name, output_layer, index)
            differences.append(float(np.abs(ours - theirs).max()))
    return max(differences)


@pytest.mark.parametrize("name", MODELS)
def test_their_numbers_through_elmo_embedder(name):
    """Every output_layer they offer, within 1e-5, ElmoEmbedder given the folder itself."""
    embedder = ElmoEmbedder(str(FIXTURES / name))
    assert isinstance(embedder.bilm, ManyLangsBiLM)
    batched = embedder.embed_batch(SENTENCES)
    one_by_one = [embedder.embed_sentence(sentence) for sentence in SENTENCES]
    streamed = embedder.embed_many(SENTENCES, rows=2)
    for output_layer in OUTPUT_LAYERS:
        for vectors in (batched, one_by_one, streamed):
            assert max_difference(vectors, name, output_layer) < TOLERANCE, output_layer


def test_their_numbers_through_the_cli(tmp_path):
    """`elmo embed --model FOLDER`: all layers, and --average (their output_layer=-1)."""
    source = tmp_path / "in.txt"
    source.write_text("".join(" ".join(sentence) + "\n" for sentence in SENTENCES), encoding="utf-8")
    model = str(FIXTURES / "words")
    assert main(["embed", str(source), str(tmp_path / "all.npz"), "--all", "--model", model, "--quiet"]) == 0
    assert main(["embed", str(source), str(tmp_path / "avg.npz"), "--average", "--model", model, "--quiet"]) == 0
    with np.load(tmp_path / "all.npz") as all_layers, np.load(tmp_path / "avg.npz") as average:
        layers = [all_layers[str(index)] for index in range(len(SENTENCES))]
        for output_layer in OUTPUT_LAYERS:
            assert max_difference(layers, "words", output_layer) < TOLERANCE
        averaged = [average[str(index)] for index in range(len(SENTENCES))]
        assert max_difference(averaged, "words", -1, shaped=True) < TOLERANCE


def test_elmo_and_hub_take_the_folder():
    """AllenNLP's Elmo and TF-Hub's module take the folder; ELMo's byte ids are refused."""
    model = str(FIXTURES / "words")
    elmo = Elmo(model, None, 1, dropout=0.0)
    representations = elmo(elmo.bilm.batch_ids(SENTENCES[:2]))["elmo_representations"][0]  # (B, T, 2P)
    outputs = hub.load(model)([" ".join(sentence) for sentence in SENTENCES[:2]], signature="default", as_dict=True)
    with np.load(FIXTURES / "words-expected.npz") as expected:
        for index, sentence in enumerate(SENTENCES[:2]):
            token_layer = outputs["word_emb"][index, :len(sentence)].detach().numpy()  # (n, P)
            assert np.abs(np.tile(token_layer, 2) - expected[f"layer0_{index}"]).max() < TOLERANCE
            mixed = representations[index, :len(sentence)].detach().numpy()  # equal weights, gamma 1: the average
            assert np.abs(mixed - expected[f"layer-1_{index}"]).max() < TOLERANCE
    with pytest.raises(ValueError, match=r"bilm.batch_ids\(sentences\) \(ELMoForManyLangs: not ELMo's batch_to_ids"):
        elmo(batch_to_ids(SENTENCES[:2]))  # 50 byte ids a token, not theirs: an error naming what to use
    with pytest.raises(ValueError, match="not ELMo's byte-level batch_to_ids"):
        elmo.bilm.encode_tokens(batch_to_ids(SENTENCES[:2]))


def test_load_model_and_folder_detection():
    assert is_manylangs_dir(FIXTURES / "words") and not is_manylangs_dir(FIXTURES) and not is_manylangs_dir(None)
    model = load_model(FIXTURES / "chars-only")
    assert isinstance(model, ManyLangsBiLM) and model.config.word_dim == 0


@pytest.mark.parametrize("missing", ["encoder.pkl", "token_embedder.pkl"])
def test_a_folder_missing_a_pickle_names_it(tmp_path, missing):
    folder = tmp_path / "model"
    shutil.copytree(FIXTURES / "words", folder)
    (folder / missing).unlink()
    with pytest.raises(FileNotFoundError, match=rf"{missing}: not found \(an ELMoForManyLangs model folder holds it\)"):
        load_model(folder)


def test_a_character_id_past_the_table_names_the_folder(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(FIXTURES / "words", folder)
    with open(folder / "char.dic", "a", encoding="utf-8") as handle:
        handle.write("\u2603\t100000\n")
    with pytest.raises(ConfigError, match=rf"{folder}: the character vocabulary has id 100000.*char.dic"):
        load_model(folder)


@pytest.mark.parametrize("change", ["forget bias", "highway gate", "begin/end of word"])
def test_each_quirk_matters(change):
    """The fixture tells each convention from its alternative: a model loaded with the bilm-tf
    forget-bias convention kept (+1 more), an unnegated highway gate, or bilm-tf's begin/end-of-word
    order is off by far more than the tolerance."""
    model = load_manylangs(FIXTURES / "words")
    with torch.no_grad():
        if change == "forget bias":
            for layer in model.lstm.layers:
                layer.bias[:, :, layer.cell_dim:2 * layer.cell_dim] += 1.0
        elif change == "highway gate":
            for layer in model.token_encoder.highway.layers:
                n_filters = layer.weight.shape[1]
                layer.weight[n_filters:] *= -1
                layer.bias[n_filters:] *= -1
    if change == "begin/end of word":
        vocabulary = model.vocabulary
        swapped = dict(vocabulary.chars, **{"<bow>": vocabulary.chars["<eow>"], "<eow>": vocabulary.chars["<bow>"]})
        model.vocabulary = type(vocabulary)(swapped, vocabulary.words, vocabulary.max_chars)
    vectors = ElmoEmbedder(module=model).embed_batch(SENTENCES)
    assert max_difference(vectors, "words", -2) > 100 * TOLERANCE


def test_token_ids_follow_their_create_one_batch():
    model = load_manylangs(FIXTURES / "words")
    chars = read_dictionary(FIXTURES / "words" / "char.dic")
    words = read_dictionary(FIXTURES / "words" / "word.dic")
    ids = model.token_ids(["天气", "supercalifragilistic", "𠀀😀", "<S>", "</S>"]) - 1  # theirs
    assert ids.shape == (5, 10 + 1)  # W = 10 chars + the word id
    eow, bow, pad, oov = chars["<eow>"], chars["<bow>"], chars["<pad>"], chars["<oov>"]
    assert ids[0].tolist() == [eow, chars["天"], chars["气"], bow] + [pad] * 6 + [words["天气"]]
    cut = "supercal"  # W - 2 code points, before both lookups
    assert ids[1, :10].tolist() == [eow, *(chars[c] for c in cut), bow] and ids[1, 10] == words["supercal"]
    assert ids[2].tolist() == [eow, oov, chars["😀"], bow] + [pad] * 6 + [words["<oov>"]]
    assert ids[3].tolist() == [eow, chars["<bos>"], bow] + [pad] * 7 + [words["<bos>"]]
    assert ids[4].tolist() == [eow, chars["<eos>"], bow] + [pad] * 7 + [words["<eos>"]]
    assert (model.batch_ids([["好"], []])[1] == 0).all()  # padding rows stay zero


def their_ids(tokens: list[str], chars: dict[str, int], words: dict[str, int], width: int) -> list[list[int]]:
    """Their read_list + create_one_batch for one token at a time, written out plainly (for the
    property test below), with elmokit's "<S>"/"</S>" as their "<bos>"/"<eos>"."""
    rows = []
    for token in tokens:
        cut = token[:width - 2]
        name = "<bos>" if "<bos>" in (cut, {"<S>": "<bos>"}.get(token)) else \
            "<eos>" if "<eos>" in (cut, {"</S>": "<eos>"}.get(token)) else None
        row = [chars["<eow>"]] + [chars["<pad>"]] * (width - 1)
        letters = [chars[name]] if name else [chars.get(c, chars["<oov>"]) for c in cut]
        row[1:len(letters) + 1] = letters
        row[len(letters) + 1] = chars["<bow>"]
        rows.append(row + [words.get(name or cut, words["<oov>"])])
    return rows


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(st.sampled_from("今天气真好我们学习中文😀<>bos/Sx 𠀀\ud800é") | st.characters(), max_size=12)
                | st.sampled_from(["<S>", "</S>", "<bos>", "<eos>", "<oov>", ""]), max_size=8))
def test_token_ids_match_their_batching_for_any_text(tokens):
    model = _words_model()
    vocabulary = model.vocabulary
    expected = their_ids(tokens, vocabulary.chars, vocabulary.words, vocabulary.max_chars)
    assert (model.token_ids(tokens) - 1).tolist() == (expected or np.zeros((0, 11), np.int64).tolist())


_MODELS: dict[str, ManyLangsBiLM] = {}


def _words_model() -> ManyLangsBiLM:
    if "words" not in _MODELS:
        _MODELS["words"] = load_manylangs(FIXTURES / "words")
    return _MODELS["words"]


def test_dictionary_reading_quirks(tmp_path):
    """Their reader strips each line, so an entry that is whitespace loses itself: the id goes to
    "\\u3000"; a later line for the same entry wins; a malformed line names file and line."""
    path = tmp_path / "char.dic"
    path.write_text("a\t0\n \t1\nb\t2\na\t3\n", encoding="utf-8")
    assert read_dictionary(path) == {"a": 3, "\u3000": 1, "b": 2}
    path.write_text("a\t0\nb\tc\t2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"char.dic:2: expected 'entry<TAB>id'"):
        read_dictionary(path)
    path.write_text("a\t0\nb\t-1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"char.dic:2: expected 'entry<TAB>id' with an id >= 0"):
        read_dictionary(path)


def test_published_config_found_as_their_embedder_finds_it(tmp_path):
    """A published folder's config.json names their package's config by a path outside the folder."""
    folder = tmp_path / "zhs.model"
    shutil.copytree(FIXTURES / "words", folder)
    (folder / "cnn_tiny.json").unlink()
    options = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**options, "config_path": "../configs/cnn_50_100_512_4096_sample.json"}))
    assert read_model_config(folder) == KNOWN_CONFIGS["cnn_50_100_512_4096_sample.json"]
    with pytest.raises(WeightFileError, match=r"token_embedder.pkl: tensors do not match the model config: missing \['convolutions.3.bias'"):
        load_manylangs(folder)  # the tiny weights do not fit the published shape: said, not crashed
    (folder / "config.json").write_text(json.dumps({**options, "config_path": "elsewhere/unknown.json"}))
    with pytest.raises(FileNotFoundError, match="unknown.json"):
        load_manylangs(folder)


class _Planted:
    """Unpickling this would run os.system: a safe loader never builds it."""

    def __reduce__(self):
        import os

        return os.system, (f"touch {_Planted.marker}",)


def test_a_pickle_with_objects_is_refused_unrun(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(FIXTURES / "words", folder)
    _Planted.marker = tmp_path / "ran"
    state = torch.load(folder / "encoder.pkl", weights_only=True)
    with open(folder / "encoder.pkl", "wb") as handle:
        pickle.dump({**state, "extra": _Planted()}, handle, protocol=2)
    with pytest.raises(WeightFileError, match=r"encoder.pkl: refused: it holds something other than tensors"):
        load_manylangs(folder)
    assert not _Planted.marker.exists()
    torch.save({"weights": [1, 2]}, folder / "encoder.pkl")  # plain data, but not a state dict of tensors
    with pytest.raises(WeightFileError, match=r"encoder.pkl: expected a state dict"):
        load_manylangs(folder)


def _embed_one_line(tmp_path, model: Path) -> int:
    source = tmp_path / "in.txt"
    source.write_text("a b\n", encoding="utf-8")
    return main(["embed", str(source), str(tmp_path / "out.npz"), "--model", str(model), "--quiet"])


def _folder_with(tmp_path, section: str, key: str, value) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(FIXTURES / "words", folder)
    config = json.loads((folder / "cnn_tiny.json").read_text())
    config[section][key] = value
    (folder / "cnn_tiny.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("section, key, value", [
    ("token_embedder", "max_characters_per_token", 10**5),  # no weight bounds W: a cap does (was: 1.5 GB at 2e8)
    ("token_embedder", "n_highway", 10**6),  # counts: bounded by the tensors the pickles hold
    ("encoder", "n_layers", 10**6),
    ("token_embedder", "filters", [[1, 4]] * 10**4),
    ("encoder", "dim", 10**12),  # sizes: bounded by the pickles' shapes
    ("encoder", "projection_dim", 10**12),
    ("token_embedder", "char_dim", 10**12),
    ("token_embedder", "word_dim", 10**12),
])
def test_every_size_of_their_config_is_bounded_before_allocating(tmp_path, capsys, section, key, value):
    """A size out of what the folder can hold is refused with exit 2 naming the key (or, for a
    table's size, the tensor whose shape it contradicts), before anything of that size is made."""
    folder = _folder_with(tmp_path, section, key, value)
    assert _embed_one_line(tmp_path, folder) == 2
    named = {"dim": "input_linearity.weight", "projection_dim": "projection.weight",
             "char_dim": "char_emb_layer.embedding.weight", "word_dim": "projection.weight"}
    one_error_line(capsys, named.get(key, f"{section}.{key}"))
    assert not (tmp_path / "out.npz").exists()


def test_a_native_folders_manylangs_sizes_are_bounded(tmp_path, capsys):
    """The native format's `manylangs` section: W is capped as in their folder, before the
    vocabulary's (W,) rows exist; table sizes are checked against model.safetensors' shapes."""
    native = tmp_path / "native"
    assert main(["convert", "--model", str(FIXTURES / "words"), "--to-native", str(native), "--quiet"]) == 0
    saved = json.loads((native / "config.json").read_text())
    for key, value, named in (("max_characters_per_token", 10**5, "manylangs.max_characters_per_token"),
                              ("n_char_ids", 10**12, "char_embedding.weight"),
                              ("n_word_ids", 10**12, "word_embedding.weight")):
        (native / "config.json").write_text(json.dumps({**saved, "manylangs": {**saved["manylangs"], key: value}}))
        assert _embed_one_line(tmp_path, native) == 2
        one_error_line(capsys, named)


def _refusal(folder: Path, capsys) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["embed", str(folder / "in.txt"), str(folder / "out.npz"), "--model", str(folder)]) == 2
    assert not caught, [str(warning.message) for warning in caught]  # torch's own warnings are not shown
    return one_error_line(capsys, "encoder.pkl")


@pytest.mark.parametrize("how", ["pickle protocol 2", "pickle protocol 5", "torch.save", "torch.save legacy"])
def test_the_pickle_refusal_is_one_line_of_ours(tmp_path, capsys, how):
    """Refused as one line naming what the pickle holds, without torch's advice to load it with
    weights_only=False, its terminal colours or its warning about the protocol."""
    folder = tmp_path / "model"
    shutil.copytree(FIXTURES / "words", folder)
    (folder / "in.txt").write_text("a b\n", encoding="utf-8")
    _Planted.marker = tmp_path / "ran"
    state = {**torch.load(folder / "encoder.pkl", weights_only=True), "extra": _Planted()}
    if how.startswith("pickle"):
        with open(folder / "encoder.pkl", "wb") as handle:
            pickle.dump(state, handle, protocol=int(how[-1]))
    else:
        torch.save(state, folder / "encoder.pkl", _use_new_zipfile_serialization=how == "torch.save")
    message = _refusal(folder, capsys)
    assert "refused: it holds something other than tensors" in message
    assert "weights_only" not in message and "\x1b" not in message and "trust" not in message, message
    if how.startswith("torch.save"):
        assert "(it names posix.system)" in message or "(it names nt.system)" in message, message
    assert not _Planted.marker.exists()


def test_a_pickle_that_is_not_one_is_a_clear_error(tmp_path, capsys):
    folder = tmp_path / "model"
    shutil.copytree(FIXTURES / "words", folder)
    (folder / "in.txt").write_text("a b\n", encoding="utf-8")
    for content in (b"hello world", b""):  # torch's legacy reader raised KeyError '101' on the first
        (folder / "encoder.pkl").write_bytes(content)
        assert "not a readable torch state dict" in _refusal(folder, capsys)


def test_convert_to_native_rebuilds_the_same_model(tmp_path):
    out = tmp_path / "native"
    assert main(["convert", "--model", str(FIXTURES / "words"), "--to-native", str(out)]) == 0
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "manylangs_vocab.json", "model.safetensors"]
    native = load_pretrained(out)
    assert isinstance(native.config, ManyLangsConfig) and native.config == load_manylangs(FIXTURES / "words").config
    for output_layer in OUTPUT_LAYERS:
        assert max_difference(ElmoEmbedder(str(out)).embed_batch(SENTENCES), "words", output_layer) < TOLERANCE
    assert main(["convert", "--model", str(out), "--to-original", str(tmp_path / "o.json"), str(tmp_path / "w.hdf5")]) != 0
    assert not (tmp_path / "o.json").exists()


def test_convert_to_original_is_refused(tmp_path, capsys):
    options, weights = tmp_path / "options.json", tmp_path / "weights.hdf5"
    assert main(["convert", "--model", str(FIXTURES / "words"), "--to-original", str(options), str(weights)]) != 0
    message = capsys.readouterr().err
    assert "cannot hold its character vocabulary" in message and "word embedding" in message
    assert not options.exists() and not weights.exists()


# ---------------------------------------------------------------------------------------------
# elmo prepare --lang zh
# ---------------------------------------------------------------------------------------------
def _prepare(tmp_path, lines: list[str], *extra: str) -> list[list[str]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = tmp_path / "raw.txt"
    source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    out = tmp_path / "out"
    assert main(["prepare", str(source), "-o", str(out), "--lang", "zh", "--plain", "--workers", "1",
                 "--quiet", *extra]) == 0
    return [line.split() for line in (out / "shard-00000.txt").read_text(encoding="utf-8").splitlines()]


def test_prepare_zh_segments_words(tmp_path):
    pytest.importorskip("jieba")
    lines = ["我们喜欢学习中文。他在北京大学学习！", "北京大学成立于1898年。"]
    sentences = _prepare(tmp_path, lines)
    assert sentences[:2] == [["我们", "喜欢", "学习", "中文", "。"], ["他", "在", "北京大学", "学习", "！"]]
    assert "1898" in sentences[2] and "".join(sum(sentences, [])) == "".join(lines)  # nothing lost


def test_prepare_zh_agrees_with_gold_segmentation(tmp_path):
    """On UD Chinese GSDSimp (gold words): jieba finds most word boundaries (F1 of the words)."""
    pytest.importorskip("jieba")
    conllu = require_shared(DATA / "ud-chinese-gsdsimp" / "zh_gsdsimp-ud-dev.conllu")
    gold, words = [], []
    for line in conllu.read_text(encoding="utf-8").splitlines():
        if line and line[0].isdigit() and "-" not in line.split("\t")[0]:
            words.append(line.split("\t")[1])
        elif not line and words:
            gold.append(words)
            words = []
    gold = [sentence for sentence in gold if not any(" " in word for word in sentence)][:50]
    predicted = sum(_prepare(tmp_path, ["".join(sentence) for sentence in gold], "--raw"), [])
    gold_words = sum(gold, [])
    assert "".join(predicted) == "".join(gold_words)

    def spans(words: list[str]) -> set[tuple[int, int]]:
        ends = np.cumsum([len(word) for word in words])
        return set(zip((ends - [len(word) for word in words]).tolist(), ends.tolist()))

    hits = len(spans(gold_words) & spans(predicted))
    precision, recall = hits / len(predicted), hits / len(gold_words)
    assert 2 * precision * recall / (precision + recall) > 0.75


def test_prepare_zh_detects_segmented_input_and_names_its_extra(tmp_path, monkeypatch, capsys):
    assert _prepare(tmp_path, ["我们 喜欢 学习 中文 。"]) == [["我们", "喜欢", "学习", "中文", "。"]]  # passed through
    monkeypatch.setitem(sys.modules, "jieba", None)  # not installed
    raw = tmp_path / "raw.txt"
    raw.write_text("我们喜欢学习中文。\n", encoding="utf-8")
    assert main(["prepare", str(raw), "-o", str(tmp_path / "again"), "--lang", "zh", "--quiet"]) == 2
    assert "pip install 'elmokit[zh]'" in capsys.readouterr().err
    with pytest.raises(MissingExtraError, match=r"elmo prepare --lang zh needs jieba"):
        prepare_corpus([raw], tmp_path / "again", lang="zh", progress=False)


def test_the_parity_table_of_the_docs_is_what_the_script_prints_now():
    """docs/manylangs.md quotes `make_manylangs_fixture.py --check`: each figure within a factor of 2
    of a fresh run (the run's last digits move with the CPU's kernels), all of them below 1e-5."""
    import re
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    fresh = subprocess.run([sys.executable, str(repo / "scripts" / "make_manylangs_fixture.py"), "--check"],
                           capture_output=True, text=True, check=True, cwd=repo).stdout

    def figures(text: str) -> dict[str, list[float]]:
        rows = re.findall(r"^\| (words|chars-only) \|(.*)\|$", text, re.M)
        return {name: [float(value) for value in cells.split("|")] for name, cells in rows}

    page, now = figures((repo / "docs" / "manylangs.md").read_text(encoding="utf-8")), figures(fresh)
    assert sorted(page) == sorted(now) == ["chars-only", "words"]
    for name in now:
        for quoted, measured in zip(page[name], now[name], strict=True):
            assert measured < 1e-5 and measured / 2 <= quoted <= measured * 2, (name, quoted, measured)
