"""The optimizers the trainer builds use torch's fused kernels only where the parameters' device
has one (issue 34: the default `elmo train` crashed on a CUDA GPU whose torch had no fused
Adagrad). No GPU is needed: every optimizer is built and stepped on the CPU and on the meta
device (which torch's fused optimizers refuse), and with a torch whose dispatcher lacks the fused
Adagrad kernel, as that CUDA build did. Then every step the trainer can build (each optimizer
with each option that changes the step) is built and taken on the meta device: the device options,
the optimizer, the LSTM's recurrence forward and backward as it runs off the CPU, the clipping and
the update; and the package is scanned for the CPU-only calls that would crash on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elmokit.training.build import build_optimizer, has_fused_kernel
from elmokit.training.config import TrainConfig


def config_for(optimizer: str) -> TrainConfig:
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    values = {"optimizer": optimizer, "lr": 0.1}
    required = {"output_dir": "run", "train_files": ["t.txt"], "vocab": "v.txt"}
    return TrainConfig(**values, **{name: value for name, value in required.items() if name in fields})


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_every_optimizer_builds_and_steps_where_its_kernels_are(optimizer, device):
    model = torch.nn.Linear(4, 3, device=device)
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    built = build_optimizer(config_for(optimizer), model)
    assert built.param_groups[0]["fused"] == has_fused_kernel(optimizer, torch.device(device))
    built.step()  # fused=True on a device without the kernel raises here, as it did on CUDA


def test_the_dispatcher_is_asked_per_optimizer_and_device(monkeypatch):
    assert has_fused_kernel("adagrad", torch.device("cpu")) and has_fused_kernel("adam", torch.device("cpu"))
    assert not has_fused_kernel("adam", torch.device("meta")) and not has_fused_kernel("adagrad", torch.device("mps"))
    asked = torch._C._dispatch_has_kernel_for_dispatch_key
    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key",  # torch 2.11's CUDA: no fused Adagrad
                        lambda op, key: op != "aten::_fused_adagrad_" and asked(op, key))
    model = torch.nn.Linear(4, 3)
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    adagrad = build_optimizer(config_for("adagrad"), model)
    assert adagrad.param_groups[0]["fused"] is False and adagrad.defaults["foreach"] in (None, True)
    adagrad.step()
    assert build_optimizer(config_for("adam"), model).param_groups[0]["fused"] is True


# ---------------------------------------------------------------------------------------------
# Every step the trainer can build, on a device that is not the CPU
# ---------------------------------------------------------------------------------------------
# The options that change what a training step runs (training.config.TrainConfig): the optimizer,
# how gradients are clipped, which softmax (the sampled one's gradient comes sparse), bfloat16
# autocast, the LSTM's and the softmax's bfloat16 products, and the CUDA-only options (ignored off CUDA).
STEP_OPTIONS = [
    {"grad_clip": 10.0, "softmax": "sampled"}, {"grad_clip": 0.0, "softmax": "full"},
    {"bf16": True}, {"lstm_bf16": True}, {"lstm_bf16": True, "grad_clip": 0.0, "softmax": "full"},
    {"softmax_bf16": True, "softmax": "full"}, {"softmax_bf16": True, "lstm_bf16": True},
    {"tf32": True, "cuda_graph": True}, {"deterministic": True},
]


def tiny_language_model(device: str):
    from elmokit.model.config import CharCNNConfig, ElmoConfig, LSTMConfig
    from elmokit.training.lm import LanguageModel

    torch.manual_seed(0)
    config = ElmoConfig(CharCNNConfig(embedding_dim=4, filters=((1, 4), (2, 8)), n_highway=1),
                        LSTMConfig(cell_dim=12, projection_dim=6, n_layers=2, cell_clip=3.0, proj_clip=3.0))
    return LanguageModel(config, 50, dropout=0.1, n_samples=10).to(device)


def test_the_options_cover_every_field_that_changes_the_step():
    """A new TrainConfig field must be placed: in STEP_OPTIONS (it changes the step, so this file
    builds the step with it) or in the list of those that do not."""
    covered = {name for options in STEP_OPTIONS for name in options} | {"optimizer"}
    elsewhere = {"output_dir", "train_files", "valid_files", "vocab", "model", "init_from", "init_from_original",
                 "lr", "initial_accumulator", "warmup_steps", "lr_decay", "anneal_start", "anneal_steps",
                 "dropout", "batch_size", "unroll_steps", "epochs", "max_tokens", "n_samples", "seed",
                 "data_split", "eval_every", "eval_batch_size", "patience", "log_every", "checkpoint_every",
                 "device", "threads", "progress"}  # the schedule, the data, the files, the bookkeeping
    assert {field.name for field in dataclasses.fields(TrainConfig)} == covered | elsewhere


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
@pytest.mark.parametrize("options", STEP_OPTIONS, ids=lambda options: ",".join(options))
def test_every_training_step_builds_and_steps_off_the_cpu(optimizer, options, recwarn):
    """The model on the meta device (which holds no data, and which torch's fused optimizers and
    every CPU-only kernel refuse, as CUDA refused fused Adagrad): the device options applied
    (`configure_device`), the optimizer built, the LSTM's recurrence run forward and backward the
    way it runs off the CPU (both directions batched, bfloat16 products if asked), then the
    gradient clipping and the optimizer's step of `train_step` (`apply_gradients`)."""
    from elmokit.training.build import configure_device
    from elmokit.training.loop import apply_gradients
    from elmokit.training.recurrence import BatchedProducts, forward_streams
    from tests.test_devices import tensors_need_a_device

    config = dataclasses.replace(config_for(optimizer), **options)
    model = tiny_language_model("meta").train()
    device = torch.device("meta")
    with tensors_need_a_device():
        configure_device(config, model, device)
        built = build_optimizer(config, model)
        products = model.recurrence.products(device)
        assert isinstance(products, BatchedProducts)  # off the CPU: one product for both directions
        assert products.dtype == (torch.bfloat16 if config.lstm_bf16 else None)
        tokens = torch.randn(2, 3, 5, 6, device=device, requires_grad=True)  # (D, B, U, P)
        layers, state = forward_streams(model.bilm.lstm, tokens, None, model.recurrence)
        assert layers[-1].dtype == state.cell.dtype == torch.float32  # the state stays float32
        layers[-1].sum().backward()
        hidden = torch.randn(4, 6, device=device, requires_grad=True)
        targets = torch.zeros(2, 4, dtype=torch.long, device=device)  # both parts: the softmax's step
        sum(model.nll_sums([hidden, hidden], list(targets), sampled=config.softmax == "sampled")).backward()
        assert hidden.grad is not None and model.softmax.weight.grad.dtype == torch.float32
        for parameter in model.parameters():
            if parameter.grad is None:  # the encoder's and the softmax's: as the rest of the step gives them
                parameter.grad = torch.ones_like(parameter)
        norm = apply_gradients(model, built, config)
    assert norm.device == device and built.param_groups[0]["fused"] == has_fused_kernel(optimizer, device)
    assert not model.recurrence.cuda_graph  # graphs only on a CUDA device
    if config.tf32 or config.cuda_graph:
        assert any("CUDA GPU only" in str(warning.message) for warning in recwarn)


def test_no_cpu_only_call_on_a_path_that_runs_on_cuda():
    """The kinds of call that run on the CPU only, or pin a choice to it, appear in the package
    only where the device is checked first: oneDNN's private ops in elmokit.kernels (behind
    `x.device.type == "cpu"`, its float32 check's autocast too), no other hard-coded autocast
    device, no fused optimizer asked for unconditionally, generators made on the device of the tensors they shuffle (or on purpose on
    the CPU, as the sampler and the probes' split), memory pinned only by LMBatch.pin_memory."""
    import re
    from pathlib import Path

    import elmokit

    package = Path(elmokit.__file__).resolve().parent
    rules = {r"torch\.ops\.mkldnn": {"kernels.py"}, r"autocast\(\s*[\"']cpu": {"kernels.py"},
             r"fused\s*=\s*True": set(),
             r"\.pin_memory\(\)": {"training/data.py"}, r"torch\.Generator\(\)": {"tasks/probes.py"}}
    found = []
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package).as_posix()
        text = path.read_text(encoding="utf-8")
        found += [f"{name}: {pattern}" for pattern, allowed in rules.items()
                  if re.search(pattern, text) and name not in allowed]
    assert not found, found


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_fused_optimizers_only_on_the_cpu(optimizer, monkeypatch):
    """A fused optimizer is asked for on the CPU only (where this torch has the kernel): torch
    2.11's CUDA build registers a fused Adagrad that its Adagrad refuses at the first step, which
    failed every `elmo train --device cuda` on an H200. The query needs no GPU: the dispatcher is
    made to answer as that build's did (a kernel for every device)."""
    assert has_fused_kernel(optimizer, torch.device("cpu"))  # torch 2.13's CPU build has both
    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", lambda name, key: True)
    assert not has_fused_kernel(optimizer, torch.device("cuda"))
    assert not has_fused_kernel(optimizer, torch.device("meta"))


def test_the_device_options_on_a_cuda_device_without_one(monkeypatch):
    """configure_device on a CUDA device (no GPU needed to set torch's flags): exact float32 unless
    tf32 is asked, graphs only if asked; the flags are put back afterwards."""
    from elmokit.training.build import configure_device

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)
    precision = torch.get_float32_matmul_precision()
    model = tiny_language_model("cpu")
    try:
        for tf32, graph in ((False, False), (True, True)):
            config = dataclasses.replace(config_for("adam"), tf32=tf32, cuda_graph=graph)
            configure_device(config, model, torch.device("cuda"))
            assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
            assert torch.backends.cudnn.allow_tf32 is tf32 and model.recurrence.cuda_graph is graph
    finally:
        torch.set_float32_matmul_precision(precision)
