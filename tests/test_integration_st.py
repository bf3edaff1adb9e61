"""sentence-transformers, through the real package: `elmo convert --to-sentence-transformers` writes a
folder `SentenceTransformer` loads without trust_remote_code, whose `encode` gives the vectors a real
`elmo serve` answers for the same raw texts, and whose save/load round-trips with its model card."""

from __future__ import annotations

import json
import sys
import shutil
import warnings

import numpy as np
import pytest

pytest.importorskip("sentence_transformers", reason="needs the sentence-transformers extra")

from huggingface_hub import ModelCard  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402

from elmokit.cli import main  # noqa: E402
from elmokit.sources.loading import load_model  # noqa: E402
from elmokit.model.weights import model_fingerprint  # noqa: E402
from elmokit.integrations.sentence_transformers import save_sentence_transformers  # noqa: E402
from tests.conftest import one_error_line  # noqa: E402
from tests.serving import Server, save_tiny_model  # noqa: E402

# Raw texts: Moses splits "don't", the comma, the final stop; the last has no token at all
TEXTS = ["I like to eat apple.", "I like apple products, don't you?", "They play football on Sundays."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("st"))


@pytest.fixture(scope="module")
def st_folder(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "elmo-st"
    assert main(["convert", "--model", str(tiny), "--to-sentence-transformers", str(out), "--license", "mit"]) == 0
    return out


def load_without_remote_code(folder) -> SentenceTransformer:
    """SentenceTransformer(folder) with every warning an error: no trust_remote_code asked for or warned about."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return SentenceTransformer(str(folder), device="cpu")


def test_encode_gives_the_served_vectors(tiny, st_folder):
    """The same raw texts, sent to a real `elmo serve` of the same model: the same vectors."""
    model = load_without_remote_code(st_folder)
    assert json.loads((st_folder / "modules.json").read_text())[0]["type"] == (
        "elmokit.integrations.sentence_transformers.ELMoSentenceEncoder")
    vectors = model.encode(TEXTS, batch_size=2)  # two batches, sorted by length inside encode
    assert vectors.shape == (3, 12) and vectors.dtype == np.float32 and model.get_embedding_dimension() == 12
    server = Server(tiny)
    try:
        status, answer, _ = server.call("POST", "/v1/embeddings", {"input": TEXTS})
    finally:
        assert server.stop() == 0
    assert status == 200
    served = np.array([item["embedding"] for item in answer["data"]], np.float32)
    np.testing.assert_allclose(vectors, served, atol=1e-6, rtol=1e-5)
    one = model.encode(TEXTS[1])  # a single text: one vector, the same as in a batch
    np.testing.assert_allclose(one, served[1], atol=1e-6, rtol=1e-5)
    assert not model.encode([""]).any()  # no token: zeros, as `elmo embed --sentence-vectors` stores
    tokens = model.encode(TEXTS[1], output_value="token_embeddings")  # each token's layer average
    assert tuple(tokens.shape) == (9, 12)  # I like apple products , do n't you ?
    np.testing.assert_allclose(tokens.mean(0).numpy(), served[1], atol=1e-6, rtol=1e-5)


def test_save_and_load_round_trip(st_folder, tmp_path):
    model = load_without_remote_code(st_folder)
    model.save(str(tmp_path / "again"))
    again = load_without_remote_code(tmp_path / "again")
    np.testing.assert_array_equal(again.encode(TEXTS), model.encode(TEXTS))
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == sorted(p.name for p in st_folder.iterdir())
    assert (tmp_path / "again" / "README.md").read_text() == (st_folder / "README.md").read_text()
    # the folder is also elmokit's native model folder
    assert model_fingerprint(load_model(str(tmp_path / "again"))) == model_fingerprint(load_model(str(st_folder)))


def test_the_card_carries_the_hubs_metadata(tiny, st_folder):
    card = ModelCard.load(st_folder / "README.md")  # huggingface_hub's own parser of the YAML block
    assert card.data.library_name == "sentence-transformers" and card.data.license == "mit"
    assert {"sentence-transformers", "elmo", "feature-extraction"} <= set(card.data.tags)
    assert card.data.pipeline_tag == "feature-extraction"  # not trained for sentence similarity: the card says so
    fingerprint = model_fingerprint(load_model(str(tiny)))
    assert card.data.to_dict()["elmo_fingerprint"] == fingerprint
    assert card.data.to_dict()["elmo_source"] == "a local folder named model"  # not the builder's path
    assert fingerprint in card.text and "SentenceTransformer(" in card.text
    provenance = json.loads((st_folder / "provenance.json").read_text())
    assert provenance["elmokit_fingerprint"] == fingerprint and provenance["license"] == "mit"


def test_convert_refuses_what_it_should(st_folder, tmp_path, capsys, monkeypatch):
    before = {p.name: p.stat().st_mtime_ns for p in st_folder.iterdir()}
    assert main(["convert", "--to-sentence-transformers", str(st_folder)]) == 2
    one_error_line(capsys, "output exists", str(st_folder))
    assert {p.name: p.stat().st_mtime_ns for p in st_folder.iterdir()} == before
    assert main(["convert", "--to-native", str(tmp_path / "n"), "--license", "mit"]) == 2
    one_error_line(capsys, "--license goes on the model card that --to-sentence-transformers writes")
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # not installed
    assert main(["convert", "--to-sentence-transformers", str(tmp_path / "x")]) == 2
    one_error_line(capsys, "elmo convert --to-sentence-transformers needs sentence_transformers and huggingface_hub "
                           "and sacremoses: pip install 'elmokit[sentence-transformers]'")
    assert not (tmp_path / "x").exists()


def test_overwrite_replaces_the_folder_whole(tiny, st_folder, tmp_path):
    out = tmp_path / "st"
    out.mkdir()
    (out / "stale.txt").write_text("from an older run")
    assert main(["convert", str(tiny), "--to-sentence-transformers", str(out), "--overwrite"]) == 0
    assert not (out / "stale.txt").exists() and (out / "modules.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["st"]  # no staging folder left beside it
    assert ModelCard.load(out / "README.md").data.license == "unknown"  # nothing recorded, none given


def test_the_folder_gets_the_permissions_a_new_folder_gets(st_folder):
    """Not mkdtemp's 0700 (private to its owner): what `mkdir` gives under the umask, as `model.save`."""
    import os

    mask = os.umask(0)
    os.umask(mask)
    assert st_folder.stat().st_mode & 0o777 == 0o777 & ~mask


def test_overwrite_never_deletes_the_model_being_converted(tiny, tmp_path, capsys):
    project = tmp_path / "proj"
    shutil.copytree(tiny, project / "m")
    (project / "notes.txt").write_text("mine")
    assert main(["convert", "--model", str(project / "m"), "--to-sentence-transformers", str(project),
                 "--overwrite"]) == 2
    one_error_line(capsys, f"output {project} holds the input {project / 'm'}")
    assert (project / "m" / "model.safetensors").is_file() and (project / "notes.txt").is_file()
    with pytest.raises(ValueError, match="holds the input"):
        save_sentence_transformers(str(project / "m"), project, overwrite=True)


def test_token_embeddings_are_each_texts_own_tokens_with_a_prompt(tiny, st_folder):
    """Texts of different lengths in one batch, with a prompt: each text's rows are the layer
    average of the tokens of prompt + text, as ElmoEmbedder gives them alone, and no padding row."""
    from elmokit import ElmoEmbedder, tokenize

    texts = ["Short one.", "A much longer sentence, with commas, and more words than the others!", "Mid length text"]
    prompt = "query: "
    rows = load_without_remote_code(st_folder).encode(texts, output_value="token_embeddings", prompt=prompt,
                                                      batch_size=3)
    embedder = ElmoEmbedder(str(tiny))
    for text, got in zip(texts, rows):
        layers = embedder.embed_sentence(tokenize(prompt + text))  # (L+1, n, 2P)
        np.testing.assert_allclose(got.numpy(), layers.mean(axis=0), atol=1e-6, rtol=1e-5)


def test_the_card_names_no_local_path_and_the_reported_perplexity(tiny, tmp_path):
    """A model folder whose provenance has the builder's absolute paths, a training-time
    perplexity and the first-5,000-sentence one the README reports: the card and provenance.json
    name files without the builder's folders, and the card shows the reported perplexity; its
    "Use it" section shows SentenceTransformer."""
    model = tmp_path / "built"
    shutil.copytree(tiny, model)
    record = {"train_files": ["/root/runs/gutenberg/train/*.txt.gz"], "vocab": "/root/runs/gutenberg/vocab.txt",
              "tokens": 1000, "steps": 10, "valid_files": ["/root/runs/gutenberg/valid-2k.txt"],
              "valid_ppl": 97.632, "valid_forward_ppl": 96.877, "valid_backward_ppl": 98.393,
              "valid_first_5000_sentences": {"forward_ppl": 99.29, "backward_ppl": 101.7, "ppl": 100.49, "n_tokens": 153070},
              "test_first_5000_sentences": {"forward_ppl": 82.3, "backward_ppl": 84.49, "ppl": 83.39, "n_tokens": 151685}}
    (model / "provenance.json").write_text(json.dumps(record))
    out = save_sentence_transformers(str(model), tmp_path / "st")
    card = (out / "README.md").read_text()
    for written in (card, (out / "provenance.json").read_text()):
        assert "/root" not in written and str(tmp_path) not in written
    assert "`*.txt.gz`" in card and "`vocab.txt`" in card
    perplexity = card[card.index("## Perplexity"):card.index("## Software")]
    assert "100.49" in perplexity and "83.39" in perplexity and "97.63" not in perplexity
    use_it = card[card.index("## Use it"):card.index("## The model")]
    assert "SentenceTransformer(" in use_it and "ElmoEmbedder(" in use_it
    assert "not trained for similarity of meaning" in card and "load a folder only from a source you trust" in card
