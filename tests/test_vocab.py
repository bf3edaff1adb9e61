"""`elmo vocab` and `Vocabulary`: ordering, cut-offs, counts, ids, bad files."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from elmokit.textfiles import CorpusError
from elmokit.training.vocab import Vocabulary, build_vocab, count_tokens, make_vocab


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "a.txt").write_text("b a c a\n\nd b a\n", encoding="utf-8")
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as handle:
        handle.write("c e\n   \n")
    return tmp_path


def test_vocab_order_counts_and_stats(corpus):
    stats = make_vocab([corpus / "a.txt", str(corpus / "*.gz")], corpus / "vocab.txt")
    # a:3, b:2, c:2, d:1, e:1 -> descending count, ties by token
    assert (corpus / "vocab.txt").read_text().split("\n") == ["<S>", "</S>", "<UNK>", "a", "b", "c", "d", "e", ""]
    written = json.loads((corpus / "vocab.json").read_text())
    assert written == stats
    assert stats["n_words"] == 9 and stats["n_sentences"] == 3
    assert stats["n_tokens"] == 12  # words + one </S> per sentence
    assert stats["n_types"] == 5 and stats["vocab_size"] == 8


def test_min_count_and_max_size(corpus):
    counts, n_sentences = count_tokens([corpus / "a.txt", corpus / "b.txt.gz"])
    assert n_sentences == 3
    assert build_vocab(counts, min_count=2) == ["<S>", "</S>", "<UNK>", "a", "b", "c"]
    assert build_vocab(counts, max_size=5) == ["<S>", "</S>", "<UNK>", "a", "b"]
    stats = make_vocab([corpus / "a.txt"], corpus / "v.txt", min_count=2)
    assert stats["n_unk_words"] == 2  # c and d, once each in a.txt
    with pytest.raises(ValueError, match="^max_size must exceed"):
        build_vocab(counts, max_size=3)
    with pytest.raises(ValueError, match="^min_count must be at least 1"):
        build_vocab(counts, min_count=0)


def test_special_tokens_in_corpus_are_not_duplicated(tmp_path):
    (tmp_path / "a.txt").write_text("<S> x </S> <UNK> x\n")
    make_vocab([tmp_path / "a.txt"], tmp_path / "vocab.txt")
    assert Vocabulary.load(tmp_path / "vocab.txt").tokens == ["<S>", "</S>", "<UNK>", "x"]


def test_vocabulary_ids_and_encode(corpus):
    make_vocab([corpus / "a.txt", corpus / "b.txt.gz"], corpus / "vocab.txt")
    vocab = Vocabulary.load(corpus / "vocab.txt")
    assert len(vocab) == 8 and vocab.n_tokens == 12
    assert (vocab.bos_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)
    assert vocab.token_to_id("a") == 3 and vocab.token_to_id("zzz") == 2
    ids = vocab.encode(["a", "zzz", "</S>", "e"])
    assert ids.dtype == np.int64 and ids.tolist() == [3, 2, 1, 7]
    assert vocab.encode([]).shape == (0,)
    assert vocab.decode([3, 1]) == ["a", "</S>"]


def test_original_vocab_order_and_no_stats_file(tmp_path):
    (tmp_path / "v.txt").write_text("</S>\n<S>\n<UNK>\nthe\n")  # the 1B Word Benchmark file's order
    vocab = Vocabulary.load(tmp_path / "v.txt")
    assert (vocab.bos_id, vocab.eos_id, vocab.unk_id, vocab.n_tokens) == (1, 0, 2, None)


@pytest.mark.parametrize("text, message", [
    ("", "is empty"),
    ("<S>\n</S>\n<UNK>\nthe\nof\nthe\n", r"v\.txt:6: duplicate token 'the' \(first on line 4\)"),
    ("<S>\n</S>\n\n<UNK>\n", r"v\.txt:3: expected one token"),
    ("<S>\n</S>\n<UNK>\ntwo words\n", r"v\.txt:4: expected one token"),
    ("<S>\nthe\n", r"lacks </S>, <UNK>"),
])
def test_bad_vocab_files(tmp_path, text, message):
    (tmp_path / "v.txt").write_text(text)
    with pytest.raises(ValueError, match=message):
        Vocabulary.load(tmp_path / "v.txt")


def test_missing_and_undecodable_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="elmo vocab"):
        Vocabulary.load(tmp_path / "absent.txt")
    (tmp_path / "bad.txt").write_bytes(b"ok line\nok\nbad \xc3\x28 line\n")
    with pytest.raises(CorpusError, match=r"bad\.txt:3: invalid UTF-8 byte 0xc3"):
        make_vocab([tmp_path / "bad.txt"], tmp_path / "vocab.txt")
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(CorpusError, match="every line is blank"):
        make_vocab([tmp_path / "blank.txt"], tmp_path / "vocab.txt")
    assert not (tmp_path / "vocab.txt").exists()


def test_vocab_cli(corpus, capsys):
    from elmokit.cli import main

    assert main(["vocab", str(corpus / "a.txt"), "-o", str(corpus / "out" / "vocab.txt"), "--max-size", "4"]) == 0
    assert "4 entries" in capsys.readouterr().err  # what it did: a message on stderr
    assert Vocabulary.load(corpus / "out" / "vocab.txt").tokens == ["<S>", "</S>", "<UNK>", "a"]
