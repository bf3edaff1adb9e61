"""What the tagger and the classifier share: a batch, and the encoder
word vectors [; char CNN] [; ELMo] -> dropout -> BiLSTM -> h [; ELMo].

Shape notation: B batch, T tokens, W characters a word, E word-vector dim, F char CNN filters,
H LSTM hidden dim (one direction), L LSTM layers of the biLM, P its projection dim (ELMo layers
have 2P dims).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from elmokit.model.bilm import BiLM
from elmokit.tasks.charcnn import CharWordEncoder
from elmokit.tasks.features import ElmoMixes, bilm_layers


@dataclass
class Batch:
    """A batch of sentences for a task model.

    word_ids (B, T) long, 0 = padding, 1 = unknown word; mask (B, T) bool, true on real tokens;
    labels (B, T) tag ids (tagger, padding ignored) or (B,) class ids (classifier);
    elmo_layers (B, L+1, T, 2P) cached layers of a frozen biLM, or None;
    sentences: the token strings (the biLM reads them when it is fine-tuned);
    char_ids (B, T, W) long, the task's character ids (0 = padding), for a char CNN, or None.
    """

    word_ids: torch.Tensor
    mask: torch.Tensor
    labels: torch.Tensor
    sentences: list[list[str]]
    elmo_layers: torch.Tensor | None = None
    char_ids: torch.Tensor | None = None


class ContextEncoder(nn.Module):
    """Task word vectors, optionally concatenated with a char CNN's word vectors and with ELMo
    ([x; ELMo]), a 1-layer BiLSTM, and optionally a second ELMo mix concatenated to its output
    ([h; ELMo]).

    Args:
        vocab_size: task word vocabulary, padding (0) and unknown (1) included.
        word_dim, hidden_dim: E and H.
        dropout: on the LSTM input and output.
        n_elmo_layers, elmo_dim: L+1 and 2P of the biLM; 0 for a model without ELMo.
        elmo_at_output: add the [h; ELMo] mix.
        elmo_dropout, elmo_l2: dropout on each mix and lambda of the mix-weight penalty.
        bilm: the biLM itself, only when it is fine-tuned (else layers come with the batch).
        char_encoder: a char CNN whose word vectors join the input (batches then carry char_ids).
    """

    def __init__(self, vocab_size: int, word_dim: int, hidden_dim: int, dropout: float,
                 n_elmo_layers: int = 0, elmo_dim: int = 0, elmo_at_output: bool = False,
                 elmo_dropout: float = 0.5, elmo_l2: float = 0.001, bilm: BiLM | None = None,
                 char_encoder: CharWordEncoder | None = None):
        super().__init__()
        self.word_embedding = nn.Embedding(vocab_size, word_dim, padding_idx=0)
        self.char_encoder = char_encoder
        char_dim = char_encoder.output_dim if char_encoder is not None else 0
        self.use_elmo = n_elmo_layers > 0
        self.elmo_at_output = self.use_elmo and elmo_at_output
        self.elmo = (ElmoMixes(n_elmo_layers, 1 + self.elmo_at_output, elmo_dropout, elmo_l2)
                     if self.use_elmo else None)
        self.bilm = bilm
        self.dropout = nn.Dropout(dropout)
        self.lstm = nn.LSTM(word_dim + char_dim + (elmo_dim if self.use_elmo else 0), hidden_dim,
                            batch_first=True, bidirectional=True)
        self.output_dim = 2 * hidden_dim + (elmo_dim if self.elmo_at_output else 0)

    def forward(self, batch: Batch) -> torch.Tensor:
        """-> (B, T, output_dim), zero at padding."""
        inputs = self.word_embedding(batch.word_ids)  # (B, T, E)
        if self.char_encoder is not None:
            if batch.char_ids is None:
                raise ValueError("this model has a char CNN: the batch needs char_ids")
            inputs = torch.cat([inputs, self.char_encoder(batch.char_ids)], dim=-1)  # (B, T, E + F)
        mixed = []
        if self.use_elmo:
            layers = batch.elmo_layers if self.bilm is None else bilm_layers(self.bilm, batch.sentences)
            if layers is None:
                raise ValueError("this model uses ELMo: the batch needs elmo_layers (or a fine-tuned bilm)")
            mixed = self.elmo(layers.to(inputs.dtype), batch.mask)  # M of (B, T, 2P)
            inputs = torch.cat([inputs, mixed[0]], dim=-1)  # (B, T, E [+ F] + 2P)
        lengths = batch.mask.sum(dim=1).cpu()
        packed = pack_padded_sequence(self.dropout(inputs), lengths, batch_first=True, enforce_sorted=False)
        hidden, _ = pad_packed_sequence(self.lstm(packed)[0], batch_first=True,
                                        total_length=batch.word_ids.shape[1])  # (B, T, 2H)
        hidden = self.dropout(hidden)
        if self.elmo_at_output:
            hidden = torch.cat([hidden, mixed[1]], dim=-1)  # (B, T, 2H + 2P)
        return hidden

    def penalty(self) -> torch.Tensor:
        """The mix-weight L2 penalty (0 without ELMo)."""
        return self.elmo.penalty() if self.elmo is not None else self.word_embedding.weight.new_zeros(())

    def layer_weights(self) -> list[list[float]]:
        return self.elmo.layer_weights() if self.elmo is not None else []
