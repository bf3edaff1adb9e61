"""The ELMo biLM, in the order text flows through it.

    char ids -> CharCNN -> Highway -> projection  = TokenEncoder (encoder.py: context-free)
             -> forward and backward LSTM stacks   = BiLstm (lstm.py: both directions at once)
             -> L+1 layer outputs                  = BiLM (this file)
             -> gamma * sum_k softmax(s)_k * h_k   = ScalarMix (mix.py, in a task)

Shape notation:
    B  batch size                  T  tokens of the longest sentence
    S  T + 2 (with <S> and </S>)   N  real positions in a batch (all rows, boundaries included)
    W  50 character ids a token    E  char embedding dim
    F  total CNN filters           P  projection dim (one direction's output)
    C  LSTM cell dim               L  LSTM layers
    D  2 directions (0 = forward, 1 = backward)

Stateless by default: every call starts from a zero state unless a state is passed in, and the
final state is returned, so carrying it (as AllenNLP's biLM did) is the caller's explicit choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

import numpy as np

from elmokit.model.chars import BOS_TOKEN, EOS_TOKEN, add_boundaries, batch_to_ids, tokens_to_char_ids
from elmokit.model.config import ElmoConfig
from elmokit.model.encoder import TokenEncoder
from elmokit.model.lstm import BiLstm, LstmState


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


RunLstm = Callable[[torch.Tensor, torch.Tensor, "LstmState | None"], tuple[list[torch.Tensor], "LstmState | None"]]


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

    def extra_repr(self) -> str:
        """The first line of `repr(bilm)`: the shape at a glance, above the module tree."""
        lstm = self.config.lstm
        return (f"{lstm.n_layers} x {lstm.cell_dim} cells -> {lstm.projection_dim}, "
                f"{self.config.n_output_layers} layers of {self.output_dim}, {self.n_parameters:,} parameters")

    @property
    def n_parameters(self) -> int:
        """The weights as the original files count them (the published 13.6M and 93.6M): every
        parameter but the padding row of each embedding table (row 0, zero and never trained)."""
        padding = sum(module.embedding_dim for module in self.modules()
                      if isinstance(module, nn.Embedding) and module.padding_idx is not None)
        return sum(parameter.numel() for parameter in self.parameters()) - padding

    @property
    def output_dim(self) -> int:
        return self.config.output_dim

    def reset_parameters(self) -> None:
        """Initialise as the original training code did (bilm-tf's `_build_word_char_embeddings`,
        and its training script): uniform char embeddings; convolutions uniform in ±0.05 for relu,
        normal with std sqrt(1 / (w E)) for tanh; normal highway and projection weights, carry-gate bias -2;
        Glorot LSTMs."""
        cnn, lstm = self.config.char_cnn, self.config.lstm
        encoder = self.token_encoder
        with torch.no_grad():
            nn.init.uniform_(encoder.char_cnn.char_embedding.weight, -1.0, 1.0)
            encoder.char_cnn.char_embedding.weight[0].zero_()
            for conv, (width, _) in zip(encoder.char_cnn.convolutions, cnn.filters):
                if cnn.activation == "relu":
                    nn.init.uniform_(conv.weight, -0.05, 0.05)
                else:
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

    # -----------------------------------------------------------------------------------------
    # Token ids: the model's own scheme. ELMo's is UTF-8 bytes (`elmokit.model.chars`); a model
    # with a character vocabulary of its own (ELMoForManyLangs) overrides `token_ids`. Every
    # inference path turns tokens into ids through these, never through `chars` directly.
    # -----------------------------------------------------------------------------------------
    def token_ids(self, tokens: list[str]) -> np.ndarray:
        """int64 (N, W) ids of a flat list of tokens (no zero rows; "<S>"/"</S>" are the boundaries)."""
        return tokens_to_char_ids(tokens)

    def batch_ids(self, sentences) -> torch.Tensor:
        """(B, T, W) ids of tokenized sentences, right-padded with zero rows (`batch_to_ids`)."""
        return batch_to_ids(sentences, token_ids=self.token_ids)

    @property
    def boundary_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """The (W,) ids of `<S>` and `</S>`, made once (host-side numpy on strings: under
        `torch.compile` it runs as plain Python, untraced)."""
        cached = self.__dict__.get("_boundary_ids")
        if cached is None:
            token_ids = torch.compiler.disable(self.token_ids) if torch.compiler.is_compiling() else self.token_ids
            cached = self.__dict__["_boundary_ids"] = tuple(token_ids([BOS_TOKEN, EOS_TOKEN]))
        return cached

    def encode_words(self, tokens: list[str]) -> torch.Tensor:
        """The token layer (n, P) of a flat list of token strings, on the model's device."""
        ids = torch.from_numpy(self.token_ids(tokens)).to(next(self.parameters()).device)
        return self.encode_tokens(ids)

    ENCODE_CHUNK = 512  # tokens a convolution pass without gradients (its outputs: 50 x F floats a token)

    def encode_tokens(self, char_ids: torch.Tensor) -> torch.Tensor:
        """Context-free token representations: (..., W) char ids -> (..., P)."""
        flat = char_ids.reshape(-1, char_ids.shape[-1])
        if torch.is_grad_enabled() or len(flat) <= self.ENCODE_CHUNK:
            encoded = self.token_encoder(flat)
        else:  # inference: memory bounded however many tokens
            encoded = torch.cat([self.token_encoder(chunk) for chunk in flat.split(self.ENCODE_CHUNK)])
        return encoded.view(*char_ids.shape[:-1], -1)

    def forward(self, char_ids: torch.Tensor, state: LstmState | None = None,
                run_lstm: RunLstm | None = None) -> BiLMOutput:
        """Every layer of every position, sentence boundaries added.

        Args:
            char_ids: (B, T, W) from `batch_to_ids`, right-padded with all-zero rows.
            state: initial LSTM state for these B rows (a carried state); zeros if None.
            run_lstm: the driver of the LSTM stacks (see `contextualize`); `self.lstm` if None.
        """
        boundary_ids, mask = add_boundaries(char_ids, *self.boundary_ids)  # (B, S, W), (B, S)
        flat_mask = mask.flatten()
        real_positions = flat_mask.nonzero().squeeze(1)  # (N,)
        token_embeddings = self.encode_tokens(boundary_ids.flatten(0, 1)[real_positions])  # (N, P)
        return self.contextualize(token_embeddings, mask, state, run_lstm)

    def contextualize(self, token_embeddings: torch.Tensor, mask: torch.Tensor,
                      state: LstmState | None = None, run_lstm: RunLstm | None = None) -> BiLMOutput:
        """Run the LSTMs on token representations of the real positions.

        Args:
            token_embeddings: (N, P), one row per true entry of `mask`, in row-major order.
            mask: (B, S) bool with boundaries, true on each row's first n+2 positions.
            run_lstm: `(tokens (B, S, P), lengths (B,), state) -> (L layers (B, S, 2P), final state)`,
                the LSTM stacks' driver: `self.lstm` (the step loop) if None; inference passes the
                stateless stream engine (`elmokit.inference.engine.bilm_forward`).
        """
        batch_size, n_positions = mask.shape
        real_positions = mask.flatten().nonzero().squeeze(1)
        tokens = token_embeddings.new_zeros(batch_size * n_positions, token_embeddings.shape[-1])
        tokens = tokens.index_copy(0, real_positions, token_embeddings).view(batch_size, n_positions, -1)
        lstm_layers, state = (run_lstm or self.lstm)(tokens, mask.sum(dim=1), state)
        return BiLMOutput([torch.cat([tokens, tokens], dim=-1), *lstm_layers], mask, state)
