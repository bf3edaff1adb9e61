"""The LM data pipeline: bilm-tf window layout, coverage, shuffling, resume, rank split, bad input."""

from __future__ import annotations

import collections
import gzip
import json
import random
from pathlib import Path

import pytest
import torch

from elmokit.model.chars import tokens_to_char_ids
from elmokit.textfiles import CorpusError
from elmokit.training.data import LMBatch, LMBatcher, SentenceStream, eval_batches
from elmokit.training.vocab import Vocabulary, make_vocab

WORDS = [f"w{i}" for i in range(30)]


def write_corpus(directory: Path, n_files: int = 4, n_sentences: int = 25, seed: int = 0) -> list[str]:
    """Shards of unique random sentences (every other one gzip); returns the sentences in order."""
    rng = random.Random(seed)
    sentences = []
    for index in range(n_files):
        lines = [f"s{index}_{k} " + " ".join(rng.choices(WORDS, k=rng.randint(0, 12)))
                 for k in range(n_sentences)]
        sentences += [line.strip() for line in lines]
        text = "\n".join(lines) + "\n"
        if index % 2:
            with gzip.open(directory / f"shard-{index:05d}.txt.gz", "wt", encoding="utf-8") as handle:
                handle.write(text)
        else:
            (directory / f"shard-{index:05d}.txt").write_text(text, encoding="utf-8")
    return sentences


def vocab_for(directory: Path) -> Vocabulary:
    make_vocab([str(directory / "shard-*")], directory / "vocab.txt")
    return Vocabulary.load(directory / "vocab.txt")


def sentences_of(batches: list[LMBatch], vocab: Vocabulary) -> list[str]:
    """Rebuild the sentences from each row's forward targets (w1 .. wn </S>, one after another)."""
    rows = collections.defaultdict(list)
    for batch in batches:
        for row in range(batch.mask.shape[0]):
            rows[row] += vocab.decode(batch.forward_targets[row][batch.mask[row]].tolist())
    sentences = []
    for tokens in rows.values():
        assert not tokens or tokens[-1] == "</S>"
        sentences += " ".join(tokens).split(" </S>")[:-1] if tokens else []
    return [sentence.strip() for sentence in sentences]


def assert_batches_equal(first: list[LMBatch], second: list[LMBatch]) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second):
        for name in ("forward_char_ids", "backward_char_ids", "forward_targets", "backward_targets", "mask"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.n_tokens == b.n_tokens


def test_layout_of_a_two_sentence_corpus(tmp_path):
    (tmp_path / "toy.txt").write_text("a b\nc\n")
    vocab = Vocabulary(["<S>", "</S>", "<UNK>", "a", "b", "c"])
    batches = list(eval_batches([tmp_path / "toy.txt"], vocab, batch_size=1, unroll_steps=3))
    assert len(batches) == 2
    first, second = batches
    # forward pairs: <S>->a a->b b-></S> | <S>->c c-></S>; backward: </S>->b b->a a-><S> | </S>->c c-><S>
    assert first.forward_targets.tolist() == [[3, 4, 1]]
    assert first.backward_targets.tolist() == [[4, 3, 0]]
    assert torch.equal(first.forward_char_ids[0], torch.from_numpy(tokens_to_char_ids(["<S>", "a", "b"])))
    assert torch.equal(first.backward_char_ids[0], torch.from_numpy(tokens_to_char_ids(["</S>", "b", "a"])))
    assert first.mask.tolist() == [[True, True, True]] and first.n_tokens == 3
    assert second.forward_targets.tolist() == [[5, 1, 0]]
    assert second.backward_targets.tolist() == [[5, 0, 0]]
    assert torch.equal(second.forward_char_ids[0, :2], torch.from_numpy(tokens_to_char_ids(["<S>", "c"])))
    assert torch.equal(second.backward_char_ids[0, :2], torch.from_numpy(tokens_to_char_ids(["</S>", "c"])))
    assert second.mask.tolist() == [[True, True, False]] and second.n_tokens == 2
    assert second.forward_char_ids[0, 2].eq(0).all() and second.backward_char_ids[0, 2].eq(0).all()
    assert first.forward_char_ids.shape == (1, 3, 50) and first.forward_char_ids.dtype == torch.int64


def test_rows_pull_sentences_in_turn(tmp_path):
    (tmp_path / "toy.txt").write_text("a b\nc\na\n")
    vocab = Vocabulary(["<S>", "</S>", "<UNK>", "a", "b", "c"])
    first, second, third = eval_batches([tmp_path / "toy.txt"], vocab, batch_size=2, unroll_steps=2)
    # row 0: "a b" (3 pairs) then "a" (2 pairs); row 1: "c" (2 pairs), then nothing is left
    assert first.forward_targets.tolist() == [[3, 4], [5, 1]]
    assert second.forward_targets.tolist() == [[1, 3], [0, 0]]
    assert second.backward_targets.tolist() == [[0, 3], [0, 0]]  # a-><S> ends "a b"; </S>->a starts "a"
    assert second.mask.tolist() == [[True, True], [False, False]]
    assert third.forward_targets.tolist() == [[1, 0], [0, 0]] and third.backward_targets.tolist() == [[0, 0], [0, 0]]
    assert third.mask.tolist() == [[True, False], [False, False]] and third.n_tokens == 1


def test_eval_covers_every_pair_exactly_once(tmp_path):
    sentences = write_corpus(tmp_path)
    vocab = vocab_for(tmp_path)
    batches = list(eval_batches(sorted(tmp_path.glob("shard-*")), vocab, batch_size=3, unroll_steps=5))
    assert sum(batch.n_tokens for batch in batches) == vocab.n_tokens == sum(len(s.split()) + 1 for s in sentences)
    assert sorted(sentences_of(batches, vocab)) == sorted(sentences)
    forward_rows, backward_rows = collections.defaultdict(list), collections.defaultdict(list)
    for batch in batches:
        assert batch.n_tokens == int(batch.mask.sum())
        assert (batch.forward_targets[~batch.mask] == 0).all() and (batch.backward_targets[~batch.mask] == 0).all()
        for row in range(batch.mask.shape[0]):
            forward_rows[row] += vocab.decode(batch.forward_targets[row][batch.mask[row]].tolist())
            backward_rows[row] += vocab.decode(batch.backward_targets[row][batch.mask[row]].tolist())
    assert forward_rows.keys() == backward_rows.keys()
    for row, forward in forward_rows.items():
        backward = backward_rows[row]
        # the backward stream holds the same tokens: each row's multiset matches, </S> ending a
        # forward sentence where <S> ends a backward one
        assert collections.Counter(backward) == collections.Counter(["<S>" if t == "</S>" else t for t in forward])
        # and in order: each sentence reversed, followed by <S>
        backward_sentences = [" ".join(reversed(piece.split())) for piece in " ".join(backward).split("<S>")[:-1]]
        assert backward_sentences == [piece.strip() for piece in " ".join(forward).split("</S>")[:-1]]


def test_shuffled_epoch_covers_the_corpus_and_depends_on_seed(tmp_path):
    sentences = write_corpus(tmp_path)
    vocab = vocab_for(tmp_path)
    files = str(tmp_path / "shard-*")

    def epoch(seed: int, epoch: int = 0) -> list[str]:
        return sentences_of(list(LMBatcher(files, vocab, 4, 6, seed=seed, epoch=epoch, buffer_size=7)), vocab)

    assert sorted(epoch(1)) == sorted(sentences)
    assert epoch(1) == epoch(1)
    assert epoch(1) != epoch(2) and epoch(1) != epoch(1, epoch=1)


@pytest.mark.parametrize("cut", [0, 1, 7, 19, 33])
def test_resume_from_state_dict_gives_identical_batches(tmp_path, cut):
    write_corpus(tmp_path, n_files=3, n_sentences=40)
    vocab = vocab_for(tmp_path)
    arguments = dict(files=str(tmp_path / "shard-*"), vocab=vocab, batch_size=3, unroll_steps=4, seed=5,
                     epoch=2, buffer_size=9)
    full = LMBatcher(**arguments)
    uninterrupted = list(full)
    assert len(uninterrupted) > 33

    first = LMBatcher(**arguments)
    head = [next(first) for _ in range(cut)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = LMBatcher(**arguments)
    resumed.load_state_dict(state)
    assert_batches_equal(head + list(resumed), uninterrupted)
    assert resumed.counters == full.counters and resumed.n_batches == full.n_batches


def test_resume_with_a_changed_argument_is_refused(tmp_path):
    write_corpus(tmp_path, n_files=1)
    vocab = vocab_for(tmp_path)
    batcher = LMBatcher(str(tmp_path / "shard-*"), vocab, 2, 4, seed=1)
    next(batcher)
    other = LMBatcher(str(tmp_path / "shard-*"), vocab, 2, 4, seed=2)
    with pytest.raises(ValueError, match="seed=1"):
        other.load_state_dict(batcher.state_dict())


def test_max_sentences_reads_the_first_sentences_and_must_match_on_resume(tmp_path):
    sentences = write_corpus(tmp_path)  # 4 files of 25: the limit crosses from the first file into the second
    vocab = vocab_for(tmp_path)
    files = sorted(tmp_path.glob("shard-*"))
    batches = list(eval_batches(files, vocab, batch_size=3, unroll_steps=5, max_sentences=30))
    assert sorted(sentences_of(batches, vocab)) == sorted(sentences[:30])
    limited = LMBatcher(files, vocab, 2, 4, shuffle=False, max_sentences=4)
    next(limited)
    for other in (LMBatcher(files, vocab, 2, 4, shuffle=False), LMBatcher(files, vocab, 2, 4, shuffle=False,
                                                                        max_sentences=5)):
        with pytest.raises(ValueError, match="max_sentences=4"):  # either way round
            other.load_state_dict(limited.state_dict())
    with pytest.raises(ValueError, match="max_sentences=None"):
        limited.load_state_dict(LMBatcher(files, vocab, 2, 4, shuffle=False).state_dict())
    with pytest.raises(ValueError, match="one rank"):
        LMBatcher(files, vocab, 2, 4, world_size=2, max_sentences=4)


@pytest.mark.parametrize("n_files, world_size", [(4, 2), (5, 2), (2, 3), (1, 2)])
def test_ranks_read_disjoint_parts_that_cover_the_corpus(tmp_path, n_files, world_size):
    sentences = write_corpus(tmp_path, n_files=n_files, n_sentences=10)
    vocab = vocab_for(tmp_path)
    per_rank = [sentences_of(list(LMBatcher(str(tmp_path / "shard-*"), vocab, 2, 5, seed=3, rank=rank,
                                            world_size=world_size)), vocab)
                for rank in range(world_size)]
    assert all(per_rank)
    assert sorted(sum(per_rank, [])) == sorted(sentences)  # disjoint (sentences are unique) and complete
    split_by_line = n_files < world_size
    stream = SentenceStream(sorted(tmp_path.glob("shard-*")), rank=0, world_size=world_size)
    assert stream.split_by_line == split_by_line


def test_empty_lines_and_files_are_skipped_and_counted(tmp_path):
    (tmp_path / "a.txt").write_text("x y\n\n   \nz\n")
    (tmp_path / "b.txt").write_text("")
    with gzip.open(tmp_path / "c.txt.gz", "wt") as handle:
        handle.write("\n\n")
    stream = SentenceStream(sorted(tmp_path.glob("*.txt*")), shuffle=False)
    assert list(stream) == ["x y", "z"]
    assert stream.counters.empty_lines == 4
    assert stream.counters.empty_files == 2
    assert stream.counters.sentences == 2


def test_undecodable_bytes_name_file_and_line(tmp_path):
    (tmp_path / "bad.txt").write_text("fine\n" * 3)
    with open(tmp_path / "bad.txt", "ab") as handle:
        handle.write(b"caf\xe9 latin-1\n")
    vocab = Vocabulary(["<S>", "</S>", "<UNK>"])
    with pytest.raises(CorpusError, match=r"bad\.txt:4: invalid UTF-8 byte 0xe9"):
        list(LMBatcher([tmp_path / "bad.txt"], vocab, 2, 3))


def test_bad_arguments(tmp_path):
    (tmp_path / "a.txt").write_text("a\n")
    vocab = Vocabulary(["<S>", "</S>", "<UNK>"])
    with pytest.raises(ValueError, match="rank"):
        LMBatcher([tmp_path / "a.txt"], vocab, 2, 3, rank=2, world_size=2)
    with pytest.raises(ValueError, match="unroll_steps"):
        LMBatcher([tmp_path / "a.txt"], vocab, 2, 0)
    with pytest.raises(FileNotFoundError, match="absent"):
        LMBatcher([tmp_path / "absent.txt"], vocab, 2, 3)


def test_batch_to_device(tmp_path):
    (tmp_path / "a.txt").write_text("a b c\n")
    vocab = Vocabulary(["<S>", "</S>", "<UNK>", "a"])
    batch = next(iter(LMBatcher([tmp_path / "a.txt"], vocab, 2, 3)))
    moved = batch.to("cpu")
    assert torch.equal(moved.forward_targets, batch.forward_targets) and moved.n_tokens == batch.n_tokens == 3
    assert batch.forward_targets.tolist() == [[3, 2, 2], [0, 0, 0]]  # b and c are <UNK>; row 1 gets nothing
