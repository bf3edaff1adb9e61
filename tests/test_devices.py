"""Every path runs with its tensors on the model's device: Elmo, ElmoEmbedder, HubElmo, `elmo
embed`, `elmo similar`, `elmo task train/eval/predict` (frozen and fine-tuned biLM), `elmo train`
and `elmo perplexity`; and the one `device=` / `--device` option (AllenNLP's `cuda_device` alias).

No GPU is needed to catch a tensor made on the wrong device: inside `tensors_need_a_device()`
every tensor that elmokit's own code makes without naming a device (`torch.arange(n)`,
`torch.zeros(...)`, `torch.tensor(...)`) is made on the meta device, which holds no data, so the
path fails as it would on a GPU, and the place is reported. Modules' constructors are exempt:
like `nn.Linear`, they build on the default device and are moved with `.to()`. The CUDA tests at
the end run the same paths on a GPU, and skip where there is none.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

import elmokit
from elmokit import Elmo, ElmoEmbedder, HubElmo, batch_to_ids, save_pretrained
from elmokit.cli import main
from elmokit.devices import resolve_device, resolve_dtype
from tests.conftest import SENTENCES
from tests.test_task_cli import write_columns
from tests.test_tasks import synthetic_tagging

SOURCE = Path(elmokit.__file__).resolve().parent
CONSTRUCTORS = _device_constructors()
NO_CUDA = "no CUDA GPU here (torch.cuda.is_available() is False); these run the same paths on one"


class _TensorsWithoutDeviceOnMeta(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in CONSTRUCTORS and kwargs.get("device") is None:
            frame = sys._getframe(1)  # the Python code that called the constructor
            filename = Path(frame.f_code.co_filename).resolve()
            constructing = frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), nn.Module)
            if filename.is_relative_to(SOURCE) and not constructing:
                self.sites.append(f"{filename.relative_to(SOURCE)}:{frame.f_lineno} torch.{func.__name__}")
                kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextlib.contextmanager
def tensors_need_a_device():
    """Fail if elmokit's code, run inside, makes a tensor without naming its device."""
    mode = _TensorsWithoutDeviceOnMeta()
    try:
        with mode:
            yield
    except Exception as error:
        raise AssertionError(f"failed; tensors made without a device at {sorted(set(mode.sites))}: "
                             f"{type(error).__name__}: {error}") from error
    assert not mode.sites, f"tensors made without a device at {sorted(set(mode.sites))}"


def test_the_check_catches_a_tensor_made_without_a_device():
    """What chars.add_boundaries did before: torch.arange on the default device, compared with
    lengths on the model's device."""
    namespace = {"torch": torch}
    code = "def token_positions(lengths, n):\n    return torch.arange(n) < lengths.unsqueeze(1)\n"
    exec(compile(code, str(SOURCE / "chars.py"), "exec"), namespace)
    with pytest.raises(AssertionError, match=r"chars\.py:2 torch\.arange"):
        with tensors_need_a_device():
            namespace["token_positions"](torch.tensor([1, 2], device="cpu"), 3)
    fixed = "def token_positions(lengths, n):\n    return torch.arange(n, device=lengths.device) < lengths.unsqueeze(1)\n"
    exec(compile(fixed, str(SOURCE / "chars.py"), "exec"), namespace)
    with tensors_need_a_device():
        assert namespace["token_positions"](torch.tensor([1, 2], device="cpu"), 3).tolist() == [
            [True, False, False], [True, True, False]]


# ---------------------------------------------------------------------------------------------
# The paths, on this machine's CPU
# ---------------------------------------------------------------------------------------------
def test_elmo_and_hub_elmo(tiny_model):
    ids = batch_to_ids(SENTENCES)
    with tensors_need_a_device():
        elmo = Elmo(module=tiny_model, num_output_representations=2, dropout=0.0, device="cpu")
        out = elmo(ids)
        sum(rep.sum() for rep in out["elmo_representations"]).backward()  # the mixes' gradients
        stateful = Elmo(module=tiny_model, dropout=0.0, stateful=True)
        stateful(ids), stateful(ids[:2])
        cached = Elmo(module=tiny_model, dropout=0.0, vocab_to_cache=["<pad>", "the", "cat", "sat"])
        cached(word_inputs=torch.tensor([[1, 2, 3], [3, 0, 0]], device="cpu"))
        hub = HubElmo(module=tiny_model, device="cpu")
        hub(SENTENCES), hub(ids)
        tuned = Elmo(module=tiny_model, dropout=0.0, requires_grad=True)
        tuned(ids)["elmo_representations"][0].sum().backward()
        low = Elmo(module=tiny_model, dropout=0.0, dtype=torch.bfloat16)
        low(ids)
    assert tiny_model.token_encoder.projection.weight.grad is not None


def test_embedder(tiny_model):
    with tensors_need_a_device():
        for cache in (True, False):
            embedder = ElmoEmbedder(module=tiny_model, cache_tokens=cache, device="cpu")
            embedder.embed_batch(SENTENCES)
            list(embedder.embed_sentences(SENTENCES * 3, batch_size=2))
        stateful = ElmoEmbedder(module=tiny_model, stateful=True)
        stateful.embed_batch(SENTENCES), stateful.embed_batch(SENTENCES[:2])
        low = ElmoEmbedder(module=tiny_model, dtype=torch.bfloat16)
        low.embed_batch(SENTENCES), list(low.embed_sentences(SENTENCES, batch_size=2))


def test_embed_and_similar_commands(model_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat .\n\na cat ran\nthe dog sat\n", encoding="utf-8")
    with tensors_need_a_device():
        assert main(["embed", str(corpus), str(tmp_path / "out.h5"), "--model", str(model_dir), "--device", "cpu",
                     "--quiet"]) == 0
        assert main(["embed", str(corpus), str(tmp_path / "low.h5"), "--model", str(model_dir), "--dtype",
                     "bfloat16", "--quiet", "--max-length", "4", "--overlap", "1"]) == 0
        assert main(["similar", str(corpus), "--query", "a cat sat", "--word", "cat", "--model", str(model_dir),
                     "--device", "cpu", "--plot", str(tmp_path / "cat.png")]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("finetune", [False, True])
def test_task_train_eval_predict(tiny_model, tmp_path, capsys, finetune):
    save_pretrained(tiny_model, tmp_path / "model")
    files = {split: write_columns(tmp_path / f"{split}.tsv", synthetic_tagging(n, seed))
             for split, n, seed in (("train", 24, 0), ("dev", 8, 1))}
    run = tmp_path / "run"
    options = ["--max-epochs", "1", "--batch-size", "8", "--word-dim", "4", "--hidden-dim", "4", "--no-progress"]
    with tensors_need_a_device():
        assert main(["task", "train", "--task", "pos", "--train", str(files["train"]), "--dev", str(files["dev"]),
                     "--model", str(tmp_path / "model"), "--out", str(run), "--device", "cpu", *options,
                     *(["--finetune"] if finetune else ["--bilm-dtype", "bfloat16"])]) == 0
        assert main(["task", "eval", str(run), str(files["dev"]), "--json", "--no-progress", "--device", "cpu"]) == 0
        assert main(["task", "predict", str(run), str(files["dev"]), "-o", str(tmp_path / "pred.tsv"),
                     "--no-progress", "--device", "cpu"]) == 0
    capsys.readouterr()


def write_lm_inputs(tmp_path):
    """train.txt (40 lines), valid.txt (10 lines), vocab.txt and a tiny model.json in tmp_path."""
    from tests.test_train import WORDS, tiny_config

    rng = np.random.default_rng(0)
    for name, n_lines in (("train.txt", 40), ("valid.txt", 10)):
        lines = [" ".join(rng.choice(WORDS, rng.integers(1, 8))) for _ in range(n_lines)]
        (tmp_path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["vocab", str(tmp_path / "train.txt"), "-o", str(tmp_path / "vocab.txt")]) == 0
    tiny_config().save(tmp_path / "model.json")


def test_lm_training_and_perplexity(tmp_path, capsys):
    write_lm_inputs(tmp_path)
    run = tmp_path / "run"
    with tensors_need_a_device():
        assert main(["train", "--train", str(tmp_path / "train.txt"), "--valid", str(tmp_path / "valid.txt"),
                     "--vocab", str(tmp_path / "vocab.txt"), "--model", str(tmp_path / "model.json"),
                     "--output-dir", str(run), "--batch-size", "4", "--unroll-steps", "5", "--epochs", "1",
                     "--n-samples", "10", "--threads", "1", "--no-progress", "--device", "cpu"]) == 0
        assert main(["perplexity", str(run), str(tmp_path / "valid.txt"), "--json", "--device", "cpu",
                     "--per-sentence", str(tmp_path / "scores.tsv")]) == 0
    capsys.readouterr()


# ---------------------------------------------------------------------------------------------
# The option
# ---------------------------------------------------------------------------------------------
def test_device_and_dtype_names(monkeypatch):
    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu", cuda_device=-1) == torch.device("cpu")
    assert resolve_device(None, cuda_device=-1) == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("LOCAL_RANK", "1")
    if torch.cuda.device_count() > 1:
        assert resolve_device("cuda") == torch.device("cuda:1")  # torchrun: the process's GPU
    with pytest.raises(ValueError, match="not both"):
        resolve_device("cpu", cuda_device=0)
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("gpu")
    assert resolve_dtype("bfloat16") == torch.bfloat16 and resolve_dtype(None) == torch.float32
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("float16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without a GPU gives")
def test_asking_for_a_gpu_without_one_is_a_clear_error(tiny_model, model_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        ElmoEmbedder(module=tiny_model, cuda_device=0)
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        Elmo(module=tiny_model, device="cuda")
    (tmp_path / "in.txt").write_text("a b\n", encoding="utf-8")
    assert main(["embed", str(tmp_path / "in.txt"), str(tmp_path / "o.h5"), "--model", str(model_dir),
                 "--cuda-device", "0"]) == 2
    assert "torch sees no CUDA GPU" in capsys.readouterr().err
    assert main(["embed", str(tmp_path / "in.txt"), str(tmp_path / "o.h5"), "--model", str(model_dir),
                 "--cuda-device", "-1", "--device", "cpu"]) == 2
    assert "not both" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# On a GPU, when there is one
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_vectors_equal_the_cpu_ones(tiny_model):
    import copy

    ids = batch_to_ids(SENTENCES)
    reference = ElmoEmbedder(module=copy.deepcopy(tiny_model)).embed_batch(SENTENCES)
    for cache in (True, False):
        gpu = ElmoEmbedder(module=copy.deepcopy(tiny_model), cuda_device=0, cache_tokens=cache)
        for got, want in zip(gpu.embed_batch(SENTENCES), reference):
            np.testing.assert_allclose(got, want, atol=1e-4)
        for got, want in zip(gpu.embed_sentences(SENTENCES, batch_size=2), reference):
            np.testing.assert_allclose(got, want, atol=1e-4)
    low = ElmoEmbedder(module=copy.deepcopy(tiny_model), device="cuda", dtype=torch.bfloat16)
    for got, want in zip(low.embed_batch(SENTENCES), reference):
        np.testing.assert_allclose(got, want, atol=0.05)
    cpu_mix = Elmo(module=copy.deepcopy(tiny_model), dropout=0.0, scalar_mix_parameters=[0.0, 1.0, 2.0])(ids)
    gpu_mix = Elmo(module=copy.deepcopy(tiny_model), dropout=0.0, scalar_mix_parameters=[0.0, 1.0, 2.0],
                   device="cuda")(ids)
    assert gpu_mix["elmo_representations"][0].device.type == "cuda"
    torch.testing.assert_close(gpu_mix["elmo_representations"][0].cpu(), cpu_mix["elmo_representations"][0],
                               atol=1e-4, rtol=1e-4)
    hub = HubElmo(module=copy.deepcopy(tiny_model), device="cuda")(SENTENCES)
    assert hub["default"].device.type == "cuda" and hub["sequence_len"].tolist() == [len(s) for s in SENTENCES]


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_commands(tiny_model, model_dir, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat .\n\na cat ran\n", encoding="utf-8")
    for device in ("cpu", "cuda"):
        assert main(["embed", str(corpus), str(tmp_path / f"{device}.h5"), "--model", str(model_dir),
                     "--device", device, "--quiet"]) == 0
    with h5py.File(tmp_path / "cpu.h5") as cpu, h5py.File(tmp_path / "cuda.h5") as gpu:
        for key in ("0", "1", "2"):
            np.testing.assert_allclose(gpu[key][()], cpu[key][()], atol=1e-4)
    assert main(["similar", str(corpus), "--query", "a cat sat", "--word", "cat", "--model", str(model_dir),
                 "--device", "cuda"]) == 0
    files = {split: write_columns(tmp_path / f"{split}.tsv", synthetic_tagging(n, seed))
             for split, n, seed in (("train", 24, 0), ("dev", 8, 1))}
    for finetune in ([], ["--finetune"]):
        run = tmp_path / f"run{len(finetune)}"
        assert main(["task", "train", "--task", "pos", "--train", str(files["train"]), "--dev", str(files["dev"]),
                     "--model", str(model_dir), "--out", str(run), "--device", "cuda", "--max-epochs", "1",
                     "--no-progress", *finetune]) == 0
        assert main(["task", "eval", str(run), str(files["dev"]), "--json", "--device", "cuda", "--no-progress"]) == 0
    capsys.readouterr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_lm_training_and_perplexity(tmp_path, capsys):
    from tests.test_train import WORDS, tiny_config

    rng = np.random.default_rng(0)
    for name, n_lines in (("train.txt", 40), ("valid.txt", 10)):
        lines = [" ".join(rng.choice(WORDS, rng.integers(1, 8))) for _ in range(n_lines)]
        (tmp_path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["vocab", str(tmp_path / "train.txt"), "-o", str(tmp_path / "vocab.txt")]) == 0
    tiny_config().save(tmp_path / "model.json")
    run = tmp_path / "run"
    assert main(["train", "--train", str(tmp_path / "train.txt"), "--valid", str(tmp_path / "valid.txt"),
                 "--vocab", str(tmp_path / "vocab.txt"), "--model", str(tmp_path / "model.json"),
                 "--output-dir", str(run), "--batch-size", "4", "--unroll-steps", "5", "--epochs", "1",
                 "--n-samples", "10", "--no-progress", "--device", "cuda"]) == 0
    capsys.readouterr()
    scores = {}
    for device in ("cpu", "cuda"):
        assert main(["perplexity", str(run), str(tmp_path / "valid.txt"), "--json", "--device", device]) == 0
        scores[device] = json.loads(capsys.readouterr().out)
    assert scores["cuda"]["ppl"] == pytest.approx(scores["cpu"]["ppl"], rel=1e-4)
