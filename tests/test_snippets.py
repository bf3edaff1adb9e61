"""The code users copy from AllenNLP's and TF-Hub's pages, run verbatim (only the imports changed,
`cuda_device=-1`), against a real HTTP server on 127.0.0.1 set as ELMOKIT_MIRROR that serves the
published paths and breaks off its first response for the weights halfway; then again with the
server stopped (from the cache). The numbers equal those of the same files loaded locally."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
import torch

from elmokit import Elmo, ElmoEmbedder, HubElmo, batch_to_ids, load_model
from elmokit.sources.published import PUBLISHED
from tests.http_mirror import MirrorServer, pin
from tests.test_loading import publish

ALLENNLP_SNIPPET = '''
from elmokit import Elmo, ElmoEmbedder, batch_to_ids  # was: allennlp.modules.elmo, allennlp.commands.elmo

options_file = "https://allennlp.s3.amazonaws.com/models/elmo/2x4096_512_2048cnn_2xhighway/elmo_2x4096_512_2048cnn_2xhighway_options.json"
weight_file = "https://allennlp.s3.amazonaws.com/models/elmo/2x4096_512_2048cnn_2xhighway/elmo_2x4096_512_2048cnn_2xhighway_weights.hdf5"
elmo = Elmo(options_file, weight_file, 2, dropout=0)
character_ids = batch_to_ids(sentences)
embeddings = elmo(character_ids)
elmo = ElmoEmbedder(options_file=options_file, weight_file=weight_file, cuda_device=-1)
elmo_embedding, elmo_mask = elmo.batch_to_embeddings(sentences)
'''

TFHUB_SNIPPET = '''
from elmokit import hub  # was: import tensorflow_hub as hub

elmo = hub.Module("https://tfhub.dev/google/elmo/2", trainable=True)
embeddings = elmo(["the cat is on the mat", "dogs are in the fog"], signature="default", as_dict=True)["default"]
tokens_input = [["the", "cat", "is", "on", "the", "mat"], ["dogs", "are", "in", "the", "fog", ""]]
tokens_length = [6, 5]
token_embeddings = elmo(inputs={"tokens": tokens_input, "sequence_len": tokens_length}, signature="tokens", as_dict=True)["elmo"]
'''

SENTENCES = [["First", "sentence", "."], ["Another", "."]]


def run(snippet: str) -> dict:
    namespace = {"sentences": SENTENCES}
    exec(compile(snippet, "<snippet>", "exec"), namespace)
    return namespace


def check_allennlp(namespace: dict, local: Path) -> None:
    options, weights = (local / Path(urlsplit(url).path).name for url in (PUBLISHED["original"].options_url,
                                                                         PUBLISHED["original"].weight_url))
    reference = Elmo(str(options), str(weights), 2, dropout=0)(batch_to_ids(SENTENCES))
    for got, expected in zip(namespace["embeddings"]["elmo_representations"], reference["elmo_representations"]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    layers, mask = ElmoEmbedder(str(options), str(weights)).batch_to_embeddings(SENTENCES)
    assert namespace["elmo_embedding"].shape == (2, 3, 3, layers.shape[-1])
    torch.testing.assert_close(namespace["elmo_embedding"], layers, rtol=0, atol=0)
    assert namespace["elmo_mask"].tolist() == [[True, True, True], [True, True, False]]
    assert (namespace["elmo_embedding"][1, :, 2] == 0).all()


def check_tfhub(namespace: dict, local: Path) -> None:
    options, weights = (local / Path(urlsplit(url).path).name for url in (PUBLISHED["original"].options_url,
                                                                         PUBLISHED["original"].weight_url))
    reference = HubElmo(str(options), str(weights))
    sentences = [text.split() for text in ["the cat is on the mat", "dogs are in the fog"]]
    expected = reference(sentences)
    torch.testing.assert_close(namespace["embeddings"], expected["default"], rtol=0, atol=0)
    torch.testing.assert_close(namespace["token_embeddings"], expected["elmo"], rtol=0, atol=0)
    assert namespace["embeddings"].shape == (2, reference.bilm.output_dim)
    assert (namespace["token_embeddings"][1, 5] == 0).all()
    trainable = [name for name, p in namespace["elmo"].named_parameters() if p.requires_grad]
    assert sorted(trainable) == ["elmo.mix.gamma", "elmo.mix.scalar_parameters"]  # google/elmo/2: the 4 scalars


@pytest.mark.parametrize("snippet, check", [(ALLENNLP_SNIPPET, check_allennlp), (TFHUB_SNIPPET, check_tfhub)],
                         ids=["allennlp", "tfhub"])
def test_the_snippets_run_verbatim_through_a_mirror_then_from_the_cache(snippet, check, tmp_path, monkeypatch):
    mirror = tmp_path / "mirror"
    publish(mirror, "original", seed=3)
    pin(monkeypatch, mirror, "original")  # the tiny stand-in is the published file in this test
    local = mirror_file_folder = Path(mirror / urlsplit(PUBLISHED["original"].options_url).path.lstrip("/")).parent
    monkeypatch.setenv("ELMOKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ELMOKIT_OFFLINE", raising=False)
    with MirrorServer(mirror, break_first=(".hdf5",)) as server:
        monkeypatch.setenv("ELMOKIT_MIRROR", server.url)
        check(run(snippet), local)
        weights_requests = [sent for path, _, sent in server.requests if path.endswith(".hdf5")]
    size = (mirror_file_folder / Path(urlsplit(PUBLISHED["original"].weight_url).path).name).stat().st_size
    assert weights_requests == [size // 2, size]  # the first response broke off; one whole download
    check(run(snippet), local)  # the server is stopped: everything from the cache
    assert np.isfinite(load_model("original").lstm.layers[0].input_weight.detach().numpy()).all()
