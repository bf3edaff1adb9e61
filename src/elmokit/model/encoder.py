"""The token encoder (spec §5): char ids -> char embedding -> convolutions of several widths,
max-pooled -> highway -> projection. Context-free: one vector a token, any word in any language.

Shape notation: N tokens, W 50 char ids a token, E char embedding dim, F total CNN filters,
P projection dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elmokit.kernels import linear
from elmokit.model.chars import N_CHAR_IDS
from elmokit.model.config import ElmoConfig

_ACTIVATIONS = {"relu": torch.relu, "tanh": torch.tanh}


# ---------------------------------------------------------------------------------------------
# Token encoder: char embedding -> convolutions with max-pool -> highway -> projection
# ---------------------------------------------------------------------------------------------
class CharCNN(nn.Module):
    """Character embedding, one "valid" convolution per filter bank, max over positions.

    Input (N, W) char ids, output (N, F) pooled features after the activation.
    """

    def __init__(self, embedding_dim: int, filters: tuple[tuple[int, int], ...], activation: str):
        super().__init__()
        self.char_embedding = nn.Embedding(N_CHAR_IDS, embedding_dim, padding_idx=0)
        self.convolutions = nn.ModuleList(
            nn.Conv1d(embedding_dim, count, width) for width, count in filters
        )
        self.activation = _ACTIVATIONS[activation]

    CHUNK = 16  # tokens a pass without gradients: their window products stay in cache

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        chars = self.char_embedding(char_ids)  # (N, W, E)
        # each convolution as one matmul over all windows: (n_i, E, w) -> (n_i, w*E), window order
        if torch.is_grad_enabled():  # training: oneDNN's convolution, whose backward is ~2x faster
            channels_first = chars.transpose(1, 2)  # (N, E, W)
            pooled = torch.cat([F.conv1d(channels_first, conv.weight).amax(dim=2) for conv in self.convolutions], -1)
        else:
            kernels = [conv.weight.transpose(1, 2).flatten(1) for conv in self.convolutions]
            pooled = torch.cat([self._max_over_windows(chunk, kernels) for chunk in chars.split(self.CHUNK)])
        bias = torch.cat([conv.bias for conv in self.convolutions])  # max(x + b) = max(x) + b
        dtype = torch.promote_types(pooled.dtype, torch.float32)  # bfloat16 weights: float32 from here on
        return self.activation(pooled.to(dtype) + bias.to(dtype))  # (N, F)

    def _max_over_windows(self, chars: torch.Tensor, kernels: list[torch.Tensor]) -> torch.Tensor:
        n_tokens, n_chars, _ = chars.shape
        pooled = []
        for conv, kernel in zip(self.convolutions, kernels):
            width = conv.kernel_size[0]
            windows = chars.unfold(1, width, 1).transpose(2, 3).reshape(-1, kernel.shape[1])  # (N*(W-w+1), w*E)
            pooled.append(linear(windows, kernel).view(n_tokens, n_chars - width + 1, -1).amax(dim=1))  # (N, n_i)
        return torch.cat(pooled, dim=-1)


class Highway(nn.Module):
    """Highway layers: with carry gate c = sigmoid(x W_c + b_c) and transform t = relu(x W_t + b_t),
    x <- c * t + (1 - c) * x. One Linear per layer computes [transform | carry]."""

    def __init__(self, dim: int, n_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, 2 * dim) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            transform, carry = linear(x, layer.weight, layer.bias).chunk(2, dim=-1)  # (N, F) each
            carry = torch.sigmoid(carry)
            x = carry * torch.relu(transform) + (1 - carry) * x
        return x


class TokenEncoder(nn.Module):
    """The context-free token representation: CharCNN -> Highway -> projection to P.

    Input (N, W) char ids of real tokens, output (N, P).
    """

    def __init__(self, config: ElmoConfig):
        super().__init__()
        cnn = config.char_cnn
        self.char_cnn = CharCNN(cnn.embedding_dim, cnn.filters, cnn.activation)
        self.highway = Highway(cnn.n_filters, cnn.n_highway)
        self.projection = nn.Linear(cnn.n_filters, config.lstm.projection_dim)

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        features = self.highway(self.char_cnn(char_ids))  # (N, F)
        return linear(features, self.projection.weight, self.projection.bias)  # (N, P)
