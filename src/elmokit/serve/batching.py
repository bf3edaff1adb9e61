"""Dynamic batching, the server's side: requests go to the model's process, which runs the
sentences of every request in flight in the recurrence together, each joining as soon as a row
is free (continuous batching: `elmokit.serve.worker`, `elmokit.serve.recurrence`).

`submit` sends a request's sentences (already tokenized) down a pipe and awaits its answer; the
event loop reads the answers as they come (one message a step of the recurrence) and hands each
to its request. A sentence that arrives while others run starts at the next step instead of
waiting for a batch to finish, so the rows stay as full as the requests in flight allow; every
sentence starts from a zero state, so its vectors never depend on the others.

The queue is bounded: past `max_queue_tokens` tokens accepted and not yet answered, a new
request is refused (`QueueFull`: try again) rather than kept waiting; a request of more tokens
than that could never be queued (`TooLarge`: split it). A request cancelled while it waits
(its client has hung up) is cancelled in the model's process too: its sentences leave the queue
and the recurrence, so abandoned work delays nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from elmokit.inference.embedder import ElmoEmbedder
from elmokit.serve.worker import serve_model

START_TIMEOUT = 600  # seconds for the model's process to load the model (a large one, a loaded machine)
STOP_TIMEOUT = 10  # seconds for it to finish once told to stop (nothing is left to answer by then), else killed


class QueueFull(Exception):
    """The queue holds `max_queue_tokens` tokens already: the server is overloaded."""


class TooLarge(Exception):
    """The request has more tokens than the whole queue may hold: it can never be queued."""


class ModelFailed(RuntimeError):
    """The model's process could not embed a request (or has stopped)."""


@dataclass
class BatchStats:
    """The sentences that joined the recurrence at one step: reported to the metrics."""

    n_sentences: int
    n_tokens: int
    queue_seconds: list[float]  # one per request whose first sentence joined at this step


class Batcher:
    """The model's process and the requests waiting for it: `launch` (before serving), `start`
    inside the event loop, `submit` from request handlers, `stop` once no request is left (after
    the server has stopped accepting)."""

    def __init__(self, embedder: ElmoEmbedder, rows: int, max_positions: int, max_batch_tokens: int,
                 max_wait_s: float, max_queue_tokens: int,
                 on_batch: Callable[[BatchStats], None] = lambda stats: None,
                 on_answer: Callable[[float], None] = lambda seconds: None):
        self.embedder = embedder
        self.rows = rows
        self.settings = (rows, max_positions, max_batch_tokens, max_wait_s)
        self.max_queue_tokens = max_queue_tokens
        self.on_batch = on_batch
        self.on_answer = on_answer
        self.queue: dict[int, asyncio.Future] = {}  # requests accepted and not yet answered
        self.queued_tokens = 0  # their tokens
        self.steps = self.row_steps = 0  # the recurrence's steps, and busy rows summed over them
        self.computed_row_steps = 0  # and the rows it computed (busy or not) summed over them
        self.died = False  # whether the model's process died while serving (its pipe closed before "stop")
        self._ids = itertools.count()
        self._process = self._jobs = self._connection = None  # the pipe to the model's process, and back

    def launch(self) -> None:
        """Start the model's process and wait until it has the model (ModelFailed if it dies)."""
        context = multiprocessing.get_context("spawn")  # no fork: torch's thread pools do not survive one
        jobs_out, self._jobs = context.Pipe(duplex=False)  # one pipe each way, each end used by one thread
        self._connection, answers_in = context.Pipe(duplex=False)
        self._process = context.Process(target=serve_model, name="elmo-model", daemon=True,
                                        args=(jobs_out, answers_in, self.embedder, *self.settings,
                                              torch.get_num_threads()))
        self._process.start()
        jobs_out.close()
        answers_in.close()
        self.embedder = None  # the model's process has its copy
        if not self._connection.poll(START_TIMEOUT):
            self._process.kill()
            raise ModelFailed(f"the model's process did not start in {START_TIMEOUT} s")
        try:
            self._connection.recv()  # ("ready",)
        except EOFError:
            self._process.join(5)
            raise ModelFailed(f"the model's process exited while loading (exit code {self._process.exitcode})"
                              ) from None

    @property
    def alive(self) -> bool:
        """Whether the model's process runs and its pipe is open."""
        return self._process is not None and self._process.is_alive() and not self._connection.closed

    def start(self) -> None:
        asyncio.get_running_loop().add_reader(self._connection.fileno(), self._read)

    async def stop(self) -> None:
        """End the model's process once it has answered what it holds (uvicorn drains the
        requests before the lifespan ends, so nothing is left by then)."""
        if self._process is None:
            return
        if not self._connection.closed:  # (`_read` closed it, and stopped reading, if the process died)
            asyncio.get_running_loop().remove_reader(self._connection.fileno())
        try:
            self._jobs.send(("stop",))
        except OSError:  # it has gone already
            pass
        await asyncio.to_thread(self._process.join, STOP_TIMEOUT)
        if self._process.is_alive():
            self._process.kill()
        self._jobs.close()
        self._connection.close()
        self._fail_all("the server is stopping")

    @property
    def exit_code(self) -> int | None:
        """The model's process's exit code once it has ended (negative: the signal that killed it)."""
        return None if self._process is None else self._process.exitcode

    async def submit(self, sentences: list[Sequence[str]], sentence_vectors: bool = False) -> list[np.ndarray]:
        """Embed `sentences` (token lists): one float32 array (L+1, n_i, 2P) per sentence, or with
        `sentence_vectors` its vector (2P,) (`elmokit.serve.recurrence.Recurrence.take`). QueueFull
        when the queue has no room for them now, TooLarge when it never could have."""
        n_tokens = sum(map(len, sentences))
        if n_tokens > self.max_queue_tokens:
            raise TooLarge(f"the request has {n_tokens} tokens, more than the queue may hold "
                           f"(--max-queue-tokens {self.max_queue_tokens}): split it into requests of at most "
                           f"{self.max_queue_tokens} tokens")
        if self.queued_tokens + n_tokens > self.max_queue_tokens:
            raise QueueFull(f"the queue holds {self.queued_tokens} tokens, its limit is {self.max_queue_tokens} "
                            f"(--max-queue-tokens): try again shortly")
        if not self.alive:
            raise ModelFailed("the model's process has stopped: restart elmo serve")
        job_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        try:
            self._jobs.send(("job", job_id, [list(sentence) for sentence in sentences], time.perf_counter(),
                             sentence_vectors))
        except OSError:  # it died since `alive` was read
            raise ModelFailed("the model's process has stopped: restart elmo serve") from None
        self.queue[job_id] = future
        self.queued_tokens += n_tokens
        try:
            return await future
        except asyncio.CancelledError:  # its client has gone (or the shutdown's time is up): drop the work
            with contextlib.suppress(OSError):
                self._jobs.send(("cancel", job_id))
            raise
        finally:
            self.queue.pop(job_id, None)
            self.queued_tokens -= n_tokens

    def _read(self) -> None:
        """(In the event loop, when the pipe has a message.) Hand out the answers."""
        try:
            while self._connection.poll():
                _, answers, stats = self._connection.recv()
                self._record(stats)
                for job_id, layers, error in answers:
                    future = self.queue.get(job_id)
                    if future is None or future.done():  # its client went away
                        continue
                    if error is None:
                        future.set_result(layers)
                    else:
                        future.set_exception(ModelFailed(f"the model failed on this request: {error}"))
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self._connection.fileno())
            self._connection.close()
            self.died = True
            self._fail_all(f"the model's process has stopped (exit code {self._process.exitcode})")

    def _record(self, stats: dict) -> None:
        for n_sentences, n_tokens, queue_seconds in stats["batches"]:
            self.on_batch(BatchStats(n_sentences, n_tokens, queue_seconds))
        for seconds in stats["answer_seconds"]:
            self.on_answer(seconds)
        self.steps, self.row_steps = stats["steps"], stats["row_steps"]
        self.computed_row_steps = stats["computed_row_steps"]

    def _fail_all(self, message: str) -> None:
        for future in self.queue.values():
            if not future.done():
                future.set_exception(ModelFailed(message))
