"""elmokit: train ELMo on your own corpus and serve its contextual word vectors."""

from elmokit.chars import batch_to_ids
from elmokit.config import CharCNNConfig, ConfigError, ElmoConfig, LSTMConfig
from elmokit.elmo import Elmo, ElmoEmbedder, HubElmo, TokenCache
from elmokit.embedding import iter_embeddings, read_embeddings
from elmokit.model import BiLM, BiLMOutput, LstmState, ScalarMix
from elmokit.weights import (
    WeightFileError,
    load_model,
    load_original,
    load_pretrained,
    save_original,
    save_pretrained,
)

__version__ = "0.1.0"
