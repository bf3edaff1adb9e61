"""ELMo for a task model: the biLM's layers (cached once per sentence when the biLM is frozen, or
computed on the fly when it is fine-tuned) and the task's own trainable scalar mixes.

Shape notation: B batch, T tokens, n tokens of one sentence, L LSTM layers, P projection dim
(every layer has 2P dims), M number of mixes.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from elmokit.devices import dtype_name, resolve_dtype
from elmokit.inference.elmo import module_device, token_layers
from elmokit.inference.embedder import ElmoEmbedder
from elmokit.io import atomic_path
from elmokit.model.bilm import BiLM
from elmokit.model.mix import ScalarMix
from elmokit.model.weights import model_fingerprint
from elmokit.progress import progress_bar


# ---------------------------------------------------------------------------------------------
# Frozen biLM: every sentence's layers computed once
# ---------------------------------------------------------------------------------------------
def compute_layers(bilm: BiLM, sentences: Sequence[Sequence[str]], batch_size: int | None = None,
                   dtype: torch.dtype = torch.float16, progress: bool = True, desc: str = "ELMo layers",
                   device: str | torch.device | None = None, bilm_dtype: str | torch.dtype | None = None
                   ) -> list[torch.Tensor]:
    """The (L+1, n, 2P) layers of each sentence from a frozen biLM, stored (on the CPU) as `dtype`.

    The sentences stream through `batch_size` rows of the recurrence (`ElmoEmbedder.embed_sentences`;
    None: the engine's choice): exact whatever the batching, since the biLM is stateless. The biLM
    runs on `device` (default: where it is; it is moved there) with its products in `bilm_dtype`
    (default float32; bfloat16 runs a converted copy, the biLM itself is left as it is).
    """
    bilm_dtype = resolve_dtype(bilm_dtype)
    if bilm_dtype != bilm.lstm.layers[0].input_weight.dtype:
        bilm = copy.deepcopy(bilm)
    embedder = ElmoEmbedder(module=bilm, device=device if device is not None else module_device(bilm),
                            dtype=bilm_dtype)
    layers: list[torch.Tensor] = []
    bar = progress_bar(total=len(sentences), desc=desc, unit="sent", enabled=progress, leave=False)
    for array in embedder.embed_sentences(sentences, batch_size):  # windows of POSITION_BUDGET positions at most
        layers.append(torch.from_numpy(array).to(dtype))
        bar.update(1)
    bar.close()
    return layers


def sentences_fingerprint(sentences: Sequence[Sequence[str]]) -> str:
    digest = hashlib.sha1()
    for sentence in sentences:
        digest.update("\u0001".join(sentence).encode())
        digest.update(b"\x00")
    return digest.hexdigest()[:16]


def cached_layers(bilm: BiLM, sentences: Sequence[Sequence[str]], cache_dir: str | Path | None = None,
                  model_key: str | None = None, progress: bool = True, desc: str = "ELMo layers",
                  device: str | torch.device | None = None, bilm_dtype: str | torch.dtype | None = None
                  ) -> list[torch.Tensor]:
    """`compute_layers`, reusing `cache_dir/<model>[-bfloat16]-<sentences>.safetensors` when
    present (fp16, written atomically), so that several seeds and runs share one pass of the biLM."""
    if cache_dir is None:
        return compute_layers(bilm, sentences, progress=progress, desc=desc, device=device, bilm_dtype=bilm_dtype)
    model_key = model_key or model_fingerprint(bilm)[:16]
    if resolve_dtype(bilm_dtype) != torch.float32:
        model_key = f"{model_key}-{dtype_name(resolve_dtype(bilm_dtype))}"
    path = Path(cache_dir) / f"{model_key}-{sentences_fingerprint(sentences)}.safetensors"
    if path.is_file():
        with safe_open(str(path), framework="pt") as file:
            flat, lengths = file.get_tensor("layers"), file.get_tensor("lengths")  # (N, L+1, 2P), (S,)
        return [chunk.transpose(0, 1) for chunk in torch.split(flat, lengths.tolist())]
    layers = compute_layers(bilm, sentences, progress=progress, desc=desc, device=device, bilm_dtype=bilm_dtype)
    flat = torch.cat([layer.transpose(0, 1) for layer in layers]).contiguous()  # (N, L+1, 2P)
    lengths = torch.tensor([layer.shape[1] for layer in layers], dtype=torch.int64, device="cpu")
    with atomic_path(path) as tmp:
        save_file({"layers": flat, "lengths": lengths}, str(tmp))
    return layers


def pad_layers(layers: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sentences' (L+1, n_i, 2P) layers -> (B, L+1, T, 2P) float32, zero past each sentence."""
    n_layers, _, dim = layers[0].shape
    batch = torch.zeros(len(layers), n_layers, max(layer.shape[1] for layer in layers), dim, device=layers[0].device)
    for row, layer in enumerate(layers):
        batch[row, :, :layer.shape[1]] = layer
    return batch


def bilm_layers(bilm: BiLM, sentences: Sequence[Sequence[str]]) -> torch.Tensor:
    """Run the biLM with gradients (fine-tuning): (B, L+1, T, 2P) without <S> and </S>."""
    char_ids = bilm.batch_ids(sentences).to(next(bilm.parameters()).device)
    return token_layers(bilm(char_ids))


# ---------------------------------------------------------------------------------------------
# The task's mixes
# ---------------------------------------------------------------------------------------------
class ElmoMixes(nn.Module):
    """M independent scalar mixes of the L+1 layers, each followed by dropout (Peters et al. 2018 §3.3).

    `penalty()` is lambda * sum_m ||s_m||^2 over the raw (pre-softmax) layer weights s: a large lambda
    pulls the mix towards the plain average, a small one (the paper's 0.001) lets the weights vary.
    """

    def __init__(self, n_layers: int, n_mixes: int, dropout: float = 0.5, l2: float = 0.001,
                 do_layer_norm: bool = False):
        super().__init__()
        self.mixes = nn.ModuleList(ScalarMix(n_layers, do_layer_norm) for _ in range(n_mixes))
        self.dropout = nn.Dropout(dropout)
        self.l2 = l2

    def forward(self, layers: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        """layers (B, L+1, T, 2P), mask (B, T) bool -> M tensors (B, T, 2P), zero at padding."""
        per_layer = list(layers.unbind(dim=1))  # L+1 of (B, T, 2P)
        keep = mask.unsqueeze(-1).to(layers.dtype)  # (B, T, 1)
        return [self.dropout(mix(per_layer, mask)) * keep for mix in self.mixes]

    def penalty(self) -> torch.Tensor:
        return self.l2 * sum((mix.scalar_parameters ** 2).sum() for mix in self.mixes)

    def layer_weights(self) -> list[list[float]]:
        """softmax(s) of each mix, for reports and plots."""
        return [torch.softmax(mix.scalar_parameters.detach(), 0).tolist() for mix in self.mixes]
