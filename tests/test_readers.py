"""Readers of every task format, including malformed input named by file and line."""

from __future__ import annotations

import gzip

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elmokit.tasks.readers import (
    DataFormatError,
    iob1_to_bio,
    parse_sst_tree,
    read_conll2003,
    read_conllu,
    read_semcor,
    read_sst2_csv,
    read_sst_trees,
)

CONLLU = """# newdoc id = d1
# sent_id = 1
# text = I don't know.
1\tI\tI\tPRON\tPRP\t_\t4\tnsubj\t_\t_
2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_
2\tdo\tdo\tAUX\tVBP\t_\t4\taux\t_\t_
3\tn't\tnot\tPART\tRB\t_\t4\tadvmod\t_\t_
4\tknow\tknow\tVERB\tVB\t_\t0\troot\t_\t_
4.1\tit\tit\tPRON\tPRP\t_\t_\t_\t4:obj\t_
5\t.\t.\tPUNCT\t.\t_\t4\tpunct\t_\t_

1\tHi\thi\tINTJ\tUH\t_\t0\troot\t_\t_
"""


def test_conllu_plain_and_gzip(tmp_path):
    plain = tmp_path / "a.conllu"
    plain.write_text(CONLLU, encoding="utf-8")
    packed = tmp_path / "a.conllu.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as handle:
        handle.write(CONLLU)
    for path in (plain, packed):
        sentences = read_conllu(path)
        assert [s.tokens for s in sentences] == [["I", "do", "n't", "know", "."], ["Hi"]]
        assert sentences[0].tags == ["PRON", "AUX", "PART", "VERB", "PUNCT"]


def test_conllu_malformed_names_file_and_line(tmp_path):
    path = tmp_path / "bad.conllu"
    path.write_text("# c\n1\tI\tI\tPRON\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"bad\.conllu:2: expected 10"):
        read_conllu(path)
    path.write_text("x\tI\tI\tPRON\t_\t_\t0\troot\t_\t_\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"bad\.conllu:1: token id"):
        read_conllu(path)


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="nowhere"):
        read_conllu("/nowhere/x.conllu")


CONLL2003 = """-DOCSTART- -X- -X- O

EU NNP I-NP I-ORG
rejects VBZ I-VP O
German JJ I-NP I-MISC
call NN I-NP O
Peter NNP I-NP I-PER
Smith NNP I-NP I-PER
Anna NNP I-NP B-PER
. . O O

-DOCSTART- -X- O O
Bonn NNP I-NP I-LOC
"""


def test_conll2003_iob1_to_bio(tmp_path):
    path = tmp_path / "eng.train"
    path.write_text(CONLL2003, encoding="utf-8")
    sentences = read_conll2003(path)
    assert len(sentences) == 2
    assert sentences[0].tokens[:2] == ["EU", "rejects"]
    assert sentences[0].tags == ["B-ORG", "O", "B-MISC", "O", "B-PER", "I-PER", "B-PER", "O"]
    assert sentences[1].tags == ["B-LOC"]
    assert read_conll2003(path, scheme="bio")[0].tags[0] == "I-ORG"


def test_iob1_to_bio_type_change():
    assert iob1_to_bio(["I-PER", "I-LOC", "O", "I-LOC", "B-LOC"]) == ["B-PER", "B-LOC", "O", "B-LOC", "B-LOC"]


def test_conll2003_malformed(tmp_path):
    path = tmp_path / "eng.bad"
    path.write_text("EU NNP I-NP I-ORG\nrejects VBZ O\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"eng\.bad:2: expected 4"):
        read_conll2003(path)
    path.write_text("EU NNP I-NP X-ORG\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"eng\.bad:1: entity tag"):
        read_conll2003(path)


TREES = """(3 (2 It) (4 (4 (2 's) (4 good)) (2 .)))
(2 (2 Just) (2 fine))
(0 (1 Bad) (0 -LRB-awful-RRB-))
(4 (4 Great))
"""


def test_sst_trees_fine_and_binary(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text(TREES, encoding="utf-8")
    fine = read_sst_trees(path)
    assert [s.label for s in fine] == [3, 2, 0, 4]
    assert fine[0].tokens == ["It", "'s", "good", "."]
    assert fine[2].tokens == ["Bad", "-LRB-awful-RRB-"]
    binary = read_sst_trees(path, binary=True)
    assert [s.label for s in binary] == [1, 0, 1]


@pytest.mark.parametrize("line, message", [
    ("(3 (2 It) (4 good)", "not a complete tree"),
    ("(3 (2 It)) (4 good))", "unbalanced|second tree|outside"),
    ("(7 (2 It))", "node label must be 0-4"),
    ("(3 (2 It)) extra", "outside the tree"),
])
def test_sst_malformed(tmp_path, line, message):
    path = tmp_path / "dev.txt"
    path.write_text("(2 (2 ok))\n" + line + "\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=rf"dev\.txt:2: malformed sentiment tree: .*({message})"):
        read_sst_trees(path)


def test_sst2_csv(tmp_path):
    path = tmp_path / "sst2.csv"
    path.write_text('label,sentence\n1,"Good, fun film"\n0,dull\n', encoding="utf-8")
    sentences = read_sst2_csv(path)
    assert [(s.tokens, s.label) for s in sentences] == [(["Good,", "fun", "film"], 1), (["dull"], 0)]
    path.write_text("label,sentence\n1,good\n3,bad\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"sst2\.csv:3"):
        read_sst2_csv(path)


SEMCOR = """# columns: index\tform\tlemma\tptb_pos\tsense_keys\twn30_synsets
# doc = brown1/br-a01
# sent_id = brown1/br-a01.s000
1\tThe\tthe\tDT\t_\t_
2\tjury\tjury\tNN\tjury%1:14:00::\teng30-08220714-n
3\ttook_place\ttake_place\tVB\ttake_place%2:30:00::;take_place%2:30:01::\t_

# doc = brown1/br-a02
# sent_id = brown1/br-a02.s000
1\tsaid\tsay\tVB\tsay%2:32:00::\teng30-01009240-v

"""


def test_semcor(tmp_path):
    path = tmp_path / "semcor.tsv.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write(SEMCOR)
    sentences = read_semcor(path)
    assert [s.document for s in sentences] == ["brown1/br-a01", "brown1/br-a02"]
    assert sentences[0].senses == [(), ("jury%1:14:00::",), ("take_place%2:30:00::", "take_place%2:30:01::")]
    assert len(read_semcor(path, max_documents=1)) == 1
    bad = tmp_path / "bad.tsv"
    bad.write_text(SEMCOR.replace("1\tsaid\tsay\tVB", "1\tsaid\tVB"), encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"bad\.tsv:10: expected 6"):
        read_semcor(bad)


words = st.text(alphabet=st.characters(blacklist_characters="() \t\n\r", blacklist_categories=("Cs", "Zs", "Zl", "Zp", "Cc")),
                min_size=1, max_size=8)


@st.composite
def trees(draw, depth=0):
    label = draw(st.integers(0, 4))
    if depth >= 3 or draw(st.booleans()):
        leaf = draw(words)
        return f"({label} {leaf})", [leaf]
    left, left_leaves = draw(trees(depth=depth + 1))
    right, right_leaves = draw(trees(depth=depth + 1))
    return f"({label} {left} {right})", left_leaves + right_leaves


@settings(max_examples=50, deadline=None)
@given(trees())
def test_sst_tree_round_trip(tree):
    text, leaves = tree
    assert parse_sst_tree(text) == (int(text[1]), leaves)


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet="() 0123abc", max_size=30))
def test_sst_parser_never_crashes_unexpectedly(text):
    try:
        label, leaves = parse_sst_tree(text)
    except ValueError:
        return
    assert 0 <= label <= 4 and leaves
