"""The code that runs on a GPU, checked on the CPU where the CPU can run it (issue 34).

Inference (`elmokit.inference.engine`): the batched products (both directions in one product,
what runs off the CPU) and the CUDA-graph path's block runner (static buffers, the state reset at
every step, the last block padded), with the capture itself replaced by running the captured
function, give the CPU engine's layers within 1e-6 on the golden fixture, with both clips binding,
and on tiny models. Training (`elmokit.training.recurrence`): the batched products give the
per-direction path's outputs and every gradient of autograd through the step loop of
`elmokit.model.cell`; bfloat16 products keep the state in float32 and stay near float32; the
CUDA-graph wrapper captures each layer once a shape, with leaf copies of everything but the
parameters. The CUDA tests at the end run the real capture, and skip where there is no GPU.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from elmokit import BiLM, CharCNNConfig, ElmoConfig, LSTMConfig
from elmokit.inference import cuda_graphs as inference_graphs
from elmokit.inference import engine
from elmokit.training import cuda_graphs as training_graphs
from elmokit.training.recurrence import RecurrenceOptions, forward_streams
from tests.conftest import SENTENCES
from tests.test_cell import _engine_layers, _fixture_sentences, clipping_model  # noqa: F401 (a fixture)

NO_CUDA = "no CUDA GPU here (torch.cuda.is_available() is False); these run the capture on one"


def run_instead_of_capture(monkeypatch, steps: int) -> list:
    """The CUDA-graph path on the CPU: `capture(run)` returns a graph whose replay runs `run`
    (what a captured graph replays), blocks of `steps` steps. Returns the list of captures."""
    captured = []

    def capture(run):
        captured.append(run)
        return types.SimpleNamespace(replay=run)

    monkeypatch.setattr(inference_graphs, "wanted", lambda device: True)
    monkeypatch.setattr(inference_graphs, "capture", capture)
    monkeypatch.setattr(inference_graphs, "GRAPH_STEPS", steps)
    return captured


def batched_engine(monkeypatch):
    monkeypatch.setattr(engine, "stream_layer", functools.partial(engine.stream_layer, batched=True))


@pytest.mark.parametrize("path", ["batched", "graph"])
def test_the_gpu_engine_paths_give_the_cpu_engines_layers_on_the_fixture(fixture_dir, path, monkeypatch):
    from elmokit import load_original

    model = load_original(fixture_dir / "options.json", fixture_dir / "lm_weights.hdf5").eval()
    sentences = _fixture_sentences(fixture_dir, 8)
    expected = _engine_layers(model, sentences)
    batched_engine(monkeypatch)
    captured = run_instead_of_capture(monkeypatch, 5) if path == "graph" else []
    got = _engine_layers(model, sentences)
    for want, have in zip(expected, got):
        np.testing.assert_allclose(have, want, atol=1e-6, rtol=0)
    assert len(captured) == (model.config.lstm.n_layers if path == "graph" else 0)


def test_the_graph_path_clips_where_the_cpu_engine_does(clipping_model, fixture_dir, monkeypatch):
    """The fixture's weights scaled so that both clips bind (tests/test_cell.py), float64."""
    model, _ = clipping_model
    sentences = _fixture_sentences(fixture_dir)
    expected = _engine_layers(model, sentences)
    batched_engine(monkeypatch)
    run_instead_of_capture(monkeypatch, 3)
    for want, have in zip(expected, _engine_layers(model, sentences)):
        np.testing.assert_allclose(have, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("steps", [1, 4, 32])
def test_the_block_runner_keeps_each_sentence_alone(tiny_model, rows, steps, monkeypatch):
    """Streams of several sentences a row, blocks that end mid-sentence and a padded last block:
    the graph path's layers equal the CPU engine's, each sentence's as it is alone."""
    from elmokit.inference.engine import contextualize_sentences

    sizes = np.array([len(s) + 2 for s in SENTENCES if s] * 3)
    torch.manual_seed(0)
    flat = torch.randn(int(sizes.sum()), tiny_model.config.lstm.projection_dim)  # (N, P) token vectors
    with torch.no_grad():
        expected = contextualize_sentences(tiny_model, flat, sizes, rows)
        batched_engine(monkeypatch)
        run_instead_of_capture(monkeypatch, steps)
        got = contextualize_sentences(tiny_model, flat, sizes, rows)
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want, atol=1e-6, rtol=0)


def test_the_batched_engine_in_bfloat16_is_the_per_direction_one(monkeypatch):
    """bfloat16 weights: the same roundings (each product once to bfloat16, the gates widened to
    float32 for the cell), only the order of each product's sums differs."""
    torch.manual_seed(0)
    layer = BiLM(ElmoConfig(CharCNNConfig(4, ((1, 4), (2, 8)), 1), LSTMConfig(32, 16, 1, 3.0, 3.0))).lstm.layers[0]
    low = layer.to(torch.bfloat16)
    layout = engine.stream_layout(np.array([40, 25, 33, 9]), 3)
    inputs = torch.randn(2, *layout.forward_index.shape, 16)
    expected = engine.stream_layer(low, inputs, layout, 3.0, 3.0)
    batched = engine.stream_layer(low, inputs, layout, 3.0, 3.0, batched=True)
    run_instead_of_capture(monkeypatch, 8)
    graphed = engine.stream_layer(low, inputs, layout, 3.0, 3.0, batched=True)
    assert batched.dtype == graphed.dtype == torch.float32
    scale = float(expected.abs().mean())
    for got in (batched, graphed):
        assert float((got - expected).abs().mean()) <= 2.0 ** -8 / 16 * scale


def test_the_graph_cache_follows_the_weights_and_keeps_few(tiny_model, monkeypatch):
    """A weight changed in place makes new products (and graphs); GRAPHS_KEPT row counts a layer."""
    captured = run_instead_of_capture(monkeypatch, 4)
    layer = tiny_model.lstm.layers[0]
    layout = engine.stream_layout(np.array([5, 7, 3]), 3)
    inputs = torch.randn(2, *layout.forward_index.shape, 6)
    first = engine.stream_layer(layer, inputs, layout, 3.0, 3.0, batched=True)
    engine.stream_layer(layer, inputs, layout, 3.0, 3.0, batched=True)
    assert len(captured) == 1
    with torch.no_grad():
        layer.recurrent_weight.mul_(0.5)
    changed = engine.stream_layer(layer, inputs, layout, 3.0, 3.0, batched=True)
    assert len(captured) == 2 and not torch.allclose(first, changed)
    for rows in (1, 2):
        small = engine.stream_layout(np.array([5, 7, 3]), rows)
        engine.stream_layer(layer, torch.randn(2, *small.forward_index.shape, 6), small, 3.0, 3.0, batched=True)
    products = engine.layer_products(layer, 2, True)
    assert len(products.graphs) <= inference_graphs.GRAPHS_KEPT


# ---------------------------------------------------------------------------------------------
# Training's recurrence
# ---------------------------------------------------------------------------------------------
def _recurrence_results(lstm, inputs, state, options, weights):
    layers, final = forward_streams(lstm, inputs, state, options)
    loss = sum((layer * weight).sum() for layer, weight in zip(layers, weights))
    loss = loss + final.hidden.square().sum() + final.cell.sin().sum()
    return layers, final, torch.autograd.grad(loss, [inputs, *lstm.parameters()])


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_batched_training_products_equal_the_step_loop_and_its_gradients(clip):
    """Both directions in one product (what runs off the CPU) against autograd over the step loop
    of `BiLstm` (`elmokit.model.cell`'s definition), float64, from a carried state, clipped or not."""
    from tests.test_lm import recurrence_case

    lstm, inputs, state, weights = recurrence_case(clip)
    layers, final, grads = _recurrence_results(lstm, inputs, state, RecurrenceOptions(batched=True), weights)
    packed = inputs.transpose(1, 2).reshape(2, 7 * 3, 6)
    outputs, ref_final = lstm._run_layers(packed, [3] * 7, state)
    ref_layers = [output.view(2, 7, 3, 6).transpose(1, 2) for output in outputs]
    loss = sum((layer * weight).sum() for layer, weight in zip(ref_layers, weights))
    loss = loss + ref_final.hidden.square().sum() + ref_final.cell.sin().sum()
    ref_grads = torch.autograd.grad(loss, [inputs, *lstm.parameters()])
    for layer, ref in zip(layers, ref_layers):
        torch.testing.assert_close(layer, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(final.cell, ref_final.cell, atol=1e-12, rtol=1e-10)
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref, atol=1e-10, rtol=1e-8)
    if clip:
        assert any((layer.abs() >= clip - 1e-12).any() for layer in layers)


def test_bfloat16_training_products_keep_the_state_float32_and_stay_near_float32():
    """lstm_bf16: the products' operands rounded to bfloat16, everything added to them float32.
    Without clipping (a clip turns a rounding into a different mask), outputs and gradients within
    a few bfloat16 roundings of float32's."""
    from tests.test_lm import make_model

    torch.manual_seed(0)
    lstm = make_model(clip=0.0).bilm.lstm
    inputs = torch.randn(2, 4, 20, 6, requires_grad=True)
    weights = [torch.randn(2, 4, 20, 6) for _ in lstm.layers]
    reference = _recurrence_results(lstm, inputs, None, RecurrenceOptions(), weights)
    low = _recurrence_results(lstm, inputs, None, RecurrenceOptions(lstm_bf16=True), weights)
    assert all(layer.dtype == torch.float32 for layer in low[0]) and low[1].cell.dtype == torch.float32
    for got, want in zip(low[0], reference[0]):
        got, want = got.detach(), want.detach()
        assert float((got - want).abs().max()) < 3e-2 * float(want.abs().max())
    for got, want in zip(low[2], reference[2]):
        assert float((got - want).norm()) < 3e-2 * float(want.norm())
    assert any(float((got - want).detach().abs().max()) > 0 for got, want in zip(low[0], reference[0]))  # bf16 ran


def test_the_training_graph_wrapper_captures_each_layer_once_a_shape(monkeypatch):
    """`training.cuda_graphs.graphed` with torch's capture replaced by the function itself: one
    capture a layer and shape, leaf copies of the inputs (the parameters themselves), and the
    LanguageModel's recurrence asks for it only for CUDA tensors that need gradients."""
    from tests.test_lm import make_model

    made = []

    def make_graphed_callables(function, samples):
        made.append(samples)
        return function

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", make_graphed_callables)
    monkeypatch.setattr(training_graphs, "should_capture",
                        lambda inputs: torch.is_grad_enabled() and inputs.requires_grad)
    lstm = make_model(clip=3.0).bilm.lstm
    inputs = torch.randn(2, 3, 5, 6, requires_grad=True)
    options = RecurrenceOptions(batched=True, cuda_graph=True)
    expected, _ = forward_streams(lstm, inputs, None, RecurrenceOptions(batched=True))
    for _ in range(2):
        got, _ = forward_streams(lstm, inputs, None, options)
    assert len(made) == len(lstm.layers)  # once a layer, then reused
    parameters = set(map(id, lstm.parameters()))
    for samples in made:
        assert all(sample.is_leaf for sample in samples)
        assert sum(id(sample) in parameters for sample in samples) == 3  # the weights, as they are
    for layer, want in zip(got, expected):
        torch.testing.assert_close(layer, want)
    forward_streams(lstm, torch.randn(2, 4, 5, 6, requires_grad=True), None, options)  # another shape
    assert len(made) == 2 * len(lstm.layers)
    with torch.no_grad():
        forward_streams(lstm, inputs, None, options)  # evaluation: eager
    assert len(made) == 2 * len(lstm.layers)


def test_graphs_are_wanted_only_on_cuda():
    cpu = torch.randn(2, 2, requires_grad=True)
    assert not training_graphs.should_capture(cpu) and not inference_graphs.wanted(torch.device("cpu"))
    assert not inference_graphs.wanted(torch.device("meta"))


# ---------------------------------------------------------------------------------------------
# On a GPU, when there is one
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("graphs", ["1", "0"])
@pytest.mark.parametrize("weights", ["fixture", "random"])
def test_cuda_engine_equals_the_cpu_engine(weights, graphs, monkeypatch):
    """The GPU's streamed layers (batched products, with and without CUDA graphs, TF32 off) equal
    the CPU's within 1e-5, with the golden fixture's weights (where ../shared is) and with random
    clipped ones, at 1, 3 and 64 rows of many sentences."""
    import copy

    from elmokit import load_original
    from tests.conftest import FIXTURE, require_shared

    monkeypatch.setenv(inference_graphs.GRAPHS_VARIABLE, graphs)
    if weights == "fixture":
        fixture = require_shared(FIXTURE)
        model = load_original(fixture / "options.json", fixture / "lm_weights.hdf5").eval()
    else:
        torch.manual_seed(0)
        model = BiLM(ElmoConfig(CharCNNConfig(4, ((1, 4), (2, 8)), 1), LSTMConfig(64, 32, 2, 3.0, 3.0))).eval()
    rng = np.random.default_rng(0)
    sizes = rng.integers(3, 40, size=200)
    torch.manual_seed(0)
    tokens = torch.randn(int(sizes.sum()), model.config.lstm.projection_dim)  # (N, P) token vectors
    gpu = copy.deepcopy(model).cuda()
    with torch.no_grad():
        for rows in (1, 3, 64):
            want = engine.contextualize_sentences(model, tokens, sizes, rows)
            got = engine.contextualize_sentences(gpu, tokens.cuda(), sizes, rows)
            for have, ref in zip(got, want):
                torch.testing.assert_close(have.cpu(), ref, atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_graph_training_equals_eager_training(autocast):
    """Three windows of LM training on the GPU, the recurrence replayed from CUDA graphs against
    the same steps eager (under `--bf16`'s autocast too): the same losses and weights (float32
    sums in another order: 1e-4)."""
    from tests.test_lm import make_model, random_streams, window

    results = []
    for graph in (False, True):
        model = make_model(dropout=0.0).cuda().train()
        model.recurrence = RecurrenceOptions(cuda_graph=graph)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        char_ids, vocab_ids = random_streams(4, 30)
        state, losses = None, []
        for first in (0, 10, 20):
            batch = window(char_ids, vocab_ids, first, 10).to("cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                out = model(batch, state)
            optimizer.zero_grad()
            out.loss.backward()
            optimizer.step()
            state, losses = out.state, losses + [float(out.loss)]
        results.append((losses, [p.detach().cpu() for p in model.parameters()]))
    (eager_losses, eager_weights), (graph_losses, graph_weights) = results
    assert graph_losses == pytest.approx(eager_losses, rel=1e-4)
    for got, want in zip(graph_weights, eager_weights):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# One command measures a GPU: what the CPU can check of it
# ---------------------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]
CUDA_PAGES = ("train-cuda.md", "embed-cuda.md", "gpu-check.md")


def test_the_gpu_check_script_parses_and_stops_cleanly_without_a_gpu(tmp_path):
    assert subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu_check.sh")]).returncode == 0
    text = (REPO / "scripts" / "gpu_check.sh").read_text(encoding="utf-8")
    assert "pip install" not in text.replace("installs nothing", "")  # it runs offline, cold
    if torch.cuda.is_available():
        return
    pages = {name: (REPO / "bench" / "results" / name).read_bytes() for name in CUDA_PAGES}
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                            env={**os.environ, "OUT": str(tmp_path)}, timeout=120)
    assert result.returncode == 3 and "torch sees no CUDA GPU" in result.stderr, result.stderr
    assert pages == {name: (REPO / "bench" / "results" / name).read_bytes() for name in CUDA_PAGES}
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal a machine without a GPU gives")
@pytest.mark.parametrize("script", ["train.py", "embed.py"])
def test_the_benchmarks_cuda_option_parses_and_refuses_without_cuda(script):
    result = subprocess.run([sys.executable, str(REPO / "bench" / script), "--device", "cuda"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "torch sees no CUDA GPU" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_the_cuda_pages_say_not_measured_until_a_gpu_run_writes_them():
    """A page either says it was not measured (and holds no table), or was written by its script
    from a run on a named CUDA device."""
    for name in CUDA_PAGES:
        text = (REPO / "bench" / "results" / name).read_text(encoding="utf-8")
        if "Not measured yet" in text:
            assert "|" not in text, name
        else:
            assert text.count("Run of ") == 1 and "CUDA" in text and "torch" in text, name


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_the_gpu_training_benchmark_runs_its_models_and_writes_its_page(tmp_path, monkeypatch):
    """bench/train_cuda.py's steps and page on the CPU (no graphs there): a tiny shape, a synthetic
    corpus, the five models stepping in turn, the targets judged from the rows."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # undone after: bench/onnx.py would pass for the onnx package
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import train as bench_train
    import train_cuda

    from elmokit.training.vocab import Vocabulary, make_vocab
    from tests.test_lm import tiny_config

    data, name = train_cuda.corpus(tmp_path / "no-ptb", n_lines=300)
    assert "synthetic" in name
    make_vocab([data], tmp_path / "vocab.txt")
    vocab = Vocabulary.load(tmp_path / "vocab.txt")
    args = types.SimpleNamespace(device="cpu", unroll_steps=5, warmup=1, steps=2, shapes=["tiny"],
                                 note="", output=tmp_path / "train-cuda.md")
    rows = train_cuda.bench_rows("tiny", tiny_config(), vocab, data, 4, args, bench_train.TorchLstmLM)
    assert [row["model"] for row in rows][-1].startswith("nn.LSTM") and len(rows) == 5
    assert rows[-1]["vs_baseline"] == 1.0 and all(row["tokens_per_s"] > 0 for row in rows)
    for row in rows:
        row["rows"] = 128
    train_cuda.write_page(args.output, args, rows, "a CPU", name, len(vocab), "now", "quiet", "quiet")
    page = args.output.read_text(encoding="utf-8")
    assert page.count("| tiny | 128 |") == 5 and "target >= 1.5x" in page and "bfloat16 products" in page
    import gpu_time  # docs/gpu.md's hours for 1B tokens read such a page's rows

    measured = gpu_time.measured_rows(args.output)
    assert [(shape, n, model) for shape, n, model, _ in measured] == [("tiny", "128", r["model"]) for r in rows]
    assert [speed for *_, speed in measured] == pytest.approx([round(r["tokens_per_s"]) for r in rows], abs=0.5)


def test_docs_gpu_time_section_is_what_its_script_writes():
    """docs/gpu.md's hours for 1B tokens: measured rows only from a recorded train-cuda.md (none
    yet), the rest arithmetic labelled as such; the section equals what bench/gpu_time.py writes."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_time.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (REPO / "docs" / "gpu.md").read_text(encoding="utf-8")
    assert "Arithmetic, not a measurement" in text
    measured = "Run of " in (REPO / "bench" / "results" / "train-cuda.md").read_text(encoding="utf-8")
    assert ("Not measured yet: no GPU has run" in text) != measured


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("options", [["--cuda-graph"], ["--cuda-graph", "--lstm-bf16", "--bf16"], ["--tf32"]])
def test_cuda_train_command_with_the_gpu_options(tmp_path, capsys, options):
    """`elmo train --device cuda` with each GPU option, the default optimizer (Adagrad) and the
    sampled softmax: it runs to the end and its perplexity is finite."""
    import json
    import math

    from elmokit.cli import main
    from tests.test_devices import write_lm_inputs

    write_lm_inputs(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--train", str(tmp_path / "train.txt"), "--valid", str(tmp_path / "valid.txt"),
                 "--vocab", str(tmp_path / "vocab.txt"), "--model", str(tmp_path / "model.json"),
                 "--output-dir", str(run), "--batch-size", "4", "--unroll-steps", "5", "--epochs", "1",
                 "--n-samples", "10", "--no-progress", "--device", "cuda", *options]) == 0
    capsys.readouterr()
    assert main(["perplexity", str(run), str(tmp_path / "valid.txt"), "--json", "--device", "cuda"]) == 0
    assert math.isfinite(json.loads(capsys.readouterr().out)["ppl"])
    torch.set_float32_matmul_precision("highest")


def test_the_gpu_embedding_benchmark_measures_the_engine_and_judges_the_targets(tiny_model, monkeypatch):
    """bench/embed.py's GPU parts on the CPU: the engine alone over embed_many's calls (the
    synchronization a no-op here), and the targets judged per measure, 'never slower' included."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # undone after: bench/onnx.py would pass for the onnx package
    import embed as bench_embed

    from elmokit import ElmoEmbedder

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    embedder = ElmoEmbedder(module=tiny_model)
    embedder.POSITION_BUDGET = 64  # several calls
    sentences = [["a", "b", "c"] * k for k in range(1, 30)]
    assert bench_embed.engine_tokens_per_s(embedder, sentences, 4) > 0
    assert len(bench_embed.bench_sentences(5, 12)) == 12
    best = {("original", 256, True, "float32"): {"tokens_per_s": 2.0e5, "engine_tokens_per_s": 1.0e5},
            ("original", 1024, True, "float32"): {"tokens_per_s": 1.0e5, "engine_tokens_per_s": 2.0e5}}
    lines = "\n".join(bench_embed.gpu_target_lines(best))
    assert "end to end, >= 1,024 rows: 100,000 tokens/s, target >= 150,000: **NOT met**" in lines
    assert "end to end: never slower with more rows: **NOT met** (slower at 256 -> 1,024 rows)" in lines
    assert "the engine alone, >= 1,024 rows: 200,000 tokens/s, target >= 150,000: **met**" in lines
    assert "the engine alone: never slower with more rows: **met**" in lines


def test_the_cpu_check_script_parses_and_stops_cleanly_without_its_data(tmp_path):
    """scripts/cpu_check.sh (issue 41's CPU benchmarks on another machine's CPU): it parses, runs
    offline, and without UD EWT dev and PTB where ELMOKIT_BENCH_DATA points it measures nothing,
    names the file it lacks, and writes no page."""
    script = REPO / "scripts" / "cpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    assert "pip install" not in script.read_text(encoding="utf-8")
    before = sorted(path.name for path in (REPO / "bench" / "results").iterdir())
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "ELMOKIT_BENCH_DATA": str(tmp_path), "OUT": str(tmp_path)})
    assert result.returncode == 3 and "en_ewt-ud-dev.conllu is absent" in result.stderr, result.stderr
    assert sorted(path.name for path in (REPO / "bench" / "results").iterdir()) == before
    assert not list(tmp_path.iterdir())
