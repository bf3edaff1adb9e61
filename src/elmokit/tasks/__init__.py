"""ELMo in real tasks: readers, task models (tagger with optional CRF, sentence classifier),
frozen-biLM layer cache, training loop, metrics and layer probes."""

from elmokit.tasks.classifier import Classifier
from elmokit.tasks.crf import CRF
from elmokit.tasks.encoder import Batch, ContextEncoder
from elmokit.tasks.features import ElmoMixes, cached_layers, compute_layers
from elmokit.tasks.metrics import accuracy, bio_spans, span_f1
from elmokit.tasks.readers import (
    DataFormatError,
    iob1_to_bio,
    read_conll2003,
    read_conllu,
    read_semcor,
    read_sst2_csv,
    read_sst_trees,
)
from elmokit.tasks.tagger import Tagger
from elmokit.tasks.train import TASKS, TaskConfig, evaluate_run, train_task
