"""The ELMo biLM, in the order text flows through it (spec §4-§8).

    char ids -> CharCNN -> Highway -> projection  = TokenEncoder (context-free, one vector a token)
             -> forward and backward LSTM stacks   = BiLstm (lstm.py: both directions at once)
             -> L+1 layer outputs                  = BiLM
             -> gamma * sum_k softmax(s)_k * h_k   = ScalarMix (in a task)

Shape notation:
    B  batch size                  T  tokens of the longest sentence
    S  T + 2 (with <S> and </S>)   N  real positions in a batch (all rows, boundaries included)
    W  50 character ids a token    E  char embedding dim
    F  total CNN filters           P  projection dim (one direction's output)
    C  LSTM cell dim               L  LSTM layers
    D  2 directions (0 = forward, 1 = backward)

Stateless by default: every call starts from a zero state unless a state is passed in, and the
final state is returned, so carrying it (spec §9) is the caller's explicit choice.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from elmokit.model.chars import MAX_CHARS, N_CHAR_IDS, add_boundaries
from elmokit.model.config import ElmoConfig
from elmokit.kernels import linear
from elmokit.model.lstm import BiLstm, LstmState

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


# ---------------------------------------------------------------------------------------------
# The biLM: token layer + LSTM layers, with sentence boundaries
# ---------------------------------------------------------------------------------------------
class BiLMOutput(NamedTuple):
    """layers: L+1 tensors (B, S, 2P), boundaries included, zero at padding (layer 0 is the
    token representation twice); mask: (B, S) bool, true on `<S>`, the tokens and `</S>`;
    state: the final LSTM state, to pass to the next call for the original stateful behaviour
    (None for a biLM in bfloat16, which runs stateless)."""

    layers: list[torch.Tensor]
    mask: torch.Tensor
    state: LstmState | None


class BiLM(nn.Module):
    """The ELMo bidirectional language model, built fresh from a config (no loading here).

    Use `elmokit.load_model` / `elmokit.model.weights` to fill it from the original HDF5 files or from
    the native `config.json` + `model.safetensors`.

    Reduced precision, for inference: `bilm.to(torch.bfloat16)` stores the weights in bfloat16;
    every product then runs in bfloat16 while the activations, the LSTM's cell and recurrent state
    and the outputs stay float32 (stateless, no gradients). `Elmo` / `ElmoEmbedder(dtype=...)` do this.
    """

    def __init__(self, config: ElmoConfig, dropout: float = 0.0):
        super().__init__()
        self.config = config
        self.token_encoder = TokenEncoder(config)
        self.lstm = BiLstm(config, dropout)
        self.reset_parameters()

    @property
    def output_dim(self) -> int:
        return self.config.output_dim

    def reset_parameters(self) -> None:
        """Initialise as the original training code did (spec §13): uniform char embeddings,
        scaled normal convolutions and highway weights, carry-gate bias -2, Glorot LSTMs."""
        cnn, lstm = self.config.char_cnn, self.config.lstm
        encoder = self.token_encoder
        with torch.no_grad():
            nn.init.uniform_(encoder.char_cnn.char_embedding.weight, -1.0, 1.0)
            encoder.char_cnn.char_embedding.weight[0].zero_()
            for conv, (width, _) in zip(encoder.char_cnn.convolutions, cnn.filters):
                nn.init.normal_(conv.weight, 0.0, math.sqrt(1.0 / (width * cnn.embedding_dim)))
                nn.init.zeros_(conv.bias)
            n_filters = cnn.n_filters
            for layer in encoder.highway.layers:
                nn.init.normal_(layer.weight, 0.0, math.sqrt(1.0 / n_filters))
                nn.init.zeros_(layer.bias)
                layer.bias[n_filters:] = -2.0  # carry gate starts mostly closed
            nn.init.normal_(encoder.projection.weight, 0.0, math.sqrt(1.0 / n_filters))
            nn.init.zeros_(encoder.projection.bias)
            for layer in self.lstm.layers:
                for weight in (layer.input_weight, layer.recurrent_weight):
                    bound = math.sqrt(6.0 / (2 * lstm.projection_dim + 4 * lstm.cell_dim))
                    nn.init.uniform_(weight, -bound, bound)
                bound = math.sqrt(6.0 / (lstm.cell_dim + lstm.projection_dim))
                nn.init.uniform_(layer.projection, -bound, bound)
                layer.bias.zero_()  # the forget gate gets +1 at run time

    ENCODE_CHUNK = 512  # tokens a convolution pass without gradients (its outputs: 50 x F floats a token)

    def encode_tokens(self, char_ids: torch.Tensor) -> torch.Tensor:
        """Context-free token representations: (..., W) char ids -> (..., P)."""
        flat = char_ids.reshape(-1, MAX_CHARS)
        if torch.is_grad_enabled() or len(flat) <= self.ENCODE_CHUNK:
            encoded = self.token_encoder(flat)
        else:  # inference: memory bounded however many tokens
            encoded = torch.cat([self.token_encoder(chunk) for chunk in flat.split(self.ENCODE_CHUNK)])
        return encoded.view(*char_ids.shape[:-1], -1)

    def forward(self, char_ids: torch.Tensor, state: LstmState | None = None) -> BiLMOutput:
        """Every layer of every position, sentence boundaries added.

        Args:
            char_ids: (B, T, W) from `batch_to_ids`, right-padded with all-zero rows.
            state: initial LSTM state for these B rows (spec §9); zeros if None.
        """
        boundary_ids, mask = add_boundaries(char_ids)  # (B, S, W), (B, S)
        flat_mask = mask.flatten()
        real_positions = flat_mask.nonzero().squeeze(1)  # (N,)
        token_embeddings = self.encode_tokens(boundary_ids.flatten(0, 1)[real_positions])  # (N, P)
        return self.contextualize(token_embeddings, mask, state)

    def contextualize(self, token_embeddings: torch.Tensor, mask: torch.Tensor,
                      state: LstmState | None = None) -> BiLMOutput:
        """Run the LSTMs on token representations of the real positions.

        Args:
            token_embeddings: (N, P), one row per true entry of `mask`, in row-major order.
            mask: (B, S) bool with boundaries, true on each row's first n+2 positions.
        """
        batch_size, n_positions = mask.shape
        real_positions = mask.flatten().nonzero().squeeze(1)
        tokens = token_embeddings.new_zeros(batch_size * n_positions, token_embeddings.shape[-1])
        tokens = tokens.index_copy(0, real_positions, token_embeddings).view(batch_size, n_positions, -1)
        lstm_layers, state = self.lstm(tokens, mask.sum(dim=1), state)
        return BiLMOutput([torch.cat([tokens, tokens], dim=-1), *lstm_layers], mask, state)


# ---------------------------------------------------------------------------------------------
# Scalar mix: what a task learns on top of the layers
# ---------------------------------------------------------------------------------------------
class ScalarMix(nn.Module):
    """mix = gamma * sum_k softmax(w)_k * h_k over the L+1 layers (spec §8).

    With `do_layer_norm`, each layer is first normalised with one mean and one variance over all
    unmasked elements of the batch. `initial_scalar_parameters` given with `trainable=False`
    freezes w and gamma (= 1), as AllenNLP's `scalar_mix_parameters` does.
    """

    def __init__(self, n_layers: int, do_layer_norm: bool = False,
                 initial_scalar_parameters: list[float] | None = None, trainable: bool = True):
        super().__init__()
        initial = initial_scalar_parameters or [0.0] * n_layers
        if len(initial) != n_layers:
            raise ValueError(f"scalar_mix_parameters must have {n_layers} values "
                             f"(one per layer), got {len(initial)}: {initial}")
        self.do_layer_norm = do_layer_norm
        self.scalar_parameters = nn.Parameter(torch.tensor(initial, dtype=torch.float32),
                                              requires_grad=trainable)
        self.gamma = nn.Parameter(torch.tensor(1.0), requires_grad=trainable)

    def forward(self, layers: list[torch.Tensor], mask: torch.Tensor | None = None) -> torch.Tensor:
        """layers: L+1 tensors (B, S, D); mask (B, S) bool, needed for the layer norm."""
        if len(layers) != self.scalar_parameters.numel():
            raise ValueError(f"ScalarMix expects {self.scalar_parameters.numel()} layers, got {len(layers)}")
        weights = torch.softmax(self.scalar_parameters, dim=0)
        if self.do_layer_norm:
            if mask is None:
                raise ValueError("ScalarMix(do_layer_norm=True) needs the mask")
            layers = [_masked_layer_norm(layer, mask) for layer in layers]
        mixed = sum(weight * layer for weight, layer in zip(weights, layers))
        return self.gamma * mixed


def _masked_layer_norm(layer: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One scalar mean and variance over every unmasked element of the batch."""
    mask = mask.unsqueeze(-1).to(layer.dtype)  # (B, S, 1)
    count = mask.sum() * layer.shape[-1]
    masked = layer * mask
    mean = masked.sum() / count
    variance = (((masked - mean) * mask) ** 2).sum() / count
    return (layer - mean) / torch.sqrt(variance + 1e-13)
