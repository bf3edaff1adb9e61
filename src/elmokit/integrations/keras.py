"""Keras 3: `ElmoEmbedding`, TF-Hub's ELMo as a Keras layer, on Keras' torch backend.

    import os; os.environ["KERAS_BACKEND"] = "torch"     # before keras is imported
    import keras
    from elmokit.integrations.keras import ElmoEmbedding, texts_to_ids

    inputs = keras.Input(shape=(None, 50), dtype="int32")               # char ids (B, T, 50)
    vectors = ElmoEmbedding(model="original", output="default", trainable=True)(inputs)   # (B, 1024)
    outputs = keras.layers.Dense(1, activation="sigmoid")(keras.layers.Dense(256, activation="relu")(vectors))
    classifier = keras.Model(inputs, outputs)
    classifier.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])
    classifier.fit(texts_to_ids(train_texts), train_labels, epochs=1, batch_size=32)

The layer gives what `hub.Module(...)` gives (`elmokit.hub`, the same code): `output` is one of
TF-Hub's names, with its shape and numbers, padding zero:

    word_emb (B, T, P)   lstm_outputs1, lstm_outputs2 (B, T, 2P)
    elmo (B, T, 2P): scaling * sum_j softmax(weights)_j h_j     default (B, 2P): the mean of elmo

Its input is the char ids `texts_to_ids(texts)` makes (TF-Hub's default signature: each text split
on spaces; `tokenize=True` for Moses tokens). `model` is anything `elmokit.load_model` takes: a
published name, a folder (native, TF-Hub module, ELMoForManyLangs is not one: its ids differ), a
TF-Hub handle. `trainable=True` trains the mix's L+1 weights and its scaling (Keras variables,
starting from a TF-Hub module's own `aggregation/*`, else 0 and 1); the biLM stays frozen, as in
google/elmo/2 and 3. A saved `.keras` model holds the layer's config (the model's reference: a
name as given, a local path made absolute) and the mix's variables, not the biLM's weights: loading
it loads the biLM again from its reference. `threads`: torch's CPU threads (default: from the CPUs
this process may use and the other work on them, `elmokit.devices.use_threads`); not saved.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from elmokit.extras import require

BACKEND_ADVICE = ("set KERAS_BACKEND=torch before keras is imported (in the shell, or os.environ['KERAS_BACKEND'] = "
                  "'torch' first thing in the program)")
if "keras" not in sys.modules and os.environ.get("KERAS_BACKEND") != "torch":  # keras would pick TensorFlow
    raise ImportError(f"elmokit.integrations.keras runs on Keras' torch backend: {BACKEND_ADVICE}")
require("keras", "elmokit.integrations.keras")

import keras  # noqa: E402

from elmokit.hub import OUTPUTS, HubElmo, _sentences  # noqa: E402
from elmokit.model.builtin import BUILTIN_MODEL  # noqa: E402
from elmokit.model.chars import MAX_CHARS, batch_to_ids  # noqa: E402
from elmokit.sources.loading import load_with_mix, saved_reference  # noqa: E402
from elmokit.model.manylangs import ManyLangsBiLM  # noqa: E402

__all__ = ["ElmoEmbedding", "texts_to_ids"]

if keras.backend.backend() != "torch":
    raise ImportError(f"elmokit.integrations.keras runs on Keras' torch backend, but keras was imported with "
                      f"{keras.backend.backend()!r}: {BACKEND_ADVICE}")

LAYER_OUTPUTS = tuple(name for name in OUTPUTS if name != "sequence_len")


def texts_to_ids(texts: Sequence[str], tokenize: bool = False, lang: str = "en") -> np.ndarray:
    """The char ids (B, T, 50) int32 of `texts`, T the most tokens of any text: each text split on
    spaces as TF-Hub's default signature splits it, or Moses-tokenized with `tokenize=True`
    (`elmokit.tokenize`, the prepare extra); rows past a text's tokens are 0 (no token)."""
    if isinstance(texts, (str, bytes)):
        raise TypeError("texts_to_ids takes a list of texts, got one string: wrap it in a list")
    sentences = _sentences(list(texts), "default")[0]  # checks every text is a string
    if tokenize:
        from elmokit.tokenizer import tokenize as moses

        sentences = [moses(" ".join(tokens), lang) for tokens in sentences]
    if not sentences:
        return np.zeros((0, 0, MAX_CHARS), dtype=np.int32)
    return batch_to_ids(sentences).numpy().reshape(len(sentences), -1, MAX_CHARS).astype(np.int32)


class _Frozen:
    """Holds the biLM out of Keras' and torch's sight: neither tracks it as weights to train or
    to save (the layer saves the model's reference instead)."""

    def __init__(self, elmo: HubElmo):
        self.elmo = elmo


@keras.saving.register_keras_serializable(package="elmokit")
class ElmoEmbedding(keras.layers.Layer):
    """TF-Hub's ELMo `output` of char ids (B, T, 50) (see the module docstring)."""

    def __init__(self, model: str | Path | None = BUILTIN_MODEL, output: str = "elmo", trainable: bool = False,
                 threads: int | None = None, **kwargs):
        if output not in LAYER_OUTPUTS:
            raise ValueError(f"ElmoEmbedding: output must be one of {', '.join(LAYER_OUTPUTS)} (TF-Hub's names), "
                             f"got {output!r}")
        super().__init__(trainable=trainable, **kwargs)
        self.model = saved_reference(model if model is not None else BUILTIN_MODEL)
        self.output_name = output
        bilm, mix = load_with_mix(self.model)
        if isinstance(bilm, ManyLangsBiLM):
            raise ValueError(f"ElmoEmbedding: {model} is an ELMoForManyLangs model, whose char ids are its own; "
                             "the layer takes ELMo's (texts_to_ids): use elmokit.Elmo or ElmoEmbedder for it")
        self._frozen = _Frozen(HubElmo(module=bilm, threads=threads))
        weights, scaling = mix or ([0.0] * bilm.config.n_output_layers, 1.0)
        self.mix_weights = self.add_weight(name="aggregation_weights", shape=(len(weights),),
                                           initializer=keras.initializers.Constant(weights), trainable=True)
        self.mix_scaling = self.add_weight(name="aggregation_scaling", shape=(),
                                           initializer=keras.initializers.Constant(scaling), trainable=True)
        self.projection_dim = bilm.config.lstm.projection_dim
        self.output_dim = bilm.output_dim

    def call(self, char_ids):
        char_ids = torch.as_tensor(char_ids).long()
        if char_ids.device.type == "meta":  # Keras' symbolic build: the shape is all it needs
            return torch.empty(self.compute_output_shape(tuple(char_ids.shape)), device="meta")
        elmo = self._frozen.elmo
        if next(elmo.bilm.parameters()).device != char_ids.device:
            elmo.to(char_ids.device)
        mixed = self.output_name in ("elmo", "default")  # outputs the mix's variables reach
        with torch.enable_grad() if self.trainable and mixed else torch.no_grad():
            outputs = elmo(char_ids, mix=(self.mix_weights.value, self.mix_scaling.value))
        return outputs[self.output_name]

    def compute_output_shape(self, input_shape):
        batch, tokens = input_shape[0], input_shape[1]
        if self.output_name == "default":
            return (batch, self.output_dim)
        return (batch, tokens, self.projection_dim if self.output_name == "word_emb" else self.output_dim)

    def get_config(self) -> dict:
        config = super().get_config()
        config.update(model=self.model, output=self.output_name)
        return config
