"""elmokit: train ELMo on your own corpus and serve its contextual word vectors."""

from elmokit.model.chars import batch_to_ids
from elmokit.tokenizer import tokenize
from elmokit.model.config import CharCNNConfig, ConfigError, ElmoConfig, LSTMConfig
from elmokit.inference.cache import TokenCache
from elmokit.inference.elmo import Elmo
from elmokit.inference.embedder import ElmoEmbedder
from elmokit.inference.onnx_export import export_onnx
from elmokit.inference.segments import iter_embeddings, read_embeddings
from elmokit.model.bilm import BiLM, BiLMOutput, LstmState
from elmokit.model.mix import ScalarMix
from elmokit.sources.loading import load_model
from elmokit.model.weights import (
    WeightFileError,
    load_original,
    load_pretrained,
    save_original,
    save_pretrained,
)

from elmokit import hub  # noqa: E402  (TF-Hub's interface: `from elmokit import hub`)
from elmokit.hub import HubElmo  # noqa: E402

__version__ = "0.1.0"
