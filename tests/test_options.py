"""The original options JSON: every export means the same model to bilm-tf, AllenNLP and elmokit.

`bilm_tf_builds` and `allennlp_builds` are written here from the rules of the original code
(bilm-tf `bilm/model.py` with TensorFlow's `LSTMCell`; AllenNLP `modules/elmo.py`, `elmo_lstm.py`
and `lstm_cell_with_projection.py`; docs/formats.md lists them), not from elmokit's reader: each
returns the model that program would build from an options dict and the rows of the weight file's
`char_embed`, or raises where that program fails. `elmokit_runs` describes a loaded elmokit model
from its modules. Every export path must give the same description from all three.
"""

from __future__ import annotations

import json

import h5py
import pytest
import torch

from elmokit import (BiLM, CharCNNConfig, ConfigError, ElmoConfig, LSTMConfig, batch_to_ids, load_original,
                     save_original, save_pretrained)
from elmokit.training.checkpoint import save_checkpoint, save_model_dir
from elmokit.cli import main
from elmokit.training.lm import LanguageModel
from tests.conftest import SENTENCES


# ---------------------------------------------------------------------------------------------
# The readers of the original format, from their rules
# ---------------------------------------------------------------------------------------------
def bilm_tf_builds(options: dict, char_embed_rows: int) -> dict:
    """What bilm-tf's BidirectionalLanguageModel builds (inference, character inputs)."""
    cnn, lstm = options["char_cnn"], options["lstm"]
    filters = [tuple(f) for f in cnn["filters"]]
    n_filters, projection_dim = sum(count for _, count in filters), lstm["projection_dim"]
    if cnn["activation"] not in ("tanh", "relu"):  # bilm-tf leaves `activation` unbound
        raise UnboundLocalError("local variable 'activation' referenced before assignment")
    if cnn["n_characters"] != char_embed_rows + 1:  # a zero row is prepended, then the shape checked
        raise ValueError("Invalid shape initializing char_embed")
    n_highway = cnn.get("n_highway")
    token_projection = n_filters != projection_dim
    assert not token_projection or n_filters > projection_dim
    n_layers = lstm.get("n_layers", 1)
    if n_layers > 8:  # the weight-name map covers Cell0..Cell7
        raise KeyError(f"RNN_0/RNN/MultiRNNCell/Cell{n_layers - 1}/rnn/lstm_cell/kernel")
    lstm_projection = projection_dim < lstm["dim"]  # LSTMCell(num_proj=P) only then
    cell_clip, proj_clip = lstm.get("cell_clip"), lstm.get("proj_clip")  # LSTMCell clips iff not None
    return {
        "chars_per_token": cnn["max_characters_per_token"],  # the Batcher and the max-pool window
        "char_table_rows": cnn["n_characters"],
        "embedding_dim": cnn["embedding"]["dim"],
        "filters": filters,
        "activation": cnn["activation"],
        "n_highway": n_highway if n_highway is not None and n_highway > 0 else 0,
        "token_projection": token_projection,
        "cell_dim": lstm["dim"],
        "projection_dim": projection_dim,
        "lstm_projection": lstm_projection,
        "n_layers": n_layers,
        "cell_clip": cell_clip,
        "proj_clip": proj_clip if lstm_projection else None,  # TF applies proj_clip only with num_proj
        "residual_layers": list(range(1, n_layers)) if lstm["use_skip_connections"] else [],
    }


def allennlp_builds(options: dict, char_embed_rows: int) -> dict:
    """What AllenNLP's _ElmoBiLm builds."""
    cnn, lstm = options["char_cnn"], options["lstm"]
    if not lstm.get("use_skip_connections"):
        raise ValueError("We only support pretrained biLMs with residual connections")
    if cnn["activation"] not in ("tanh", "relu"):
        raise ValueError("Unknown activation")
    if cnn["max_characters_per_token"] != 50:  # view(-1, max_chars) of the mapper's 50 ids a token
        raise RuntimeError("shape is invalid for input size")
    n_layers = lstm["n_layers"]
    return {
        "chars_per_token": 50,
        "char_table_rows": char_embed_rows + 1,  # n_characters is never read
        "embedding_dim": cnn["embedding"]["dim"],
        "filters": [tuple(f) for f in cnn["filters"]],
        "activation": cnn["activation"],
        "n_highway": cnn["n_highway"],
        "token_projection": True,
        "cell_dim": lstm["dim"],
        "projection_dim": lstm["projection_dim"],
        "lstm_projection": True,
        "n_layers": n_layers,
        "cell_clip": lstm["cell_clip"] or None,  # indexed (must be present), applied only if truthy
        "proj_clip": lstm["proj_clip"] or None,
        "residual_layers": list(range(1, n_layers)),  # ElmoLstm: every layer but the first
    }


def elmokit_runs(model: BiLM) -> dict:
    """What an elmokit model computes, read from its modules."""
    encoder, lstm = model.token_encoder, model.lstm
    n_layers = len(lstm.layers)
    return {
        "chars_per_token": batch_to_ids([["word"]]).shape[-1],
        "char_table_rows": encoder.char_cnn.char_embedding.num_embeddings,
        "embedding_dim": encoder.char_cnn.char_embedding.embedding_dim,
        "filters": [(conv.kernel_size[0], conv.out_channels) for conv in encoder.char_cnn.convolutions],
        "activation": encoder.char_cnn.activation.__name__,
        "n_highway": len(encoder.highway.layers),
        "token_projection": True,
        "cell_dim": lstm.cell_dim,
        "projection_dim": lstm.projection_dim,
        "lstm_projection": True,
        "n_layers": n_layers,
        "cell_clip": lstm.cell_clip or None,  # elmokit: 0 = no clipping
        "proj_clip": lstm.proj_clip or None,
        "residual_layers": list(range(1, n_layers)),
    }


def _char_embed_rows(weight_file) -> int:
    with h5py.File(weight_file, "r") as file:
        return file["char_embed"].shape[0]


# ---------------------------------------------------------------------------------------------
# Models and every export path
# ---------------------------------------------------------------------------------------------
CONFIGS = {
    "no-clip": ElmoConfig(CharCNNConfig(4, ((1, 4), (2, 8), (3, 8)), 1),
                          LSTMConfig(cell_dim=12, projection_dim=6, n_layers=2, cell_clip=0.0, proj_clip=0.0)),
    "clipped": ElmoConfig(CharCNNConfig(4, ((1, 4), (2, 8), (3, 8)), 1),
                          LSTMConfig(cell_dim=12, projection_dim=6, n_layers=2, cell_clip=3.0, proj_clip=2.5)),
    "cell-clip-only-tanh-no-highway": ElmoConfig(
        CharCNNConfig(4, ((1, 4), (2, 8)), n_highway=0, activation="tanh"),
        LSTMConfig(cell_dim=10, projection_dim=5, n_layers=3, cell_clip=0.5, proj_clip=0.0)),
}
VOCAB_SIZE = 7


def _model(name: str) -> BiLM:
    torch.manual_seed(0)
    model = BiLM(CONFIGS[name])
    with torch.no_grad():  # large weights, so that any clip of the cells or states bites
        for parameter in model.lstm.parameters():
            parameter.mul_(4.0)
    return model.eval()


def _language_model(bilm: BiLM) -> LanguageModel:
    model = LanguageModel(bilm.config, VOCAB_SIZE)
    model.bilm.load_state_dict(bilm.state_dict())
    return model.eval()


def _api(bilm, tmp_path):
    save_original(bilm, tmp_path / "options.json", tmp_path / "weights.hdf5")


def _convert_native(bilm, tmp_path):
    save_pretrained(bilm, tmp_path / "native")
    assert main(["convert", "--model", str(tmp_path / "native"),
                 "--to-original", str(tmp_path / "options.json"), str(tmp_path / "weights.hdf5")]) == 0


def _convert_original_with_zero_clips(bilm, tmp_path):
    """An original pair in the old spelling (0 = no clip), converted to the original format again."""
    source = tmp_path / "source"
    source.mkdir()
    save_original(bilm, source / "options.json", source / "weights.hdf5")
    options = json.loads((source / "options.json").read_text())
    for key in ("cell_clip", "proj_clip"):
        options["lstm"][key] = options["lstm"][key] or 0.0
    (source / "options.json").write_text(json.dumps(options))
    assert main(["convert", "--options-file", str(source / "options.json"), "--weight-file",
                 str(source / "weights.hdf5"), "--to-original", str(tmp_path / "options.json"),
                 str(tmp_path / "weights.hdf5")]) == 0


def _export_model_dir(bilm, tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(f"w{i}\n" for i in range(VOCAB_SIZE)))
    save_model_dir(_language_model(bilm), tmp_path / "lm", vocab)
    assert main(["export", str(tmp_path / "lm"), "--original",
                 str(tmp_path / "options.json"), str(tmp_path / "weights.hdf5")]) == 0


def _export_checkpoint(bilm, tmp_path):
    checkpoint = {"model": _language_model(bilm).state_dict(), "elmo_config": bilm.config.to_dict(),
                  "vocab_size": VOCAB_SIZE}
    save_checkpoint(tmp_path / "checkpoint.pt", checkpoint)
    assert main(["export", str(tmp_path / "checkpoint.pt"), "--original",
                 str(tmp_path / "options.json"), str(tmp_path / "weights.hdf5")]) == 0


EXPORTS = {"save_original": _api, "convert --model": _convert_native,
           "convert --options-file (0 clips)": _convert_original_with_zero_clips,
           "export MODEL_DIR": _export_model_dir, "export checkpoint.pt": _export_checkpoint}


# ---------------------------------------------------------------------------------------------
# Every export path: the clip keys, and one model for all three readers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("export", EXPORTS)
@pytest.mark.parametrize("name", CONFIGS)
def test_every_export_means_one_model_to_every_reader(name, export, tmp_path, capsys):
    source = _model(name)
    EXPORTS[export](source, tmp_path)
    capsys.readouterr()
    options_file, weight_file = tmp_path / "options.json", tmp_path / "weights.hdf5"
    options = json.loads(options_file.read_text())
    lstm = CONFIGS[name].lstm

    # no clipping is null (bilm-tf: not clipped; AllenNLP needs the keys), a clip is its value
    assert options["lstm"]["cell_clip"] == (lstm.cell_clip or None)
    assert options["lstm"]["proj_clip"] == (lstm.proj_clip or None)
    assert all(value != 0 for value in (options["lstm"]["cell_clip"], options["lstm"]["proj_clip"]))

    loaded = load_original(options_file, weight_file)
    rows = _char_embed_rows(weight_file)
    expected = elmokit_runs(source)
    assert elmokit_runs(loaded) == expected
    assert bilm_tf_builds(options, rows) == expected
    assert allennlp_builds(options, rows) == expected
    assert loaded.config == source.config
    with torch.no_grad():
        ids = batch_to_ids(SENTENCES)
        for before, after in zip(source(ids).layers, loaded(ids).layers):
            torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_the_builtin_model_exports_without_a_clip(tmp_path, capsys):
    """The case of issue 19: the built-in model has no clipping."""
    options_file, weight_file = tmp_path / "options.json", tmp_path / "weights.hdf5"
    assert main(["convert", "--to-original", str(options_file), str(weight_file)]) == 0
    capsys.readouterr()
    options = json.loads(options_file.read_text())
    assert options["lstm"]["cell_clip"] is None and options["lstm"]["proj_clip"] is None
    expected = elmokit_runs(load_original(options_file, weight_file))
    assert expected["cell_clip"] is None and expected["proj_clip"] is None
    rows = _char_embed_rows(weight_file)
    assert bilm_tf_builds(options, rows) == allennlp_builds(options, rows) == expected


def test_the_test_readers_catch_a_zero_clip():
    """The readers above tell apart what issue 19 was about: 0.0 is a clip to bilm-tf only."""
    options = CONFIGS["no-clip"].to_options()
    options["lstm"]["cell_clip"] = options["lstm"]["proj_clip"] = 0.0
    assert bilm_tf_builds(options, 261)["cell_clip"] == 0.0
    assert allennlp_builds(options, 261)["cell_clip"] is None
    del options["lstm"]["cell_clip"]
    with pytest.raises(KeyError, match="cell_clip"):
        allennlp_builds(options, 261)


# ---------------------------------------------------------------------------------------------
# Reading original files: the old spellings keep their meaning
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spelling", ["zero", "integer zero", "null", "absent"])
def test_no_clip_reads_the_same_in_every_spelling(spelling, tmp_path):
    source = _model("no-clip")
    save_original(source, tmp_path / "options.json", tmp_path / "weights.hdf5")
    options = json.loads((tmp_path / "options.json").read_text())
    for key in ("cell_clip", "proj_clip"):
        if spelling == "absent":
            del options["lstm"][key]
        else:
            options["lstm"][key] = {"zero": 0.0, "integer zero": 0, "null": None}[spelling]
    (tmp_path / "options.json").write_text(json.dumps(options))
    loaded = load_original(tmp_path / "options.json", tmp_path / "weights.hdf5")
    assert loaded.config.lstm.cell_clip == loaded.config.lstm.proj_clip == 0.0
    with torch.no_grad():
        ids = batch_to_ids(SENTENCES)
        assert torch.equal(loaded(ids).layers[-1], source(ids).layers[-1])


def test_training_options_and_no_highway_key_are_read_as_bilm_tf_means_them(tmp_path):
    source = _model("cell-clip-only-tanh-no-highway")
    save_original(source, tmp_path / "options.json", tmp_path / "weights.hdf5")
    options = json.loads((tmp_path / "options.json").read_text())
    options["char_cnn"]["n_characters"] = 261  # bilm-tf's training options
    del options["char_cnn"]["n_highway"]  # bilm-tf: no highway
    (tmp_path / "options.json").write_text(json.dumps(options))
    assert load_original(tmp_path / "options.json", tmp_path / "weights.hdf5").config == source.config


@pytest.mark.parametrize("section, key, value, message", [
    ("lstm", "cell_clip", -1, r"lstm\.cell_clip must be a number >= 0 .*got -1"),
    ("lstm", "proj_clip", "3", r"lstm\.proj_clip must be a number >= 0.*'3'"),
    ("lstm", "cell_clip", True, r"lstm\.cell_clip must be a number >= 0.*True"),
    ("lstm", "dim", 0, r"lstm\.dim must be a positive int, got 0"),
    ("lstm", "n_layers", None, r"lstm\.n_layers must be a positive int, got None"),
    ("lstm", "use_skip_connections", False, r"lstm\.use_skip_connections must be true"),
    ("char_cnn", "n_characters", 300, r"char_cnn\.n_characters must be 262.*got 300"),
    ("char_cnn", "max_characters_per_token", 40, r"char_cnn\.max_characters_per_token must be 50.*got 40"),
    ("char_cnn", "activation", "gelu", r"char_cnn\.activation must be one of.*'gelu'"),
    ("char_cnn", "filters", [[1, 4, 2]], r"char_cnn\.filters must be a list of \[width, count\] pairs"),
    ("char_cnn", "filters", 4, r"char_cnn\.filters must be a list of \[width, count\] pairs, got 4"),
    ("char_cnn", "embedding", 4, r"char_cnn\.embedding must be a JSON object, got 4"),
    ("char_cnn", "n_highway", -1, r"char_cnn\.n_highway must be an int >= 0, got -1"),
])
def test_bad_options_name_the_file_and_the_key(section, key, value, message, tmp_path):
    save_original(_model("clipped"), tmp_path / "options.json", tmp_path / "weights.hdf5")
    options = json.loads((tmp_path / "options.json").read_text())
    options[section][key] = value
    (tmp_path / "options.json").write_text(json.dumps(options))
    with pytest.raises(ConfigError, match=rf"options\.json: .*{message}"):
        load_original(tmp_path / "options.json", tmp_path / "weights.hdf5")


@pytest.mark.parametrize("missing, message", [
    (("lstm",), r"missing option 'lstm'"),
    (("lstm", "dim"), r"missing option 'lstm\.dim'"),
    (("char_cnn", "embedding", "dim"), r"missing option 'char_cnn\.embedding\.dim'"),
])
def test_missing_options_name_the_file_and_the_key(missing, message, tmp_path):
    save_original(_model("clipped"), tmp_path / "options.json", tmp_path / "weights.hdf5")
    options = json.loads((tmp_path / "options.json").read_text())
    table = options
    for part in missing[:-1]:
        table = table[part]
    del table[missing[-1]]
    (tmp_path / "options.json").write_text(json.dumps(options))
    with pytest.raises(ConfigError, match=rf"options\.json: {message}"):
        load_original(tmp_path / "options.json", tmp_path / "weights.hdf5")


# ---------------------------------------------------------------------------------------------
# Shapes the original format cannot hold with one meaning are refused before anything is written
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config, message", [
    (ElmoConfig(CharCNNConfig(4, ((1, 3), (2, 3)), 1), LSTMConfig(12, 6)), r"F = 6 .* lstm\.projection_dim = 6"),
    (ElmoConfig(CharCNNConfig(4, ((1, 2), (2, 2)), 1), LSTMConfig(12, 6)), r"F = 4 .* lstm\.projection_dim = 6"),
    (ElmoConfig(CharCNNConfig(4, ((1, 8), (2, 8)), 1), LSTMConfig(6, 6)), r"projection_dim = 6 .*lstm\.dim"),
    (ElmoConfig(CharCNNConfig(4, ((1, 8), (2, 8)), 1), LSTMConfig(4, 2, n_layers=9)), r"n_layers = 9"),
])
def test_shapes_bilm_tf_would_build_differently_are_not_exported(config, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        save_original(BiLM(config), tmp_path / "options.json", tmp_path / "weights.hdf5")
    assert list(tmp_path.iterdir()) == []
    save_pretrained(BiLM(config), tmp_path / "native")  # the native format holds any shape
