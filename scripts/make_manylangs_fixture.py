"""Make tests/fixtures/manylangs/: small ELMoForManyLangs models written by their own code, and
the vectors their own `Embedder.sents2elmo` gives, for tests/test_manylangs.py.

Their code is not part of elmokit and is never imported by it. Get it with git and point this
script at it (any folder holding their `elmoformanylangs/` package):

    git clone https://github.com/HIT-SCIR/ELMoForManyLangs /tmp/efml   # or: git archive of a mirror
    .venv/bin/python scripts/make_manylangs_fixture.py --efml /tmp/efml
    .venv/bin/python scripts/make_manylangs_fixture.py --check   # elmokit vs the fixture, per output_layer

(The committed fixture was made from their commit b3de5f1, "Bells and whistle for a pypi
release (#88)", with torch 2.13.0 on the CPU.)

What runs, all of it theirs except the random weights:
  1. `python -m elmoformanylangs.biLM train` (their training entry point, `biLM.train()`) on a tiny
     corpus with `--max_epoch 0`: it writes config.json, char.dic and word.dic exactly as for a
     real model and builds its `Model`, then trains nothing.
  2. That `Model` gets seeded random weights (every tensor, biases included, so that a wrong
     forget-gate offset or highway-gate sign shows), and their `Model.save_model` writes
     token_embedder.pkl and encoder.pkl (`torch.save` of the two state dicts). The chars-only
     model is saved in torch's legacy (pre-1.6, non-zip) serialization, as torch 0.4 wrote the
     published models; the other in today's zip format.
  3. For every `output_layer` they offer (-1 average, -2 all, 0, 1, 2), a fresh `Embedder`
     (their LSTM carries its state from one batch to the next) runs `sents2elmo` on the test
     sentences (one batch), and the arrays go to expected.npz as `layer{L}_{i}`.

Compatibility shims for today's Python and torch, applied here at run time (their code is not
edited): a stand-in for the `overrides` decorator their highway module imports (it only checks
method names), when that package is not installed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "manylangs"
OUTPUT_LAYERS = (-1, -2, 0, 1, 2)

# The training corpus: their char.dic / word.dic are built from it (min_count 1). Characters and
# words of the test sentences that are not in it are out of vocabulary.
CORPUS = [
    "今 天 天气 真 好 。",
    "我们 喜欢 学习 ELMo 。",
    "我们 今天 学习 中文 分词 😀",
    "supercalifragilistic 好 x y",
    "天气 好 , 我们 学习 。",
]

# The test sentences: Chinese words, a non-BMP character in the vocabulary (😀), an out-of-vocabulary
# character (𠀀, U+20000) and word, a token longer than max_characters_per_token - 2 (cut to 8
# characters before both lookups) and a one-token sentence. (No empty sentence: their
# sents2elmo fails on one with output_layer=-1, numpy's average of nothing.)
SENTENCES = [
    ["今", "天", "天气", "真", "好"],
    ["我们", "喜欢", "学习", "ELMo", "。"],
    ["未登录", "𠀀字", "x", "😀", "好", "学习", "中文"],
    ["supercalifragilistic", "supercal", "今天"],
    ["好"],
    ["天气", "真", "好", "，", "y", "我们", "分词", "。"],
]


def model_config(word_dim: int) -> dict:
    """Their model config (configs/cnn_50_100_512_4096_sample.json's keys), tiny sizes."""
    return {
        "encoder": {"name": "elmo", "projection_dim": 8, "cell_clip": 1, "proj_clip": 0.5,
                    "dim": 12, "n_layers": 2},
        "token_embedder": {"name": "cnn", "activation": "relu", "filters": [[1, 4], [2, 4], [3, 8]],
                           "n_highway": 2, "word_dim": word_dim, "char_dim": 5,
                           "max_characters_per_token": 10},
        "classifier": {"name": "softmax"},
        "dropout": 0.1,
    }


def install_shims() -> None:
    try:
        import overrides  # noqa: F401
    except ImportError:
        shim = types.ModuleType("overrides")
        shim.overrides = lambda method: method
        sys.modules["overrides"] = shim


def train_and_save(model_dir: Path, word_dim: int, seed: int, legacy: bool) -> None:
    """Steps 1 and 2 of the module docstring, for one model folder."""
    from elmoformanylangs import biLM

    model_dir.mkdir(parents=True)
    (model_dir / "cnn_tiny.json").write_text(json.dumps(model_config(word_dim), indent=1))
    corpus = model_dir.parent / f"{model_dir.name}.raw"
    corpus.write_text("\n".join(CORPUS) + "\n", encoding="utf-8")

    built = []

    original_init, original_argv = biLM.Model.__init__, sys.argv

    def recording_init(self, *args, **kwargs):  # their Model, remembered so its weights can be set and saved
        original_init(self, *args, **kwargs)
        built.append(self)

    biLM.Model.__init__ = recording_init
    # --model . and a relative --config_path: config.json then names the config beside it
    sys.argv = ["biLM", "train", "--train_path", f"../{corpus.name}", "--config_path", "cnn_tiny.json",
                "--model", ".", "--max_epoch", "0", "--min_count", "1", "--gpu", "-1", "--seed", str(seed)]
    cwd = Path.cwd()
    try:
        import os

        os.chdir(model_dir)
        biLM.train()
    finally:
        os.chdir(cwd)
        biLM.Model.__init__, sys.argv = original_init, original_argv
    corpus.unlink()
    (model,) = built

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # values of the size trained weights have
            fan_in = parameter[0].numel() if parameter.dim() > 1 and "emb_layer" not in name else 1
            scale = 0.8 if "emb_layer" in name else (1.0 if name.startswith("encoder") else 0.5) / fan_in ** 0.5
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)

    save = torch.save
    if legacy:
        torch.save = lambda obj, f, *a, **k: save(obj, f, *a, _use_new_zipfile_serialization=False, **k)
    try:
        model.save_model(str(model_dir), False)
    finally:
        torch.save = save


def expected_outputs(model_dir: Path) -> dict[str, np.ndarray]:
    """Step 3: their Embedder's vectors, a fresh Embedder per output layer."""
    from elmoformanylangs import Embedder

    arrays = {}
    for output_layer in OUTPUT_LAYERS:
        embedder = Embedder(str(model_dir), batch_size=64)
        vectors = embedder.sents2elmo(SENTENCES, output_layer=output_layer)
        for index, array in enumerate(vectors):
            arrays[f"layer{output_layer}_{index}"] = np.asarray(array, dtype=np.float32)
    return arrays


def check(fixture: Path) -> None:
    """Print elmokit's largest difference from their vectors, per model and output_layer (no
    need for their code): the parity figure docs/manylangs.md quotes."""
    from elmokit import ElmoEmbedder

    sentences = json.loads((fixture / "sentences.json").read_text(encoding="utf-8"))
    print("| model | " + " | ".join(f"output_layer {layer}" for layer in OUTPUT_LAYERS) + " |")
    print("|---|" + "---:|" * len(OUTPUT_LAYERS))
    for name in ("words", "chars-only"):
        vectors = ElmoEmbedder(str(fixture / name)).embed_batch(sentences)  # (3, n, 2P) each
        shaped = {-1: [v.mean(axis=0) for v in vectors], -2: vectors,
                  **{layer: [v[layer] for v in vectors] for layer in (0, 1, 2)}}
        with np.load(fixture / f"{name}-expected.npz") as expected:
            worst = [max(float(np.abs(ours - expected[f"layer{layer}_{i}"]).max()) for i, ours in enumerate(shaped[layer]))
                     for layer in OUTPUT_LAYERS]
        print(f"| {name} | " + " | ".join(f"{value:.1e}" for value in worst) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--efml", type=Path,
                        help="a checkout of HIT-SCIR/ELMoForManyLangs (the folder holding elmoformanylangs/)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"fixture folder (default: {DEFAULT_OUT})")
    parser.add_argument("--check", action="store_true",
                        help="print elmokit's largest difference from the fixture's vectors instead (no --efml needed)")
    args = parser.parse_args()
    if args.check:
        check(args.out)
        return
    if args.efml is None:
        parser.error("--efml is required to make the fixture")
    if not (args.efml / "elmoformanylangs" / "frontend.py").is_file():
        parser.error(f"--efml {args.efml}: no elmoformanylangs/frontend.py there")
    sys.path.insert(0, str(args.efml.resolve()))
    install_shims()
    import logging

    logging.getLogger("elmoformanylangs").setLevel(logging.WARNING)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.out.parent) as tmp:  # renamed into place when complete
        staging = Path(tmp) / "manylangs"
        staging.mkdir()
        models = {"words": (6, 7, False), "chars-only": (0, 8, True)}  # word_dim, seed, legacy pickles
        for name, (word_dim, seed, legacy) in models.items():
            train_and_save(staging / name, word_dim, seed, legacy)
            arrays = expected_outputs(staging / name)
            np.savez_compressed(staging / f"{name}-expected.npz", **arrays)
            layer1 = np.concatenate([arrays[f"layer1_{i}"] for i in range(len(SENTENCES))])
            clipped = np.isclose(np.abs(layer1), model_config(word_dim)["encoder"]["proj_clip"]).mean()
            print(f"{name}: {len(arrays)} arrays; {clipped:.1%} of layer-1 values at the projection clip")
        (staging / "sentences.json").write_text(json.dumps(SENTENCES, ensure_ascii=False, indent=1) + "\n",
                                                encoding="utf-8")
        if args.out.exists():
            shutil.rmtree(args.out)
        staging.rename(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
