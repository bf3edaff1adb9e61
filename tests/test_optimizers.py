"""The optimizers the trainer builds use torch's fused kernels only where the parameters' device
has one (issue 34: the default `elmo train` crashed on a CUDA GPU whose torch had no fused
Adagrad). No GPU is needed: every optimizer is built and stepped on the CPU and on the meta
device (which torch's fused optimizers refuse), and with a torch whose dispatcher lacks the fused
Adagrad kernel, as that CUDA build did."""

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
