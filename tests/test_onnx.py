"""The ONNX export (elmokit.inference.onnx_export, `elmo convert --to-onnx`; issue 35): onnxruntime's
`layers` equal `ElmoEmbedder.batch_to_embeddings`'s within 1e-5 for the built-in model and the
original-format fixture model at batch 1, 7 and 32 (mixed lengths, padding rows), the mask exactly;
and the check can fail: the fixture model, whose clips bind, with its cell or projection clip changed
in the written graph, or the tiny model with its gate order changed in what torch traces, no longer
matches (the export refuses to write it); a 3-layer model whose two clips differ and bind exports
(a swap of the clips would fail its check), the check refuses 1.5x its tolerance, ids outside
0..261 and a batch of 0 are refused. Five exports in all (about 10 s each on 2 cores)."""

from __future__ import annotations

import copy
import importlib.util
import random
import sys

import numpy as np
import pytest
import torch

from elmokit import BiLM, ElmoEmbedder
from elmokit.cli import main
from elmokit.model.int8 import int8_native, is_int8
from elmokit.model import cell as lstm_cell
from elmokit.model.builtin import builtin_model_dir
from elmokit.sources.loading import load_model
from tests.conftest import SENTENCES, clipped_three_layer_model, one_error_line

MISSING = [name for name in ("onnx", "onnxruntime", "onnxscript") if importlib.util.find_spec(name) is None]
needs_onnx = pytest.mark.skipif(bool(MISSING), reason=f"needs the [onnx] extra ({', '.join(MISSING)} missing): "
                                                        "pip install -e '.[onnx]'")
TOLERANCE = 1e-5  # issue 35
WORDS = ("the a of play music night sailor flute children football park Saturday theatre naïve café 😀 東京 "
         "Zürich ! , . ? antidisestablishmentarianism-and-then-some-more-characters-than-fifty-bytes").split()


def mixed_batch(size: int, seed: int) -> list[list[str]]:
    """`size` sentences of 0 to 24 tokens, one of them empty when size > 1 (a row of padding)."""
    rng = random.Random(seed)
    batch = [[rng.choice(WORDS) for _ in range(rng.randint(1, 24))] for _ in range(size)]
    if size > 1:
        batch[size // 2] = []
    return batch


def onnx_outputs(path, batch):
    from elmokit.inference.onnx_export import onnx_session

    from elmokit import batch_to_ids

    return onnx_session(path, threads=1).run(None, {"char_ids": batch_to_ids(batch).numpy()})


def assert_parity(bilm: BiLM, path, sizes=(1, 7, 32)) -> list[float]:
    embedder = ElmoEmbedder(module=bilm)
    differences = []
    for size in sizes:
        batch = mixed_batch(size, seed=size)
        layers, mask = onnx_outputs(path, batch)
        expected, expected_mask = embedder.batch_to_embeddings(batch)
        assert layers.shape == tuple(expected.shape) and layers.dtype == np.float32
        assert mask.dtype == np.bool_ and np.array_equal(mask, expected_mask.numpy())
        assert not layers.transpose(0, 2, 1, 3)[~mask].any()  # zeros at padding
        difference = float(np.abs(layers - expected.numpy()).max())
        assert difference <= TOLERANCE, (size, difference)
        differences.append(difference)
    return differences


@pytest.fixture(scope="module")
def builtin_export(tmp_path_factory):
    from elmokit.inference.onnx_export import export_onnx

    path = tmp_path_factory.mktemp("onnx") / "builtin.onnx"
    export_onnx(load_model(builtin_model_dir()), path)
    return path


@needs_onnx
def test_builtin_model_matches_elmokit(builtin_export):
    import onnx

    assert_parity(load_model(builtin_model_dir()), builtin_export)
    graph = onnx.load(str(builtin_export)).graph
    assert [value.name for value in graph.input] == ["char_ids"]
    assert [value.name for value in graph.output] == ["layers", "mask"]
    dims = [[dim.dim_param or dim.dim_value for dim in value.type.tensor_type.shape.dim] for value in graph.output]
    assert isinstance(dims[0][0], str) and isinstance(dims[0][2], str) and dims[0][1] == 3 and dims[0][3] == 256
    assert sum(node.op_type == "Scan" for node in graph.node) == 2  # one a layer, both directions in each


@needs_onnx
def test_batch_invariance_and_edge_shapes(builtin_export):
    """A sentence gives the same vectors alone and in a batch of longer ones (no padding leaks
    into the backward direction); a batch of empty sentences gives (B, 3, 0, 256)."""
    sentence = ["They", "play", "football", "on", "Sundays", "."]
    alone, _ = onnx_outputs(builtin_export, [sentence])
    batched, _ = onnx_outputs(builtin_export, [["a"] * 30, sentence, []])
    np.testing.assert_allclose(batched[1, :, :len(sentence)], alone[0], atol=2e-6, rtol=0)
    empty, mask = onnx_outputs(builtin_export, [[], []])
    assert empty.shape == (2, 3, 0, 256) and mask.shape == (2, 0)


@pytest.fixture(scope="module")
def fixture_export(tmp_path_factory, fixture_dir):
    """The fixture model of the original format (options JSON + HDF5, clips of 3 that bind),
    through `elmo convert --options-file --weight-file --to-onnx --mix-weights` (a third output)."""
    fixture = fixture_dir
    options, weights = str(fixture / "options.json"), str(fixture / "lm_weights.hdf5")
    path = tmp_path_factory.mktemp("fixture") / "fixture.onnx"
    assert main(["convert", "--options-file", options, "--weight-file", weights, "--to-onnx", str(path),
                 "--mix-weights", "0.5,-1,2", "--mix-gamma", "1.5"]) == 0
    return path, load_model(options, weights)


@needs_onnx
def test_original_format_fixture_matches_elmokit(fixture_export, fixture_dir, capsys):
    path, bilm = fixture_export
    embedder = ElmoEmbedder(module=bilm)
    for size in (1, 7, 32):
        batch = mixed_batch(size, seed=size)
        layers, mask, mixed = onnx_outputs(path, batch)
        expected, expected_mask = embedder.batch_to_embeddings(batch)
        assert np.array_equal(mask, expected_mask.numpy()) and not layers.transpose(0, 2, 1, 3)[~mask].any()
        assert float(np.abs(layers - expected.numpy()).max()) <= TOLERANCE, size
        weights = torch.softmax(torch.tensor([0.5, -1.0, 2.0]), 0).numpy()
        np.testing.assert_allclose(mixed, 1.5 * np.einsum("k,bktd->btd", weights, layers), atol=1e-5, rtol=0)
    assert main(["convert", "--options-file", str(fixture_dir / "options.json"), "--weight-file",
                 str(fixture_dir / "lm_weights.hdf5"), "--to-onnx", str(path)]) == 2
    one_error_line(capsys, "output exists", "--overwrite")


@needs_onnx
def test_the_clips_bind_and_a_changed_clip_in_the_graph_breaks_parity(fixture_export, tmp_path):
    """The fixture's clips bind (elmokit without either gives other numbers), and the written graph
    with its cell clip, or its projection clip, at 2.5 instead of 3 fails the check."""
    import onnx
    from onnx import numpy_helper

    from elmokit.inference.onnx_export import ExportableBiLM, OnnxMismatchError, check_onnx

    path, bilm = fixture_export
    batch = [*SENTENCES, *mixed_batch(16, seed=16)]
    expected, _ = ElmoEmbedder(module=copy.deepcopy(bilm)).batch_to_embeddings(batch)
    for clip in ("cell_clip", "proj_clip"):
        unclipped = copy.deepcopy(bilm)
        setattr(unclipped.lstm, clip, 0.0)
        assert (ElmoEmbedder(module=unclipped).batch_to_embeddings(batch)[0] - expected).abs().max() > 1e-4, clip
    module = ExportableBiLM(copy.deepcopy(bilm), [0.5, -1.0, 2.0], 1.5)
    assert check_onnx(path, module, batch) <= TOLERANCE  # layers, mask and the mix

    for producer in ("Add", "MatMul"):  # the cell's clip (of f c + i j), the projection's (of m W)
        model = onnx.load(str(path))
        model.graph.initializer.extend([numpy_helper.from_array(np.array(-2.5, np.float32), "mutated_min"),
                                        numpy_helper.from_array(np.array(2.5, np.float32), "mutated_max")])
        changed = 0
        for node in model.graph.node:
            body = next((a.g for a in node.attribute if a.name == "body"), None) if node.op_type == "Scan" else None
            if body is None:
                continue
            producers = {output: inner.op_type for inner in body.node for output in inner.output}
            for inner in body.node:
                if inner.op_type == "Clip" and producers.get(inner.input[0]) == producer:
                    inner.input[1:3] = ["mutated_min", "mutated_max"]
                    changed += 1
        assert changed == 2, producer  # one a layer
        mutated = tmp_path / f"mutated-{producer}.onnx"
        onnx.save(model, str(mutated))
        with pytest.raises(OnnxMismatchError, match="differs from elmokit's"):
            check_onnx(mutated, module, batch)


@needs_onnx
def test_a_changed_gate_order_is_refused_and_nothing_is_written(tiny_model, tmp_path, monkeypatch):
    """The tiny model exports; the same with (f, i, o, j) taken for (i, f, o, j) in what torch
    traces fails the check on writing, and the file written before stays as it was."""
    from elmokit.inference import onnx_export

    path = tmp_path / "model.onnx"
    onnx_export.export_onnx(tiny_model, path)
    written = path.read_bytes()
    original_split, original_layer = lstm_cell.split_gates, onnx_export.scan_layer

    def swapped(gates):
        input_gate, forget_gate, output_gate, candidate = original_split(gates)
        return forget_gate, input_gate, output_gate, candidate

    def traced_with_swapped_gates(*args):
        with monkeypatch.context() as patch:  # only while the step is traced, not for elmokit's reference
            patch.setattr(lstm_cell, "split_gates", swapped)
            return original_layer(*args)

    monkeypatch.setattr(onnx_export, "scan_layer", traced_with_swapped_gates)
    with pytest.raises(onnx_export.OnnxMismatchError, match="differs from elmokit's") as caught:
        onnx_export.export_onnx(tiny_model, path)
    assert str(caught.value).startswith(f"{path} (not written): ")
    assert path.read_bytes() == written and sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


@needs_onnx
@pytest.mark.skipif(not int8_native(), reason="dtype int8 needs a CPU with VNNI or AMX-INT8")
def test_a_model_placed_in_int8_exports_its_float32_weights(tiny_model, tmp_path):
    """A biLM that `dtype="int8"` marked exports (its graph in float32, as its weights are) and
    matches the float32 model within the tolerance; the model itself stays marked."""
    from elmokit.inference.onnx_export import export_onnx

    float32 = copy.deepcopy(tiny_model)
    marked = ElmoEmbedder(module=tiny_model, dtype="int8").bilm
    path = tmp_path / "int8.onnx"
    export_onnx(marked, path)
    assert_parity(float32, path, sizes=(1, 7))
    assert is_int8(marked.lstm.layers[0])


@pytest.fixture(scope="module")
def clipped_export(tmp_path_factory):
    """The 3-layer model whose cell clip (0.5) and projection clip (1.0) differ and bind
    (tests/conftest.py), exported: its check on writing compares with elmokit."""
    from elmokit.inference.onnx_export import export_onnx

    path = tmp_path_factory.mktemp("clipped") / "clipped.onnx"
    bilm = clipped_three_layer_model()
    report = export_onnx(bilm, path)
    return path, bilm, report


@needs_onnx
def test_differing_clips_and_three_layers_match_elmokit(clipped_export):
    """The two clips bind and a swap of them changes the numbers by far more than the tolerance,
    so the export (whose check on writing passed) holds each clip where elmokit does."""
    path, bilm, report = clipped_export
    batch = [*SENTENCES, *mixed_batch(8, seed=8)]
    expected, _ = ElmoEmbedder(module=copy.deepcopy(bilm)).batch_to_embeddings(batch)
    lstm = bilm.lstm
    for cell_clip, proj_clip in ((0.0, lstm.proj_clip), (lstm.cell_clip, 0.0), (lstm.proj_clip, lstm.cell_clip)):
        other = copy.deepcopy(bilm)
        other.lstm.cell_clip, other.lstm.proj_clip = cell_clip, proj_clip
        assert (ElmoEmbedder(module=other).batch_to_embeddings(batch)[0] - expected).abs().max() > 0.1
    assert report["max_abs_diff"] <= TOLERANCE and bilm.config.lstm.n_layers == 3
    layers, mask = onnx_outputs(path, batch)
    assert np.abs(layers - expected.numpy()).max() <= TOLERANCE


class _Shifted:
    """An onnxruntime session whose `layers` are off by `delta` everywhere."""

    def __init__(self, session, delta: float):
        self.session, self.delta = session, delta

    def run(self, names, feeds):
        layers, *rest = self.session.run(names, feeds)
        return [layers + np.float32(self.delta), *rest]


@needs_onnx
def test_the_check_rejects_a_difference_just_above_its_tolerance(clipped_export):
    """1.5x the tolerance is refused, 0.5x accepted (what onnxruntime gives unshifted is about 1e-6
    away): the check holds 1e-5, not a looser bound."""
    from elmokit.inference.onnx_export import TOLERANCE as CHECKED, OnnxMismatchError, check_onnx, onnx_session

    path, bilm, _ = clipped_export
    assert CHECKED == TOLERANCE == 1e-5
    session = onnx_session(path, threads=1)
    assert check_onnx(path, bilm, session=session) < 0.2 * TOLERANCE
    assert check_onnx(path, bilm, session=_Shifted(session, 0.5 * TOLERANCE)) <= TOLERANCE
    with pytest.raises(OnnxMismatchError, match=r"'layers' differs from elmokit's by 1\.\d+e-05 \(> 1e-05\)"):
        check_onnx(path, bilm, session=_Shifted(session, 1.5 * TOLERANCE))


@needs_onnx
def test_ids_outside_the_table_are_errors_not_rows(clipped_export):
    """-1 was read as row 261 (ONNX's Gather counts a negative index from the end): the graph now
    refuses it as it refuses 262; elmokit's helper says what the input must be."""
    from elmokit import batch_to_ids
    from elmokit.inference.onnx_export import onnx_session, run_onnx

    path, _, _ = clipped_export
    session = onnx_session(path, threads=1)
    valid = batch_to_ids([["a", "bc"], ["d"]]).numpy()
    assert run_onnx(session, valid)[0].shape == (2, 4, 2, 12)
    for bad in (-1, -262, 262):
        char_ids = valid.copy()
        char_ids[0, 1, 3] = bad
        with pytest.raises(Exception, match="out of data bounds"):  # onnxruntime's own error
            session.run(None, {"char_ids": char_ids})
        with pytest.raises(ValueError, match=rf"char_ids: ids must be in 0\.\.261 \(elmokit.batch_to_ids\), got \[{bad}\]"):
            run_onnx(session, char_ids)


@needs_onnx
def test_a_batch_of_no_sentences_is_refused_clearly(clipped_export):
    """The graph cannot run a batch of 0 (onnxruntime fails in a Reshape or GatherElements):
    elmokit's helper refuses it by name; a batch of empty sentences runs."""
    from elmokit.inference.onnx_export import check_onnx, onnx_session, run_onnx

    path, bilm, _ = clipped_export
    session = onnx_session(path, threads=1)
    for shape in ((0, 3, 50), (0, 0, 50)):
        with pytest.raises(ValueError, match="char_ids: a batch of 0 sentences; the graph takes 1 or more"):
            run_onnx(session, np.zeros(shape, np.int64))
    with pytest.raises(ValueError, match="a batch of 0 sentences"):
        check_onnx(path, bilm, sentences=[], session=session)
    layers, mask = run_onnx(session, np.zeros((2, 0, 50), np.int64))
    assert layers.shape == (2, 4, 0, 12) and mask.shape == (2, 0)
    with pytest.raises(ValueError, match=r"char_ids: expected shape \(batch, tokens, 50\)"):
        run_onnx(session, np.zeros((2, 3), np.int64))
    with pytest.raises(TypeError, match="char_ids: expected integer ids"):
        run_onnx(session, np.zeros((1, 1, 50), np.float32))


@needs_onnx
def test_an_output_inside_a_file_is_refused_by_name(model_dir, tmp_path, capsys):
    """`--to-onnx t.onnx/x.onnx` with t.onnx a file: said before the export ([Errno 17] came after it)."""
    from elmokit.inference.onnx_export import export_onnx

    (tmp_path / "t.onnx").write_bytes(b"a file")
    assert main(["convert", "--model", str(model_dir), "--to-onnx", str(tmp_path / "t.onnx" / "x.onnx")]) == 2
    one_error_line(capsys, f"{tmp_path / 't.onnx'} is a file, not a folder")
    with pytest.raises(NotADirectoryError, match="t.onnx is a file, not a folder"):
        export_onnx(BiLM(load_model(model_dir).config), tmp_path / "t.onnx" / "deeper" / "x.onnx")
    assert (tmp_path / "t.onnx").read_bytes() == b"a file" and sorted(p.name for p in tmp_path.iterdir()) == ["model", "t.onnx"]


def test_without_the_onnx_extra_the_command_says_which(monkeypatch, model_dir, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    assert main(["convert", "--model", str(model_dir), "--to-onnx", str(tmp_path / "m.onnx")]) == 2
    one_error_line(capsys, "pip install 'elmokit[onnx]'")
    assert not (tmp_path / "m.onnx").exists()


def test_mix_weights_need_to_onnx(model_dir, tmp_path, capsys):
    assert main(["convert", "--model", str(model_dir), "--to-native", str(tmp_path / "n"),
                 "--mix-weights", "0,0,0"]) == 2
    one_error_line(capsys, "--mix-weights", "--to-onnx")


@needs_onnx
def test_an_elmoformanylangs_model_is_refused(tmp_path, capsys):
    from pathlib import Path

    folder = Path(__file__).resolve().parent / "fixtures" / "manylangs" / "words"
    assert main(["convert", "--model", str(folder), "--to-onnx", str(tmp_path / "m.onnx")]) == 2
    one_error_line(capsys, "ELMoForManyLangs", "ONNX")
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("flags, expected", [
    (["--mix-weights", "nan,0,0"], "expected comma-separated finite numbers"),
    (["--mix-weights", "0,0,0", "--mix-gamma", "inf"], "expected a finite number"),
    (["--mix-gamma", "2"], "--mix-gamma scales the mix that --mix-weights adds"),
    (["--mix-weights", "0,0"], "--mix-weights: the model has 3 layers"),
])
def test_bad_mix_options_are_refused_before_the_export(tmp_path, capsys, flags, expected):
    """Non-finite weights or gamma, a gamma without weights, the wrong count: one line naming the
    flag, before anything is exported (a nan mix failed only at the check, as a mismatch)."""
    try:
        status = main(["convert", "--to-onnx", str(tmp_path / "m.onnx"), *flags, "--quiet"])
    except SystemExit as exit:  # argparse's refusal of a value
        status = exit.code
    assert status == 2 and expected in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
