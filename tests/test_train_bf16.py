"""`elmo train --lstm-bf16` on the CPU: the recurrence's products in bfloat16, both directions in
one batched product (`BatchedProducts(torch.bfloat16)`, oneDNN's bfloat16 kernel; a direction at a
time with `batched=False`), the state, gates and sums float32, the weights' master copy float32; a
few training steps track float32's losses, and the option is saved with the run and taken up again
by `--resume`."""

from __future__ import annotations

import itertools
import warnings
import json

import pytest
import torch

from elmokit import kernels
from elmokit.cli import main
from elmokit.training.recurrence import BatchedProducts, DirectionProducts, RecurrenceOptions, forward_streams
from tests.test_train import corpus, losses  # noqa: F401 - the tiny corpus fixture and its metrics reader


def test_the_cpu_runs_bf16_products_batched_and_float32_a_direction_at_a_time():
    options = RecurrenceOptions(lstm_bf16=True)
    products = options.products(torch.device("cpu"))
    assert isinstance(products, BatchedProducts) and products.dtype == torch.bfloat16
    assert isinstance(options.products(torch.device("meta")), BatchedProducts)  # off the CPU too
    low = RecurrenceOptions(lstm_bf16=True, batched=False).products(torch.device("cpu"))
    assert isinstance(low, DirectionProducts) and low.dtype == torch.bfloat16
    default = RecurrenceOptions().products(torch.device("cpu"))
    assert isinstance(default, DirectionProducts) and default.dtype is None  # the default stays float32


@pytest.mark.parametrize("batched", [False, True])
def test_bf16_products_keep_state_and_master_weights_float32_near_float32(batched):
    """Both product paths with bfloat16 operands: outputs, final state and gradients float32 and
    within a few bfloat16 roundings of float32's; the parameters stay float32; on the CPU path the
    products ran through oneDNN in bfloat16 where this torch has its bfloat16 kernels."""
    from tests.test_lm import make_model

    torch.manual_seed(0)
    lstm = make_model(clip=0.0).bilm.lstm
    inputs = torch.randn(2, 4, 20, 6, requires_grad=True)
    weights = [torch.randn(2, 4, 20, 6) for _ in lstm.layers]

    def results(options):
        layers, final = forward_streams(lstm, inputs, None, options)
        loss = sum((layer * weight).sum() for layer, weight in zip(layers, weights)) + final.cell.sin().sum()
        return layers, final, torch.autograd.grad(loss, [inputs, *lstm.parameters()])

    reference = results(RecurrenceOptions(batched=batched))
    kernels.reset()
    low = results(RecurrenceOptions(batched=batched, lstm_bf16=True))
    if not batched and torch.bfloat16 in kernels._ONEDNN_DTYPES:
        assert (("linear", torch.bfloat16) in kernels._verified and ("packed", torch.bfloat16) in kernels._verified
                and ("matmul", torch.bfloat16) in kernels._verified)
    assert all(layer.dtype == torch.float32 for layer in low[0])
    assert low[1].hidden.dtype == low[1].cell.dtype == torch.float32
    assert all(parameter.dtype == torch.float32 for parameter in lstm.parameters())
    assert all(grad.dtype == torch.float32 for grad in low[2])
    for got, want in zip(low[0], reference[0]):
        got, want = got.detach(), want.detach()
        assert 0 < float((got - want).abs().max()) < 3e-2 * float(want.abs().max())  # bf16 ran, and stayed close
    for got, want in zip(low[2], reference[2]):
        assert float((got - want).norm()) < 3e-2 * float(want.norm())


OPTIONS = ["--epochs", "1", "--max-tokens", "600", "--eval-every", "1000", "--checkpoint-every", "999"]  # 30 steps


@pytest.fixture(scope="module")
def reference_runs(corpus, tmp_path_factory):  # noqa: F811
    """The same 30 steps (seed, windows, dropout, samples) in float32, with --lstm-bf16 and with
    --softmax-bf16."""
    root = tmp_path_factory.mktemp("runs")
    base = ["train", "--config", str(corpus["train_json"]), *OPTIONS]
    assert main([*base, "--output-dir", str(root / "float32")]) == 0
    assert main([*base, "--lstm-bf16", "--output-dir", str(root / "bf16")]) == 0
    assert main([*base, "--softmax-bf16", "--output-dir", str(root / "softmax-bf16")]) == 0
    return root


@pytest.mark.parametrize("run, bound", [("bf16", 2e-3), ("softmax-bf16", 2e-3)])  # measured: 1.4e-4, 1.1e-4
def test_training_steps_with_bf16_products_track_float32s_losses(reference_runs, run, bound):
    exact, low = losses(reference_runs / "float32"), losses(reference_runs / run)
    assert exact.keys() == low.keys() and len(exact) == 30
    differences = [abs(low[step] - exact[step]) / exact[step] for step in exact]
    assert max(differences) < bound, max(differences)
    assert max(differences) > 0  # the bfloat16 products ran
    assert sum(list(low.values())[-5:]) < sum(list(low.values())[:5])  # and it learns
    config = json.loads((reference_runs / run / "train_config.json").read_text())
    assert (config["lstm_bf16"], config["softmax_bf16"]) == (run == "bf16", run == "softmax-bf16")


def test_lstm_bf16_is_saved_with_the_run_and_resumed(corpus, reference_runs, tmp_path, monkeypatch):  # noqa: F811
    """Stopped at step 5 and resumed without options: the run's train_config.json says
    lstm_bf16, the resumed steps run bfloat16 products again, and their losses are the
    uninterrupted --lstm-bf16 run's, step for step."""
    from elmokit.training import processes

    steps = itertools.count(1)
    with monkeypatch.context() as patch:
        patch.setattr(processes.StopSignals, "requested", lambda self, dist_: next(steps) == 5)
        assert main(["train", "--config", str(corpus["train_json"]), *OPTIONS, "--lstm-bf16",
                     "--output-dir", str(tmp_path / "stopped")]) == 130
    assert json.loads((tmp_path / "stopped" / "train_config.json").read_text())["lstm_bf16"] is True
    from elmokit.training import loop

    asked, evaluating = [], []
    products, evaluate = RecurrenceOptions.products, loop.evaluate

    def evaluate_marked(*args, **kwargs):
        evaluating.append(True)
        try:
            return evaluate(*args, **kwargs)
        finally:
            evaluating.pop()

    monkeypatch.setattr(loop, "evaluate", evaluate_marked)
    monkeypatch.setattr(RecurrenceOptions, "products", lambda self, device: asked.append(
        (self.lstm_bf16, bool(evaluating))) or products(self, device))
    assert main(["train", "--resume", "--output-dir", str(tmp_path / "stopped")]) == 0
    training = [bf16 for bf16, in_validation in asked if not in_validation]
    validation = [bf16 for bf16, in_validation in asked if in_validation]
    assert training and all(training) and not any(validation)  # validation in float32, as elmo perplexity
    assert losses(tmp_path / "stopped") == losses(reference_runs / "bf16")


@pytest.mark.parametrize("option", ["lstm_bf16", "softmax_bf16"])
def test_bf16_products_on_a_cpu_without_native_bfloat16_are_warned_about(monkeypatch, option):
    from elmokit.training import build
    from elmokit.training.config import TrainConfig
    from tests.test_lm import make_model

    model = make_model()
    monkeypatch.setattr(kernels, "bf16_native", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build.configure_device(TrainConfig(**{"lstm_bf16": False, "softmax_bf16": False, option: True}), model,
                               torch.device("cpu"))  # no warning
    assert model.recurrence.lstm_bf16 == (option == "lstm_bf16")
    assert model.softmax_dtype == (torch.bfloat16 if option == "softmax_bf16" else None)
    monkeypatch.setattr(kernels, "bf16_native", lambda: False)
    flag = "--" + option.replace("_", "-")
    with pytest.warns(UserWarning, match=f"slower than float32 on this CPU.*without {flag}"):
        build.configure_device(TrainConfig(**{option: True}), model, torch.device("cpu"))


@pytest.mark.parametrize("native", [True, False])
def test_a_new_run_takes_bf16_products_where_the_cpu_has_native_bfloat16_and_a_resume_keeps_its_own(
        corpus, tmp_path, monkeypatch, native):  # noqa: F811
    """Left unset, --lstm-bf16 and --softmax-bf16 are on where the CPU has native bfloat16 products
    (AVX512-BF16 or AMX: faster than float32 there), off elsewhere, and the run's train_config.json
    records what it chose; a resume keeps that on another CPU, and a run saved before these
    options existed resumes in float32, as it ran; an explicit flag wins."""
    base = json.loads(corpus["train_json"].read_text())
    del base["lstm_bf16"], base["softmax_bf16"]  # the fixture pins float32
    config = tmp_path / "train.json"
    config.write_text(json.dumps(base))
    monkeypatch.setattr(kernels, "bf16_native", lambda: native)
    run = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bfloat16 products without native ones here
        assert main(["train", "--config", str(config), "--max-tokens", "40", "--output-dir", str(run)]) == 0
    saved = json.loads((run / "train_config.json").read_text())
    assert saved["lstm_bf16"] is native and saved["softmax_bf16"] is native
    monkeypatch.setattr(kernels, "bf16_native", lambda: not native)  # resumed on another CPU
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["train", "--resume", "--output-dir", str(run), "--max-tokens", "80"]) == 0
    saved = json.loads((run / "train_config.json").read_text())
    assert saved["lstm_bf16"] is native and saved["softmax_bf16"] is native
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(set(record["resumed_with"]) == {"max_tokens"} for record in records if "resumed_with" in record)
    for options in (saved, checkpoint := torch.load(run / "checkpoint.pt", weights_only=True)["train_config"]):
        del options["lstm_bf16"], options["softmax_bf16"]  # a run from before these options: float32
    (run / "train_config.json").write_text(json.dumps(saved))
    whole = torch.load(run / "checkpoint.pt", weights_only=True)
    torch.save(whole | {"train_config": checkpoint}, run / "checkpoint.pt")
    monkeypatch.setattr(kernels, "bf16_native", lambda: True)
    assert main(["train", "--resume", "--output-dir", str(run), "--max-tokens", "120"]) == 0
    saved = json.loads((run / "train_config.json").read_text())
    assert saved["lstm_bf16"] is False and saved["softmax_bf16"] is False
    monkeypatch.setattr(kernels, "bf16_native", lambda: not native)
    assert main(["train", "--config", str(config), "--max-tokens", "40", "--no-softmax-bf16",
                 "--output-dir", str(tmp_path / "explicit")]) == 0
    saved = json.loads((tmp_path / "explicit" / "train_config.json").read_text())
    assert saved["lstm_bf16"] is (not native) and saved["softmax_bf16"] is False
