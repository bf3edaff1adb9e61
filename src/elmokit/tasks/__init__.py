"""ELMo in real tasks: readers of every task format, task models (tagger with char CNN and
optional CRF, sentence classifier), frozen-biLM layer cache, training loop, metrics, layer probes,
and trained runs as tools:

    run = elmokit.tasks.train(task="ner", train="train.conll", dev="dev.conll", out="runs/ner")
    run = elmokit.tasks.load("runs/ner")                     # or a run moved elsewhere (bilm=...)
    run.predict("Peter Smith lives in Paris.", tokenize=True)  # spans, tags and probabilities
    run.evaluate("test.conll")                               # scores, and a table as its str
"""

from elmokit.tasks.classifier import Classifier
from elmokit.tasks.crf import CRF
from elmokit.tasks.encoder import Batch, ContextEncoder
from elmokit.tasks.features import ElmoMixes, cached_layers, compute_layers
from elmokit.tasks.scores import accuracy, bio_spans, span_f1
from elmokit.tasks.readers import (
    DataFormatError,
    read_conll2003,
    read_conllu,
    read_semcor,
    read_sst2_csv,
    read_sst_trees,
)
from elmokit.tasks.results import Evaluation, LabelPrediction, Span, TagPrediction
from elmokit.tasks.run import TaskRun, evaluate_run, load
from elmokit.tasks.schemes import detect_scheme, iob1_to_bio, to_bio
from elmokit.tasks.tagger import Tagger
from elmokit.tasks.task_config import TASKS, TaskConfig
from elmokit.tasks.train import train_task
from elmokit.tasks.api import train_task_model

# `elmokit.tasks.train(...)`: the function, as the README names it (the loop's module stays
# importable as `from elmokit.tasks.train import ...`).
train = train_task_model
