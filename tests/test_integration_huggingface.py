"""The Hugging Face Hub's conventions for native model folders (`HuggingFaceBiLM`: huggingface_hub's
ModelHubMixin): save_pretrained / from_pretrained round trips, the card's metadata, and push_to_hub
up to the upload, checked against a local stand-in of the Hub's HTTP API (tests/hub_server.py):
what the real client sends is what save_pretrained writes, and what it downloads loads again."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

huggingface_hub = pytest.importorskip("huggingface_hub", reason="needs the sentence-transformers extra")

from huggingface_hub import ModelCard  # noqa: E402

from elmokit import BiLM, ElmoEmbedder, load_model  # noqa: E402
from elmokit.integrations.huggingface import HuggingFaceBiLM  # noqa: E402
from elmokit.model.builtin import builtin_model_dir  # noqa: E402
from elmokit.model.weights import WeightFileError, model_fingerprint  # noqa: E402
from tests.hub_server import HubServer  # noqa: E402

NATIVE_FILES = {"config.json", "model.safetensors", "provenance.json", "README.md"}


def same_weights(a: BiLM, b: BiLM) -> bool:
    return a.state_dict().keys() == b.state_dict().keys() and all(
        torch.equal(x, b.state_dict()[name]) for name, x in a.state_dict().items())


def test_save_pretrained_and_from_pretrained_round_trip(model_dir, tmp_path):
    bilm = HuggingFaceBiLM.from_pretrained(str(model_dir))
    assert isinstance(bilm, BiLM) and not bilm.training and same_weights(bilm, load_model(str(model_dir)))
    bilm.save_pretrained(tmp_path / "hub")
    assert {p.name for p in (tmp_path / "hub").iterdir()} == NATIVE_FILES
    again = HuggingFaceBiLM.from_pretrained(tmp_path / "hub")
    assert same_weights(again, bilm)
    native = load_model(str(tmp_path / "hub"))  # elmokit reads the folder as its own native one
    sentence = ["The", "cat", "sat", "."]
    np.testing.assert_array_equal(ElmoEmbedder(module=native).embed_sentence(sentence),
                                  ElmoEmbedder(options_file=str(model_dir)).embed_sentence(sentence))
    card = ModelCard.load(tmp_path / "hub" / "README.md")
    assert card.data.library_name == "elmokit" and card.data.license == "unknown"
    assert {"elmo", "elmokit", "feature-extraction", "model_hub_mixin"} <= set(card.data.tags)
    assert card.data.to_dict()["elmo_fingerprint"] == model_fingerprint(bilm)
    assert card.data.to_dict()["elmo_source"] == f"a local folder named {model_dir.name}"  # no path of this machine
    assert str(tmp_path) not in (tmp_path / "hub" / "README.md").read_text()
    with pytest.raises(TypeError, match="apply to a Hub repository"):
        HuggingFaceBiLM.from_pretrained(str(model_dir), revision="main")
    for missing in (str(tmp_path / "missing"), tmp_path / "missing", "./missing", "a/b/c"):
        with pytest.raises(FileNotFoundError, match="no model folder .*missing|no model folder 'a/b/c'"):
            HuggingFaceBiLM.from_pretrained(missing)


def test_the_builtin_model_by_default():
    bilm = HuggingFaceBiLM.from_pretrained()
    assert same_weights(bilm, load_model())
    recorded = json.loads((builtin_model_dir() / "provenance.json").read_text())
    assert bilm.provenance["tokens"] == recorded["tokens"] and bilm.provenance["license"] == "apache-2.0"
    assert bilm.provenance["elmokit_fingerprint"].startswith(recorded["fingerprint"])


def test_push_to_hub_sends_what_save_pretrained_writes(model_dir, tmp_path, monkeypatch):
    with HubServer() as hub:
        hub.point_huggingface_hub_here(monkeypatch)
        bilm = HuggingFaceBiLM.from_pretrained(str(model_dir), license="mit")
        commit = bilm.push_to_hub("someone/tiny-elmo", token="hf_not_a_real_token")
        assert commit.commit_url.startswith(hub.url + "/someone/tiny-elmo/commit/")
        posts = [path for method, path in hub.requests if method == "POST" and path != "/api/validate-yaml"]
        assert posts == ["/api/repos/create", "/api/models/someone/tiny-elmo/preupload/main",
                         "/api/models/someone/tiny-elmo/commit/main"]  # one commit
        bilm.save_pretrained(tmp_path / "local")
        sent = hub.repos["someone/tiny-elmo"]
        assert sent == {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}  # byte for byte
        assert set(sent) == NATIVE_FILES and set(hub.validated) == {sent["README.md"].decode()}
        assert ModelCard(hub.validated[0]).data.license == "mit"  # the block the Hub would validate, parsed here
        assert f"{bilm.n_parameters:,} parameters" in sent["README.md"].decode()  # the one count (elmo info's)
        with pytest.raises(FileNotFoundError, match="'runs/best': no model folder here, and the Hugging Face Hub"):
            HuggingFaceBiLM.from_pretrained("runs/best", cache_dir=tmp_path / "cache0")  # a mistyped folder: no such repo
        # and back: from_pretrained of the repository id downloads it through huggingface_hub
        downloaded = HuggingFaceBiLM.from_pretrained("someone/tiny-elmo", cache_dir=tmp_path / "cache")
        assert same_weights(downloaded, bilm)
        assert downloaded.provenance["hub_repository"] == "someone/tiny-elmo"
        assert downloaded.provenance["license"] == "mit"
        # weights changed on the Hub (their bytes, the file still valid) against the fingerprint recorded beside them
        from safetensors.torch import load, save

        tensors = load(sent["model.safetensors"])
        name = next(iter(tensors))
        tensors[name] = tensors[name] + 1.0
        hub.repos["someone/tiny-elmo"]["model.safetensors"] = save(tensors)
        with pytest.raises(WeightFileError, match="someone/tiny-elmo: the weights' fingerprint .* is not the .* its "
                                                  "provenance.json records"):
            HuggingFaceBiLM.from_pretrained("someone/tiny-elmo", cache_dir=tmp_path / "cache2")


def test_a_published_name_from_a_mirror_is_not_credited_to_the_published_files(monkeypatch, tmp_path):
    """With ELMOKIT_MIRROR, the card names the mirror's URLs, not the published model's URLs and
    description (nothing ties the mirror's files to the published ones)."""
    from elmokit.integrations.huggingface import model_provenance
    from elmokit.sources.published import published_model

    small = published_model("small")
    bilm = load_model()
    plain = model_provenance("small", bilm)
    assert plain["weight_url"] == small.weight_url and plain["description"] == small.description
    monkeypatch.setenv("ELMOKIT_MIRROR", "http://127.0.0.1:9/elmo")
    mirrored = model_provenance("small", bilm)
    assert mirrored["weight_url"].startswith("http://127.0.0.1:9/elmo/") and "description" not in mirrored
    assert "published" not in mirrored and "mirror" in mirrored["source"]


def test_a_sentence_transformers_folder_from_the_hub(model_dir, tmp_path, monkeypatch):
    """A converted folder uploaded with huggingface_hub loads by its repository id; sentence-transformers
    5.7 warns (FutureWarning) that from version 6 a module class from outside its package, loaded from
    the Hub, will need trust_remote_code=True; from a local folder it does not."""
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer

    from elmokit.integrations.sentence_transformers import save_sentence_transformers

    save_sentence_transformers(str(model_dir), tmp_path / "st")
    with HubServer() as hub:
        hub.point_huggingface_hub_here(monkeypatch)
        api = huggingface_hub.HfApi(endpoint=hub.url, token="hf_not_a_real_token")
        api.create_repo("someone/tiny-elmo-st")
        api.upload_folder(repo_id="someone/tiny-elmo-st", folder_path=tmp_path / "st")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = SentenceTransformer("someone/tiny-elmo-st", cache_folder=str(tmp_path / "cache"), device="cpu")
        assert any("trust_remote_code" in str(w.message) for w in caught if w.category is FutureWarning)
        local = SentenceTransformer(str(tmp_path / "st"), device="cpu")
        texts = ["Hello, world!", "It's 3.5 km."]
        np.testing.assert_array_equal(model.encode(texts), local.encode(texts))


def test_the_former_name_still_imports_with_a_warning():
    import elmokit.integrations.huggingface as huggingface

    with pytest.warns(DeprecationWarning, match="HubBiLM is now HuggingFaceBiLM"):
        assert huggingface.HubBiLM is huggingface.HuggingFaceBiLM
