"""Every task file format: detection, reading, malformed lines named by file and line, and the
entity tag schemes (IOB1, BIO, BIOES) normalized to BIO against hand-computed cases."""

from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elmokit.tasks.formats import detect_format, iter_records, read_examples, resolve_format
from elmokit.tasks.readers import DataFormatError
from elmokit.tasks.schemes import bioes_to_bio, detect_scheme, iob1_to_bio, split_tag, to_bio


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def read(path, kind: str, fmt: str = "auto", entity_tags: bool = False, column: str = "upos"):
    return read_examples(path, kind, resolve_format(path, kind, fmt, column), entity_tags)


# ---------------------------------------------------------------------------------------------
# Tag schemes, against hand-computed cases
# ---------------------------------------------------------------------------------------------
def test_iob1_to_bio_hand_computed():
    # CoNLL-2003: entities start with I-; B- only between two adjacent entities of one type
    assert iob1_to_bio(["I-ORG", "O", "I-PER", "I-PER", "B-PER", "I-LOC"]) == \
        ["B-ORG", "O", "B-PER", "I-PER", "B-PER", "B-LOC"]
    assert iob1_to_bio(["O", "I-MISC", "I-MISC", "O"]) == ["O", "B-MISC", "I-MISC", "O"]


def test_bioes_to_bio_hand_computed():
    assert bioes_to_bio(["S-PER", "O", "B-LOC", "I-LOC", "E-LOC", "S-LOC", "B-ORG", "E-ORG"]) == \
        ["B-PER", "O", "B-LOC", "I-LOC", "I-LOC", "B-LOC", "B-ORG", "I-ORG"]


def test_bio_is_kept():
    tags = ["B-PER", "I-PER", "O", "B-PER", "B-PER"]
    assert to_bio(tags, "bio") == tags and to_bio(tags, "iob1") == tags  # IOB1 reading of BIO changes nothing


@pytest.mark.parametrize("sentences, scheme", [
    ([["B-PER", "I-PER", "O"], ["B-LOC"]], "bio"),
    ([["I-PER", "I-PER", "O"], ["B-LOC"]], "iob1"),
    ([["B-PER", "I-PER", "O"], ["O", "I-LOC"]], "iob1"),  # an I- after O starts an entity
    ([["B-PER", "I-LOC"]], "iob1"),  # an I- after another type starts one too
    ([["B-PER", "E-PER", "O"], ["I-LOC"]], "bioes"),
    ([["S-PER"]], "bioes"),
    ([["O", "O"]], "bio"),
])
def test_detect_scheme(sentences, scheme):
    assert detect_scheme(sentences) == scheme


@pytest.mark.parametrize("tag", ["X-PER", "B-", "B_PER", "PER", "o", ""])
def test_split_tag_rejects_malformed_tags(tag):
    with pytest.raises(ValueError, match="entity tag must be"):
        split_tag(tag)


bio_sequences = st.lists(st.sampled_from(["O", "B-A", "I-A", "B-B", "I-B"]), min_size=1, max_size=12)


@settings(max_examples=100, deadline=None)
@given(bio_sequences)
def test_bio_spans_survive_the_iob1_and_bioes_readings(tags):
    """Writing a BIO sequence's spans in IOB1 or BIOES and reading them back gives the same spans."""
    from elmokit.tasks.scores import bio_spans

    spans = bio_spans(tags)
    iob1, bioes = ["O"] * len(tags), ["O"] * len(tags)
    for entity_type, start, end in spans:
        follows_same = start > 0 and any(s[0] == entity_type and s[2] == start for s in spans)
        for position in range(start, end):
            iob1[position] = f"{'B' if position == start and follows_same else 'I'}-{entity_type}"
        bioes[start:end] = ([f"S-{entity_type}"] if end - start == 1 else
                            [f"B-{entity_type}"] + [f"I-{entity_type}"] * (end - start - 2) + [f"E-{entity_type}"])
    assert bio_spans(to_bio(iob1, "iob1")) == spans
    assert bio_spans(to_bio(bioes, "bioes")) == spans


# ---------------------------------------------------------------------------------------------
# Column files
# ---------------------------------------------------------------------------------------------
CONLL2003 = """-DOCSTART- -X- -X- O

EU NNP I-NP I-ORG
rejects VBZ I-VP O
German JJ I-NP I-MISC
Peter NNP I-NP I-PER
Anna NNP I-NP B-PER

-DOCSTART- -X- O O
Bonn NNP I-NP I-LOC
"""

WNUT = "@paul\tO\nNew\tB-location\nYork\tI-location\n\t\nhi\tO\nSteve\tB-person\n\n"


def test_columns_space_separated_iob1(tmp_path):
    path = write(tmp_path, "eng.train", CONLL2003)
    assert detect_format(path, "tagger") == "columns"
    examples, info = read(path, "tagger", entity_tags=True)
    assert info == {"format": "columns", "n": 2, "scheme": "iob1"}
    assert examples[0].tokens == ["EU", "rejects", "German", "Peter", "Anna"]
    assert examples[0].tags == ["B-ORG", "O", "B-MISC", "B-PER", "B-PER"]
    assert examples[1].tags == ["B-LOC"]


def test_columns_tab_separated_with_whitespace_only_boundaries(tmp_path):
    path = write(tmp_path, "wnut.conll.gz", WNUT)
    examples, info = read(path, "tagger", entity_tags=True)
    assert info["scheme"] == "bio" and info["format"] == "columns"
    assert [e.tokens for e in examples] == [["@paul", "New", "York"], ["hi", "Steve"]]
    assert examples[0].tags == ["O", "B-location", "I-location"]


def test_columns_bioes_normalized(tmp_path):
    path = write(tmp_path, "a.txt", "Jo\tS-PER\nin\tO\nNew\tB-LOC\nYork\tE-LOC\n")
    examples, info = read(path, "tagger", entity_tags=True)
    assert info["scheme"] == "bioes" and examples[0].tags == ["B-PER", "O", "B-LOC", "I-LOC"]


def test_columns_pos_labels_are_kept_as_they_are(tmp_path):
    path = write(tmp_path, "pos.tsv", "The\tDT\ncat\tNN\n\nRuns\tVBZ\n")
    examples, info = read(path, "tagger")
    assert "scheme" not in info and [e.tags for e in examples] == [["DT", "NN"], ["VBZ"]]


def test_columns_tokens_only_have_no_labels(tmp_path):
    path = write(tmp_path, "tokens.txt", "The\ncat\n\nRuns\n")
    records = list(iter_records(path, resolve_format(path, "tagger"), "tagger"))
    assert [r.tokens for r in records] == [["The", "cat"], ["Runs"]] and records[0].labels is None
    assert records[1].line == 4 and records[0].token_lines == [1, 2]
    with pytest.raises(DataFormatError, match=r"tokens\.txt:1: this columns file has no labels"):
        read(path, "tagger")


def test_columns_malformed(tmp_path):
    path = write(tmp_path, "bad.conll", "EU NNP I-NP I-ORG\nrejects VBZ O\n\nBonn NNP I-NP I-LOC\n")
    with pytest.raises(DataFormatError, match=r"bad\.conll:2: expected 4 space-separated columns"):
        read(path, "tagger", entity_tags=True)
    path = write(tmp_path, "bad.conll", "EU NNP I-NP I-ORG\nrejects VBZ O\n")  # too short to detect
    with pytest.raises(DataFormatError, match=r"bad\.conll:2: expected 4 space-separated columns"):
        read(path, "tagger", "columns", entity_tags=True)
    path = write(tmp_path, "bad.conll", "EU\tB-ORG\n\nrejects\tO\nx\tY-PER\n")
    with pytest.raises(DataFormatError, match=r"bad\.conll:4: entity tag must be"):
        read(path, "tagger", entity_tags=True)


# ---------------------------------------------------------------------------------------------
# CoNLL-U
# ---------------------------------------------------------------------------------------------
CONLLU = """# sent_id = 1
# text = I don't know.
1\tI\tI\tPRON\tPRP\t_\t4\tnsubj\t_\t_
2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_
2\tdo\tdo\tAUX\tVBP\t_\t4\taux\t_\t_
3\tn't\tnot\tPART\tRB\t_\t4\tadvmod\t_\t_
4\tknow\tknow\tVERB\tVB\t_\t0\troot\t_\t_
4.1\tit\tit\tPRON\tPRP\t_\t_\t_\t4:obj\t_

1\tHi\thi\tINTJ\tUH\t_\t0\troot\t_\t_
"""


def test_conllu_upos_by_default_and_other_columns(tmp_path):
    path = write(tmp_path, "a.data", CONLLU)  # detected from its content, not its name
    assert detect_format(path, "tagger") == "conllu"
    examples, info = read(path, "tagger")
    assert info["format"] == "conllu"
    assert [e.tokens for e in examples] == [["I", "do", "n't", "know"], ["Hi"]]
    assert examples[0].tags == ["PRON", "AUX", "PART", "VERB"]
    assert read(path, "tagger", column="xpos")[0][0].tags == ["PRP", "VBP", "RB", "VB"]
    assert read(path, "tagger", column="deprel")[0][1].tags == ["root"]


def test_conllu_malformed(tmp_path):
    path = write(tmp_path, "bad.conllu", "# c\n1\tI\tI\tPRON\n")
    with pytest.raises(DataFormatError, match=r"bad\.conllu:2: expected 10 tab-separated"):
        read(path, "tagger")
    path = write(tmp_path, "bad.conllu", CONLLU.replace("4\tknow\tknow\tVERB", "4\tknow\tknow\t_"))
    with pytest.raises(DataFormatError, match=r"bad\.conllu:7: no UPOS"):
        read(path, "tagger")


# ---------------------------------------------------------------------------------------------
# Classification: TSV, CSV
# ---------------------------------------------------------------------------------------------
def test_tsv_label_tab_text(tmp_path):
    path = write(tmp_path, "train.tsv", "pos\tA fine film .\nneg\tDull\n\n")
    assert detect_format(path, "classifier") == "tsv"
    examples, info = read(path, "classifier")
    assert info == {"format": "tsv", "n": 2}
    assert [(e.tokens, e.label) for e in examples] == [(["A", "fine", "film", "."], "pos"), (["Dull"], "neg")]


def test_tsv_and_csv_with_a_header(tmp_path):
    path = write(tmp_path, "train.tsv", "id\tsentence\tlabel\n7\tgood film\t1\n8\tbad\t0\n")
    examples, _ = read(path, "classifier")
    assert [(e.tokens, e.label) for e in examples] == [(["good", "film"], "1"), (["bad"], "0")]
    path = write(tmp_path, "train.csv", 'text,label\n"Good, fun film",positive\ndull,negative\n')
    assert detect_format(path, "classifier") == "csv"
    examples, _ = read(path, "classifier")
    assert [(e.tokens, e.label) for e in examples] == [(["Good,", "fun", "film"], "positive"), (["dull"], "negative")]


def test_csv_without_header(tmp_path):
    path = write(tmp_path, "train.csv", '1,"a, b"\n0,c\n')
    examples, _ = read(path, "classifier")
    assert [(e.tokens, e.label) for e in examples] == [(["a,", "b"], "1"), (["c"], "0")]


@pytest.mark.parametrize("text, message", [
    ("pos\tgood\nneg\n", r"x\.tsv:2: expected 2 fields"),
    ("pos\tgood\t1\n", r"x\.tsv:1: expected 'label<TAB>text'"),
    ("\tgood\n", r"x\.tsv:1: empty label"),
    ("pos\tgood\nneg\t \n", r"x\.tsv:2: empty text"),
    ("text\tlabel\ngood\t\n", r"x\.tsv:2: empty label"),
])
def test_tsv_malformed(tmp_path, text, message):
    path = write(tmp_path, "x.tsv", text)
    with pytest.raises(DataFormatError, match=message):
        read(path, "classifier", "tsv")


def test_table_without_label_column_has_no_labels(tmp_path):
    path = write(tmp_path, "x.csv", "sentence,id\ngood,1\n")
    with pytest.raises(DataFormatError, match=r"x\.csv:2: this csv file has no labels"):
        read(path, "classifier")


# ---------------------------------------------------------------------------------------------
# JSON Lines and plain text
# ---------------------------------------------------------------------------------------------
def test_jsonl_tagger_and_classifier(tmp_path):
    path = write(tmp_path, "a.jsonl", json.dumps({"tokens": ["Jo", "ran"], "labels": ["S-PER", "O"], "id": 3})
                 + "\n\n" + json.dumps({"tokens": ["x"], "labels": ["O"]}) + "\n")
    assert detect_format(path, "tagger") == "jsonl"
    examples, info = read(path, "tagger", entity_tags=True)
    assert info["scheme"] == "bioes" and examples[0].tags == ["B-PER", "O"]
    path = write(tmp_path, "b.data", '{"text": "a good film", "label": 1}\n{"tokens": ["bad"], "label": "0"}\n')
    examples, info = read(path, "classifier")
    assert info["format"] == "jsonl"
    assert [(e.tokens, e.label) for e in examples] == [(["a", "good", "film"], "1"), (["bad"], "0")]


@pytest.mark.parametrize("kind, line, message", [
    ("tagger", '{"tokens": ["a", "b"], "labels": ["O"]}', r'"labels" must be a list of 2'),
    ("tagger", '{"tokens": "a b", "labels": ["O"]}', r'"tokens" must be a non-empty list'),
    ("tagger", '{"text": "a b"}', r'expected "tokens"'),
    ("tagger", '{"tokens": ["a"], "labels": ["O"]', r"invalid JSON"),
    ("tagger", '["a"]', r"expected a JSON object"),
    ("classifier", '{"text": "", "label": "x"}', r'expected "tokens" .* or "text"'),
    ("classifier", '{"text": "a", "label": [1]}', r'"label" must be'),
])
def test_jsonl_malformed(tmp_path, kind, line, message):
    path = write(tmp_path, "x.jsonl", '{"tokens": ["ok"], "labels": ["O"], "text": "ok", "label": "O"}\n' + line + "\n")
    with pytest.raises(DataFormatError, match=r"x\.jsonl:2: " + message):
        read(path, kind)


def test_text_is_unlabelled_sentences(tmp_path):
    path = write(tmp_path, "in.txt", "The cat sat .\n\nA dog\n")
    fmt = resolve_format(path, "tagger", "text")
    records = list(iter_records(path, fmt, "tagger"))
    assert [(r.tokens, r.line, r.labels) for r in records] == [(["The", "cat", "sat", "."], 1, None), (["A", "dog"], 3, None)]
    for text in ("The cat sat .\nA dog\n", "Peter lives in Paris .\n"):
        path = write(tmp_path, "in2.txt", text)
        assert detect_format(path, "tagger") == "text" and detect_format(path, "classifier") == "text"
    with pytest.raises(DataFormatError, match=r"in2\.txt:1: read as plain text"):
        read(path, "tagger")


def test_format_not_for_this_kind_and_empty_file(tmp_path):
    path = write(tmp_path, "a.tsv", "pos\tgood\n")
    with pytest.raises(ValueError, match="format 'tsv' is not one a tagger reads"):
        resolve_format(path, "tagger", "tsv")
    empty = write(tmp_path, "empty.jsonl", "\n")
    with pytest.raises(DataFormatError, match=r"empty\.jsonl:1: no examples"):
        read(empty, "tagger", "jsonl")
