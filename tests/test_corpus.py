"""`elmo prepare`: sentence splitting, Moses tokens, shards, PTB passthrough, bad bytes."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import pytest

from elmokit.training.corpus import UNFINISHED, ShardWriter, looks_pretokenized, prepare_corpus, tokenize_paragraphs
from elmokit.textfiles import CorpusError, expand_paths

SHARED = Path(__file__).resolve().parents[1].parent / "shared"  # ../shared beside the repo
DATA = SHARED / "data"


def shard_lines(out_dir: Path) -> list[str]:
    lines = []
    for path in sorted(out_dir.glob("shard-*.txt*")):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as handle:
            lines += handle.read().splitlines()
    return lines


def test_tokenize_paragraphs_splits_sentences_and_moses_tokens():
    sentences = tokenize_paragraphs(["Hello, world. It's 3 p.m. and raining!", "Mr. Smith said \"no\"."])
    assert sentences[0] == "Hello , world ."
    assert sentences[1].startswith("It 's 3 p.m.")
    assert sentences[1].endswith("raining !")
    assert sentences[-1] == 'Mr. Smith said " no " .'  # escape=False: no &quot;


def test_prepare_raw_text_plain_and_gz_inputs(tmp_path):
    (tmp_path / "a.txt").write_text("Hello, world. It's 3 p.m.\n\n  \nThe end.\n", encoding="utf-8")
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as handle:
        handle.write("Second file here. Two sentences!\n")
    stats = prepare_corpus([tmp_path / "a.txt", str(tmp_path / "*.gz")], tmp_path / "out", shard_size=2,
                           workers=2, pretokenized=None, progress=False)
    lines = shard_lines(tmp_path / "out")
    assert lines == ["Hello , world .", "It 's 3 p.m.", "The end .", "Second file here .", "Two sentences !"]
    assert not stats.pretokenized
    assert stats.sentences == 5 and stats.tokens == sum(len(line.split()) for line in lines)
    assert [p.name for p in sorted((tmp_path / "out").glob("shard-*"))] == [
        "shard-00000.txt.gz", "shard-00001.txt.gz", "shard-00002.txt.gz"]
    assert json.loads((tmp_path / "out" / "prepare.json").read_text())["sentences"] == 5


def test_prepare_one_worker_matches_pool(tmp_path):
    text = "".join(f"Paragraph {i}: one, two. Three (four) five? Yes.\n" for i in range(600))
    (tmp_path / "raw.txt").write_text(text, encoding="utf-8")
    prepare_corpus([tmp_path / "raw.txt"], tmp_path / "one", workers=1, pretokenized=False, progress=False)
    prepare_corpus([tmp_path / "raw.txt"], tmp_path / "two", workers=2, pretokenized=False, progress=False)
    assert shard_lines(tmp_path / "one") == shard_lines(tmp_path / "two")
    assert len(shard_lines(tmp_path / "one")) == 1800


def test_pretokenized_passthrough_detected(tmp_path):
    (tmp_path / "ptb.txt").write_text(" the <unk> company said N shares \n\n mr. <unk>  is   chairman \n")
    stats = prepare_corpus([tmp_path / "ptb.txt"], tmp_path / "out", compress=False, progress=False)
    assert stats.pretokenized
    assert shard_lines(tmp_path / "out") == ["the <unk> company said N shares", "mr. <unk> is chairman"]
    assert (tmp_path / "out" / "shard-00000.txt").is_file()


def test_looks_pretokenized():
    assert looks_pretokenized(["the cat , he said , sat .", "mr. smith 's dog"])
    assert not looks_pretokenized(["The cat, he said, sat.", "Mr. Smith's dog (a terrier)."])


def test_undecodable_line_is_reported_or_skipped(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"Fine line.\nBad \xff byte.\nAnother fine line.\n")
    with pytest.raises(CorpusError, match=r"bad\.txt:2: invalid UTF-8 byte 0xff"):
        prepare_corpus([tmp_path / "bad.txt"], tmp_path / "out", workers=1, pretokenized=False, progress=False)
    assert not list((tmp_path / "out").glob("shard-*"))  # nothing half-written
    stats = prepare_corpus([tmp_path / "bad.txt"], tmp_path / "out", workers=1, pretokenized=False,
                           skip_bad_lines=True, progress=False)
    assert stats.bad_lines == 1 and stats.first_bad_line.endswith("bad.txt:2: invalid UTF-8 byte 0xff")
    assert shard_lines(tmp_path / "out") == ["Fine line .", "Another fine line ."]


def test_existing_shards_need_overwrite(tmp_path):
    (tmp_path / "a.txt").write_text("a b c\n")
    prepare_corpus([tmp_path / "a.txt"], tmp_path / "out", progress=False)
    with pytest.raises(CorpusError, match="overwrite=True"):  # Python's spelling; `elmo prepare` says --overwrite
        prepare_corpus([tmp_path / "a.txt"], tmp_path / "out", progress=False)
    prepare_corpus([tmp_path / "a.txt"], tmp_path / "out", overwrite=True, progress=False)


def test_missing_inputs_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        expand_paths([tmp_path / "nope.txt"])
    with pytest.raises(FileNotFoundError, match=r"\*\.gz"):
        expand_paths([str(tmp_path / "*.gz")])


def test_shard_writer_abort_leaves_only_complete_shards(tmp_path):
    writer = ShardWriter(tmp_path, shard_size=2, compress=False)
    writer.write(["a", "b", "c"])
    writer.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.txt"]


def test_prepare_cli(tmp_path, capsys):
    from elmokit.cli import main

    (tmp_path / "a.txt").write_text("One. Two.\n")
    assert main(["prepare", str(tmp_path / "a.txt"), "-o", str(tmp_path / "out"), "--no-progress",
                 "--workers", "1", "--raw"]) == 0
    assert "2 sentences" in capsys.readouterr().err  # what it did: a message on stderr
    assert shard_lines(tmp_path / "out") == ["One .", "Two ."]


def test_real_ptb_and_gutenberg_samples(tmp_path):
    ptb, gutenberg = DATA / "ptb" / "ptb.train.txt.gz", DATA / "gutenberg-en" / "train.00.txt.gz"
    if not (ptb.is_file() and gutenberg.is_file()):
        pytest.skip(f"needs {DATA} (the shared data folder beside the repo); absent in a fresh clone")
    for name, source in (("ptb", ptb), ("gut", gutenberg)):
        with gzip.open(source, "rt", encoding="utf-8") as handle:
            (tmp_path / f"{name}.txt").write_text("".join(itertools.islice(handle, 400)), encoding="utf-8")
    ptb_stats = prepare_corpus([tmp_path / "ptb.txt"], tmp_path / "ptb", progress=False)
    assert ptb_stats.pretokenized and ptb_stats.sentences == 400
    gut_stats = prepare_corpus([tmp_path / "gut.txt"], tmp_path / "gut", workers=2, progress=False)
    assert not gut_stats.pretokenized and gut_stats.sentences > 400


def test_shards_of_an_unfinished_prepare_are_refused_for_training(tmp_path, capsys, monkeypatch):
    """prepare.json is written first as unfinished and last as the record of the shards: shards of
    a prepare that stopped (or of a folder whose record does not list them) are refused by elmo
    train and elmo vocab, by name; files named like shards without a prepare.json are taken."""
    from elmokit.cli import main

    (tmp_path / "raw.txt").write_text("".join(f"w{i % 7} w{i % 5} w{i % 3} .\n" for i in range(40)), encoding="utf-8")
    out = tmp_path / "out"
    prepare_corpus([tmp_path / "raw.txt"], out, shard_size=10, pretokenized=True, progress=False)
    assert main(["vocab", str(out / "shard-*.txt.gz"), "-o", str(tmp_path / "vocab.txt"), "--quiet"]) == 0
    train = ["train", "--train", str(out / "shard-*.txt.gz"), "--vocab", str(tmp_path / "vocab.txt"),
             "--model", "none", "--output-dir"]

    record = json.loads((out / "prepare.json").read_text())
    assert record["finished"] is True and len(record["shards"]) == 4
    (out / "prepare.json").write_text(json.dumps({**record, "shards": record["shards"][:3]}))
    assert main([*train, str(tmp_path / "run1"), "--quiet"]) == 2
    assert "shard-00003.txt.gz is a shard of an `elmo prepare` that did not finish" in capsys.readouterr().err
    (out / "prepare.json").write_text(json.dumps({**record, "shards": [record["shards"]]}))  # not names
    assert main([*train, str(tmp_path / "run1"), "--quiet"]) == 2
    assert "did not finish" in capsys.readouterr().err
    assert not (tmp_path / "run1").exists()

    (out / ".shard-00004.txt.gz.x1y2z3.tmp").write_bytes(b"a killed run's shard in the making")
    (tmp_path / "bad.txt").write_bytes(b"".join(b"a b .\n" for _ in range(25)) + b"\xff\xfe\n")
    with pytest.raises(CorpusError):  # started over, stopped by a bad line: nothing half-made is left
        prepare_corpus([tmp_path / "bad.txt"], out, shard_size=10, pretokenized=True, progress=False, overwrite=True)
    assert list(out.iterdir()) == []
    with pytest.raises(CorpusError):  # and in a new folder, not even the folder
        prepare_corpus([tmp_path / "bad.txt"], tmp_path / "new", shard_size=10, pretokenized=True, progress=False)
    assert not (tmp_path / "new").exists()
    # killed (SIGKILL) after its first shard: the record it writes first says unfinished
    (out / "prepare.json").write_text(json.dumps(UNFINISHED))
    (out / "shard-00000.txt.gz").write_bytes(gzip.compress(b"a b .\n"))
    assert main(["vocab", str(out / "shard-*.txt.gz"), "-o", str(tmp_path / "v2.txt"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "says the run did not finish" in err and "--overwrite" in err and not (tmp_path / "v2.txt").exists()
    assert main([*train, str(tmp_path / "run2"), "--quiet"]) == 2
    assert "did not finish" in capsys.readouterr().err and not (tmp_path / "run2").exists()
    (out / "prepare.json").unlink()  # someone's own files named like shards
    assert main(["vocab", str(out / "shard-*.txt.gz"), "-o", str(tmp_path / "v3.txt"), "--quiet"]) == 0

    seen = []  # while its shards are written, the record says unfinished
    commit = ShardWriter._commit
    monkeypatch.setattr(ShardWriter, "_commit", lambda writer: (
        seen.append(json.loads((out / "prepare.json").read_text())["finished"]), commit(writer)))
    prepare_corpus([tmp_path / "raw.txt"], out, shard_size=10, pretokenized=True, progress=False, overwrite=True)
    assert seen == [False] * 4 and json.loads((out / "prepare.json").read_text())["finished"] is True


def test_a_bad_shard_size_touches_nothing(tmp_path):
    """Checked before the output folder is cleared or made (the fuzz test found a record left)."""
    (tmp_path / "raw.txt").write_text("a b .\n", encoding="utf-8")
    with pytest.raises(ValueError, match="shard_size must be at least 1"):
        prepare_corpus([tmp_path / "raw.txt"], tmp_path / "out", shard_size=-1, pretokenized=True, progress=False)
    assert not (tmp_path / "out").exists()
