"""Embed a corpus on Ray Data (the `ray` extra): `embed_dataset` adds ELMo's tokens and vectors
to a `ray.data.Dataset`, and `embed_files` is `elmo embed --ray`: text or Parquet files in, a
folder of Parquet files out.

    >>> import ray, elmokit.ray
    >>> ds = ray.data.read_parquet("s3://bucket/corpus/")              # a `text` column
    >>> ds = elmokit.ray.embed_dataset(ds, model="small", layers="average", concurrency=8)
    >>> ds.write_parquet("s3://bucket/vectors/")

Each of `concurrency` actors (`map_batches` with the callable class `SentenceEmbedder`) loads the
model once, on a GPU of its own with `num_gpus=1`, and embeds batches of rows into two new
columns, every other column kept:

    tokens     list<string>   the tokens embedded (whitespace-split, or Moses with tokenize=True)
    embedding  float32 nested lists: what `elmo embed` writes for a sentence (`layers.shape_output`:
               (L+1, T, D) "all", (T, D) "top"/"average", (L+1, D) or (D,) with sentence_vectors),
               the column type of `elmo embed OUTPUT.parquet` (`elmokit.inference.parquet`)

The vectors are stateless: a row's embedding depends on its own sentence only, never on the rows
it is batched with, so any partitioning, batch size or number of actors gives the same numbers
(to float32 rounding: products of other shapes round differently, within 1e-6). An actor that
dies (a lost node, the OOM killer) is restarted up to `ACTOR_RESTARTS` times and its batch
retried; Ray Data keeps each batch's output once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elmokit.extras import require
from elmokit.inference.embedder import ElmoEmbedder
from elmokit.inference.files import EmbedOptions, check_windows, embed_sentences, make_tokenizer
from elmokit.inference.layers import check_output_format, shape_output
from elmokit.inference.parquet import embedding_array, embedding_type, is_parquet
from elmokit.io import check_replaceable_folder, output_lock, refuse_output_over_input
from elmokit.model.bilm import BiLM
from elmokit.sources.loading import load_model

log = logging.getLogger(__name__)

ACTOR_RESTARTS = 3  # a dead actor is restarted, and its batch retried, this many times
FORWARD_ROWS = 64  # rows of the recurrence inside an actor: a Ray batch of 256 lines keeps ~4 sentences a stream
BATCH_ROWS = 256  # embed_dataset's default batch_size: rows an actor embeds in one call
ROWS_PER_BLOCK = 256  # rows of each table a read task yields (Ray merges them into its blocks, and splits a
# small input's into several so that every actor gets some)
READ_TASKS = 4  # read tasks at once, each streaming its files (their tasks take no CPU of the actors')
ADDED_COLUMNS = ("tokens", "embedding")
CONNECT_TIMEOUT_S = 10  # `connect`: seconds a cluster's address has to accept a connection


def _ray() -> Any:
    require("ray", "elmokit.ray (embedding on Ray Data)")
    import ray

    return ray


class SentenceEmbedder:
    """The callable class of `embed_dataset`'s `map_batches`: one model per actor, loaded once.

    Args:
        model: a `BiLM`, or what `elmokit.load_model` takes (a directory, a published name; None:
            the built-in English model); a path must be readable on every node.
        text_column: the column of sentences (str) to embed.
        tokenize: Moses-tokenize each sentence (the `prepare` extra) instead of splitting on whitespace.
        layers: "all", "top" or "average" (`layers.select_layers`).
        sentence_vectors: one vector a row, the mean over its tokens, instead of one a token.
        device: where the actor runs the model ("cpu", "cuda": the GPU Ray gave it).
        dtype: None (float32, exact) or "bfloat16" (see `ElmoEmbedder`).
        threads: torch's CPU threads in this actor (its share of the node's cores).
        max_length, overlap: the windows of long sentences (`embed_dataset`).
        forward_rows: sentences in the recurrence at once (`elmo embed --batch-size`'s meaning).
    """

    def __init__(self, model: BiLM | str | Path | None, text_column: str, tokenize: bool, lang: str, layers: str,
                 sentence_vectors: bool, device: str, dtype: str | None, threads: int,
                 max_length: int = EmbedOptions.max_length, overlap: int = EmbedOptions.overlap,
                 forward_rows: int = FORWARD_ROWS):
        if device == "cpu":
            torch.set_num_threads(threads)
        module = model if isinstance(model, BiLM) else load_model(model)
        self.embedder = ElmoEmbedder(module=module, device=device, dtype=dtype)
        self.tokenize = make_tokenizer(tokenize, lang)
        self.text_column, self.layers, self.sentence_vectors = text_column, layers, sentence_vectors
        self.max_length, self.overlap, self.forward_rows = max_length, overlap, forward_rows
        config = self.embedder.bilm.config
        empty = shape_output(np.zeros((config.n_output_layers, 0, self.embedder.output_dim), np.float32),
                             layers, sentence_vectors)  # a sentence without tokens: its number of axes
        self.embedding_type = embedding_type(empty.ndim, self.embedder.output_dim)

    def __call__(self, batch: Any) -> Any:
        """A pyarrow Table of rows -> the same rows with `tokens` and `embedding` appended."""
        import pyarrow as pa

        for name in ADDED_COLUMNS:
            if name in batch.column_names:
                raise ValueError(f"the dataset already has a column {name!r}, which embed_dataset adds: "
                                 "rename or drop it first")
        if self.text_column not in batch.column_names:
            raise KeyError(f"no column {self.text_column!r} to embed (text_column); the dataset has "
                           f"{', '.join(batch.column_names)}")
        texts = batch.column(self.text_column).to_pylist()
        wrong = next((text for text in texts if not isinstance(text, str)), "")
        if not isinstance(wrong, str):
            raise TypeError(f"column {self.text_column!r} must hold strings; a row holds {wrong!r}")
        token_lists = [self.tokenize(text) for text in texts]
        arrays = [shape_output(layers, self.layers, self.sentence_vectors)
                  for layers in embed_sentences(self.embedder, token_lists, self.forward_rows, self.max_length,
                                                self.overlap)]
        embedding = embedding_array(arrays) if arrays else pa.array([], type=self.embedding_type)
        return (batch.append_column("tokens", pa.array(token_lists, type=pa.list_(pa.string())))
                .append_column("embedding", embedding))


def embed_dataset(ds: Any, *, model: BiLM | str | Path | None = None, text_column: str = "text",
                  tokenize: bool = False, lang: str = "en", layers: str = "all", sentence_vectors: bool = False,
                  batch_size: int = BATCH_ROWS, concurrency: int = 1, num_gpus: float = 0, num_cpus: float = 1,
                  dtype: str | None = None, max_length: int = EmbedOptions.max_length,
                  overlap: int = EmbedOptions.overlap, forward_rows: int = FORWARD_ROWS) -> Any:
    """`ds` with the columns `tokens` and `embedding` added to every row (see the module docstring).

    Args:
        ds: a `ray.data.Dataset` with a column `text_column` of sentences (str).
        model, text_column, tokenize, lang, layers, sentence_vectors, dtype: see `SentenceEmbedder`.
        batch_size: rows an actor embeds in one call (Ray's batch; the forward passes within it run
            `forward_rows` sentences at a time).
        concurrency: actors, each with its own copy of the model.
        num_gpus: GPUs per actor (1: each actor runs its model on a GPU of its own; 0: the CPU).
        num_cpus: CPU cores per actor (torch's threads in it).
        max_length, overlap: a sentence longer than `max_length` tokens is embedded in windows that
            overlap by `overlap` tokens, stitched back (as `elmo embed --max-length --overlap`).
        forward_rows: sentences in the recurrence at once (at most `batch_size` fill it), as
            `elmo embed --batch-size` with or without --ray.

    Returns:
        A lazy `ray.data.Dataset`: nothing runs until it is written or iterated.
    """
    ray = _ray()
    check_output_format(layers)
    for name, value in (("batch_size", batch_size), ("concurrency", concurrency), ("forward_rows", forward_rows)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if num_gpus < 0 or num_cpus <= 0:
        raise ValueError(f"num_gpus must be >= 0 and num_cpus > 0, got {num_gpus} and {num_cpus}")
    check_windows(max_length, overlap)
    if tokenize:  # on the driver, before any actor starts
        require("prepare", "Moses tokenization (tokenize=True)", ("sacremoses",))
    arguments = dict(model=model, text_column=text_column, tokenize=tokenize, lang=lang, layers=layers,
                     sentence_vectors=sentence_vectors, device="cuda" if num_gpus > 0 else "cpu", dtype=dtype,
                     threads=max(1, int(num_cpus)), max_length=max_length, overlap=overlap,
                     forward_rows=forward_rows)
    with warnings.catch_warnings():  # Ray 2.60 marks ray_remote_args_fn deprecated (for 2.64) and names
        # no successor for an actor's max_restarts; where it is gone, Ray Data's default (forever) applies
        warnings.filterwarnings("ignore", message=".*ray_remote_args_fn.* is deprecated")
        return ds.map_batches(SentenceEmbedder, fn_constructor_kwargs=arguments, batch_size=batch_size,
                              batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=concurrency),
                              num_gpus=num_gpus, num_cpus=num_cpus, ray_remote_args_fn=actor_fault_tolerance)


def actor_fault_tolerance() -> dict:
    """The actors' options (Ray's `max_restarts` and `max_task_retries`): a dead actor is restarted
    and the batch it held retried, `ACTOR_RESTARTS` times, then the run fails (Ray Data's own
    default, forever, would loop on an actor that dies at every start, e.g. out of memory)."""
    return {"max_restarts": ACTOR_RESTARTS, "max_task_retries": ACTOR_RESTARTS}


# ---------------------------------------------------------------------------------------------
# elmo embed --ray: files in, a folder of Parquet files out
# ---------------------------------------------------------------------------------------------
def check_parquet_inputs(paths: Sequence[Path], text_column: str) -> None:
    """Before Ray starts: each Parquet input has `text_column`, of strings, none of the columns
    the run adds (`tokens`, `embedding`, and `file` with several inputs), and a `line` column, if
    any, of integers (their uniqueness is checked as the file is read: `ray_corpus`); a ValueError
    names the file and the column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    added = (*ADDED_COLUMNS, *(["file"] if len(paths) > 1 else []))
    for path in paths:
        schema = pq.read_schema(path)
        if text_column not in schema.names:
            raise ValueError(f"{path}: no column {text_column!r} to embed (--text-column); it has "
                             f"{', '.join(schema.names)}")
        kind = schema.field(text_column).type
        if pa.types.is_dictionary(kind):  # dictionary-encoded (pandas' categoricals): its values are what counts
            kind = kind.value_type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ValueError(f"{path}: column {text_column!r} holds {kind}, not strings (--text-column names the "
                             f"column of sentences)")
        if "line" in schema.names and not pa.types.is_integer(schema.field("line").type):
            raise ValueError(f"{path}: column 'line' holds {schema.field('line').type}; a Parquet input's own line "
                             "column must hold integers, unique in the file (they identify the rows): rename or "
                             "drop it to let elmo embed number the rows")
        clash = next((name for name in added if name in schema.names), None)
        if clash is not None:
            raise ValueError(f"{path}: has a column {clash!r}, which elmo embed --ray adds: rename or drop it first")


def read_files(paths: Sequence[str | Path], text_column: str = "text") -> tuple[Any, str]:
    """A lazy Ray dataset of every line (text files) or row (Parquet files) of `paths`, read by
    Ray's read tasks on the cluster (`elmokit.ray_corpus.CorpusFiles`: nothing passes through the
    driver), a file by one task, each row with its `line` in its file and, with
    several paths, its `file`; and the name of its sentence column ("sentence" for text,
    `text_column` for Parquet). A mix of text and Parquet is refused; a null sentence, an empty
    or unreadable file is an error of the run, naming the file (and row)."""
    ray = _ray()
    paths = [Path(path) for path in paths]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"input file not found: {path}")
    kinds = {is_parquet(path) for path in paths}
    if len(kinds) > 1:
        raise ValueError("give text files or Parquet files, not both: " + ", ".join(map(str, paths)))
    parquet = kinds.pop()
    from elmokit.ray_corpus import CorpusFiles

    source = CorpusFiles([str(path) for path in paths], parquet=parquet, text_column=text_column,
                         rows_per_block=ROWS_PER_BLOCK, with_file=len(paths) > 1)
    # no CPU reserved: actors on every CPU (concurrency = the CPUs) would otherwise leave none to read with
    ds = ray.data.read_datasource(source, num_cpus=0, concurrency=READ_TASKS)
    return ds, text_column if parquet else "sentence"


def connect(address: str, workers: int, quiet: bool = False) -> None:
    """Join the Ray cluster at `address` ("auto": the one this machine belongs to; HOST:PORT or
    ray://HOST:PORT, whose port must answer within `CONNECT_TIMEOUT_S`, else a ConnectionError:
    Ray itself would retry for many minutes), or start a local one ("local") with `workers` CPUs;
    an instance already started here is used as it is. `quiet`: Ray logs warnings only."""
    ray = _ray()
    if ray.is_initialized():
        return
    if address not in ("local", "auto"):
        check_reachable(address)
    main_thread = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main_thread else None
    level = logging.WARNING if quiet else logging.INFO
    if address == "local":
        ray.init(num_cpus=workers + 1, include_dashboard=False, log_to_driver=False, logging_level=level)
    else:
        ray.init(address=address, log_to_driver=False, logging_level=level)
    if main_thread and handler is not None:  # ray.init installs its own, which aborts the process
        signal.signal(signal.SIGTERM, handler)


def check_reachable(address: str) -> None:
    """A ConnectionError naming `address` when nothing accepts a connection at its host and port
    within `CONNECT_TIMEOUT_S` (ValueError when it has no port)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ray {address}: expected local, auto, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as error:
        raise ConnectionError(f"--ray {address}: nothing answers at {host}:{port} within {CONNECT_TIMEOUT_S} s "
                              f"({error}); is the Ray head node running there?") from None


def warn_if_oversubscribed(address: str, workers: int) -> None:
    """One warning when `workers` actors are more than the CPUs Ray has (on `local`, the CPUs of
    this machine: Ray is started with `workers` + 1 of them): each actor holds a copy of the model."""
    cpus = int(_ray().cluster_resources().get("CPU", 0))
    if address == "local":
        cpus = min(cpus, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if workers > cpus:
        log.warning(f"--workers {workers} is more than the {cpus} CPUs Ray has here: the actors share them, each "
                    "with its own copy of the model in memory")


def embed_files(inputs: Sequence[str | Path], output_dir: str | Path, *, address: str = "local", workers: int = 1,
                text_column: str | None = None, forget_sentences: bool = False, overwrite: bool = False,
                progress: bool = True, quiet: bool = False, **embed_arguments: Any) -> dict:
    """`elmo embed --ray`: embed every line of `inputs` (text, one sentence a line; or Parquet with
    a `text_column`, default "text"; refused for text) with `workers` actors into Parquet files in
    `output_dir`, each row with its `line` (0-based in its input; `file` too when there are several
    inputs) and every input column but the sentences with `forget_sentences`. Ray's read tasks read
    the inputs (`read_files`): the driver's memory does not grow with the corpus.

    The files are written into OUTPUT_DIR.partial/ and renamed into place when all are written;
    an existing non-empty `output_dir` (or a partial one) is replaced only with `overwrite`.
    `embed_arguments` go to `embed_dataset`. Returns {"rows", "tokens", "seconds", "files"}.
    """
    output_dir = Path(output_dir)
    partial = output_dir.with_name(output_dir.name + ".partial")
    refuse_output_over_input(inputs, [output_dir, partial])  # the library's callers too, not only elmo embed
    if output_dir.exists() and not output_dir.is_dir():
        raise NotADirectoryError(f"output must be a folder for Parquet files, and {output_dir} is a file")
    check_replaceable_folder(output_dir)
    with output_lock(output_dir.with_name(output_dir.name + ".lock"), str(output_dir)):
        for path in (output_dir, partial):
            if path.is_dir() and any(path.iterdir()) and not overwrite:
                raise FileExistsError(f"{path} exists and is not empty: pass --overwrite to replace it")
        started = time.perf_counter()
        inputs = [Path(path) for path in inputs]
        check_inputs(inputs, text_column)  # before Ray starts and the model loads: a wrong column is said at once
        connect(address, workers, quiet)
        warn_if_oversubscribed(address, workers)
        from ray.data import DataContext

        DataContext.get_current().enable_progress_bars = progress
        ds, sentence_column = read_files(inputs, text_column or "text")
        ds = embed_dataset(ds, text_column=sentence_column, concurrency=workers, **embed_arguments)
        if forget_sentences:
            ds = ds.drop_columns([sentence_column])
        shutil.rmtree(partial, ignore_errors=True)  # a stale partial of another run
        try:
            with ray_console(quiet):
                ds.write_parquet(str(partial))
        except BaseException as error:  # a task's error arrives wrapped in Ray's, its message a traceback
            shutil.rmtree(partial, ignore_errors=True)  # no --resume on Ray: a failed run's files are of no use
            raise worker_error(error) from None
        summary = summarize(partial)
        if not summary["rows"]:
            shutil.rmtree(partial, ignore_errors=True)
            raise ValueError(f"no rows in {', '.join(map(str, inputs))}")
        if output_dir.exists():
            shutil.rmtree(output_dir)
        partial.rename(output_dir)
    return {**summary, "seconds": time.perf_counter() - started}


@contextlib.contextmanager
def ray_console(quiet: bool) -> Iterator[None]:
    """While the block runs, Ray's records reach the terminal only between WARNING (INFO too unless
    `quiet`) and ERROR: its error records (a task's traceback, several times over) go to its
    session's log file only, the error itself being raised to the caller (`worker_error`, one line
    from `elmo embed`). Ray Data configures its own loggers as a dataset runs, hence filters on the
    terminal's handlers rather than levels."""
    lowest = logging.WARNING if quiet else logging.DEBUG

    def shown(record: logging.LogRecord) -> bool:
        return lowest <= record.levelno < logging.ERROR

    handlers = [handler for name in ("ray", "ray.data") for handler in logging.getLogger(name).handlers
                if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)]
    for handler in handlers:
        handler.addFilter(shown)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(shown)


def worker_error(error: BaseException) -> BaseException:
    """The error a read task or an actor raised (a bad input named by file and row, a full disk),
    out of the Ray exceptions that carry it to the driver; `error` itself when it is Ray's own."""
    cause = error
    while (inner := getattr(cause, "cause", None) or cause.__cause__) is not None and inner is not cause:
        cause = inner
    if cause is error or not isinstance(cause, (ValueError, TypeError, KeyError, OSError)):
        return error
    first_line = str(cause.args[0] if cause.args else cause).split("\n")[0]  # not Ray's advice on retries
    try:
        return type(cause)(first_line)
    except Exception:  # an error type whose constructor takes other arguments
        return cause


def check_inputs(inputs: Sequence[Path], text_column: str | None) -> None:
    """The checks of `embed_files` that need no Ray: Parquet inputs' columns
    (`check_parquet_inputs`), and no `text_column` for text inputs (they have no columns)."""
    parquet = [path for path in inputs if path.is_file() and is_parquet(path)]
    text = [path for path in inputs if path.is_file() and path not in parquet]
    if text and text_column is not None:
        raise ValueError(f"--text-column {text_column} names a column of Parquet inputs; {text[0]} is text, one "
                         "sentence a line: leave --text-column out")
    if parquet:
        check_parquet_inputs(parquet, text_column or "text")


def summarize(folder: Path) -> dict:
    """Rows, tokens and files of the Parquet files in `folder` (their footers and `tokens` column)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    rows = tokens = files = 0
    for path in sorted(folder.glob("*.parquet")):
        table = pq.read_table(path, columns=["tokens"])
        rows, files = rows + len(table), files + 1
        tokens += int(pc.sum(pc.list_value_length(table["tokens"])).as_py() or 0)
    return {"rows": rows, "tokens": tokens, "files": files}
