"""The model's own process: it drives the recurrence (`elmokit.serve.recurrence`), taking
requests from the server's process over a pipe and sending the answers back.

Why a process and not a thread: the recurrence runs dozens of small torch operations a step,
each of which gives up Python's lock and takes it back. In the server's process the event loop
(HTTP parsing, JSON) wants that lock between every two of them, so the model and the event loop
took turns instead of running on two cores at once (profiled at 64 clients with the model in a
thread: its one write a step to wake the event loop spent much of a step waiting for the lock).
Here the model has a process, and a lock, of its own; the event loop only reads and
writes pipes.

Messages, server -> model (one pipe): ("job", id, sentences, enqueued, sentence_vectors),
("cancel", id) (its client has gone: its sentences leave the queue and the recurrence unanswered)
and ("stop",). Model -> server (another pipe, written by a thread of its own): ("ready",) once
loaded, then ("answers", [(id, results or None, error or None), ...], stats). The results are
one array per sentence: its layers (L+1, n, 2P), or with `sentence_vectors` its vector (2P,)
(`Recurrence.take`; the 3n times smaller message that /v1/embeddings needs). The stats hold the
sentences that joined at each step since the last message ("batches": (n_sentences, n_tokens,
queue seconds per request started)), each answered request's time in the model
("answer_seconds"), and the running totals "steps", "row_steps" (busy rows) and
"computed_row_steps" (rows computed: `Recurrence.computed_row_steps`).

Before every step the loop moves sentences from the head of its queue, in arrival order, into
the free rows (while the tokens in the recurrence stay within `max_batch_tokens`); a sentence that
took its last step leaves, and a request whose sentences have all left is answered at once. When
the recurrence is idle, the first request waits for company (until none has come for
`max_wait_s`, at most `MAX_WAITS` x `max_wait_s` after it), so that a burst starts together.
"""

from __future__ import annotations

import collections
import queue
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from elmokit.inference.embedder import ElmoEmbedder
from elmokit.serve.recurrence import Recurrence, token_layer

MAX_WAITS = 10  # an idle recurrence waits for more requests at most this many times `max_wait_s`


@dataclass(eq=False)
class Job:
    id: int
    sentences: list[Sequence[str]]
    enqueued: float  # time.perf_counter() in the server's process (the same clock on Linux and macOS)
    sentence_vectors: bool  # answer each sentence's vector (2P,), not its layers (L+1, n, 2P)
    admitted: int = 0  # sentences that have joined the recurrence
    remaining: int = 0  # sentences not yet answered
    results: list = field(default_factory=list)
    started: float = 0.0  # when its first sentence joined

    def __post_init__(self) -> None:
        self.remaining = len(self.sentences)
        self.results = [None] * len(self.sentences)


def serve_model(jobs: Connection, answers: Connection, embedder: ElmoEmbedder, rows: int, max_positions: int,
                max_batch_tokens: int, max_wait_s: float, threads: int) -> None:
    """The model process's entry point (spawned by `elmokit.serve.batching.Batcher.launch`):
    requests come in on `jobs`, answers go out on `answers`, written by a thread of their own so
    that the model never waits for the server's process to read (nor the server, blocked writing
    a request while the model is blocked writing an answer, waits for the model: a deadlock)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's process decides when to stop (it drains first)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    sender = threading.Thread(target=_send_all, args=(outbox, answers), name="elmo-answers", daemon=True)
    sender.start()
    loop = ModelLoop(jobs, outbox, Recurrence(embedder.bilm, rows, max_positions),
                     lambda sentences: token_layer(embedder, sentences), max_batch_tokens, max_wait_s)
    outbox.put(("ready",))
    try:
        loop.run()
    except (EOFError, OSError):  # the server's process has gone
        pass
    outbox.put(None)
    sender.join()


def _send_all(outbox: queue.SimpleQueue, answers: Connection) -> None:
    """(A thread of the model's process.) Write each message put in `outbox` until None."""
    try:
        while (message := outbox.get()) is not None:
            answers.send(message)
    except OSError:  # the server's process has gone
        pass


class ModelLoop:
    def __init__(self, connection: Connection, outbox: queue.SimpleQueue, recurrence: Recurrence, token_layer,
                 max_batch_tokens: int, max_wait_s: float):
        self.connection = connection  # the requests
        self.outbox = outbox  # the answers (written by a thread of their own)
        self.recurrence = recurrence
        self.token_layer = token_layer
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self.queue: collections.deque[Job] = collections.deque()  # jobs with sentences still to start
        self.jobs: dict[int, Job] = {}  # every job not yet answered, by id
        self.queued_tokens = 0
        self.live_tokens = 0  # tokens in the recurrence
        self.rows: dict[int, tuple[Job, int]] = {}  # row -> (job, sentence index)
        self.stopping = False
        self.answers: list[tuple] = []  # to send after this step
        self.batches: list[tuple] = []
        self.answer_seconds: list[float] = []
        self.steps = self.row_steps = 0

    def run(self) -> None:
        while not (self.stopping and not self.queue and not self.rows):
            if not self.queue and not self.rows:
                self._receive(None)  # idle: block until a message
                continue
            self._receive(0)  # whatever has arrived joins at this step (or has been cancelled)
            if not self.rows and self.queue:
                self._wait_for_more()
            starting = self._take_sentences()
            if starting:
                self._admit(starting)
            if self.rows:
                self._compact()
                self._step()
            self._send()

    def _receive(self, timeout: float | None) -> None:
        """Read the messages waiting (after up to `timeout` seconds for the first; None: forever)."""
        while self.connection.poll(timeout):
            message = self.connection.recv()
            if message[0] == "job":
                _, job_id, sentences, enqueued, sentence_vectors = message
                self.jobs[job_id] = job = Job(job_id, sentences, enqueued, sentence_vectors)
                self.queue.append(job)
                self.queued_tokens += sum(map(len, sentences))
            elif message[0] == "cancel":
                self._cancel(message[1])
            else:  # "stop": finish what is queued, then return
                self.stopping = True
            timeout = 0

    def _cancel(self, job_id: int) -> None:
        """Drop a job whose client has gone: its sentences still queued, and those in the
        recurrence, whose rows the next step no longer computes (nothing if it was answered)."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        if job in self.queue:
            self.queue.remove(job)
            self.queued_tokens -= sum(map(len, job.sentences[job.admitted:]))
        rows = [row for row, (owner, _) in self.rows.items() if owner is job]
        for row in rows:
            self.live_tokens -= len(job.sentences[self.rows.pop(row)[1]])
        self.recurrence.drop(rows)

    def _wait_for_more(self) -> None:
        """(The recurrence idle.) Until the queue holds `max_batch_tokens`, or no job has come
        for `max_wait_s`, or `MAX_WAITS` x `max_wait_s` have passed since the first: a burst of
        requests starts together, a lone request waits `max_wait_s` only."""
        deadline = self.queue[0].enqueued + MAX_WAITS * self.max_wait_s
        while self.queue and self.queued_tokens < self.max_batch_tokens and not self.stopping:
            remaining = min(self.queue[-1].enqueued + self.max_wait_s, deadline) - time.perf_counter()
            if remaining <= 0 or not self.connection.poll(remaining):
                return
            self._receive(0)

    def _take_sentences(self) -> list[tuple[Job, int]]:
        """The next sentences in arrival order, as many as there are free rows and room within
        `max_batch_tokens` (at least one when the recurrence is empty)."""
        starting = []
        free_rows = self.recurrence.rows - len(self.rows)
        tokens = self.live_tokens
        while self.queue and len(starting) < free_rows:
            job = self.queue[0]
            n_tokens = len(job.sentences[job.admitted])
            if tokens + n_tokens > self.max_batch_tokens and (tokens or starting):
                break
            starting.append((job, job.admitted))
            tokens += n_tokens
            self.queued_tokens -= n_tokens
            job.admitted += 1
            if job.admitted == len(job.sentences):
                self.queue.popleft()
        return starting

    def _admit(self, starting: list[tuple[Job, int]]) -> None:
        now = time.perf_counter()
        sentences = [job.sentences[index] for job, index in starting]
        sizes = [len(sentence) + 2 for sentence in sentences]
        try:
            token_layers = self.token_layer(sentences)  # (N, P), boundaries included
        except Exception as error:  # noqa: BLE001 - handed to each request, which answers it
            self._fail({job for job, _ in starting}, error)
            return
        queue_seconds = []
        for (job, index), row in zip(starting, self.recurrence.admit(token_layers, sizes)):
            if index == 0:
                job.started = now
                queue_seconds.append(now - job.enqueued)
            self.rows[row] = (job, index)
            self.live_tokens += len(job.sentences[index])
        self.batches.append((len(sentences), sum(sizes) - 2 * len(sizes), queue_seconds))

    def _compact(self) -> None:
        """The busy rows moved down into the rows left idle (`Recurrence.compact`): a step
        computes only as many rows as there are sentences in the recurrence."""
        moves = self.recurrence.compact()
        if moves:
            moved = {row: self.rows.pop(row) for row in moves}
            self.rows.update((moves[row], owner) for row, owner in moved.items())

    def _step(self) -> None:
        self.steps += 1
        self.row_steps += len(self.rows)
        try:
            ended = self.recurrence.step()
            if not ended:
                return
            vectors = [self.rows[row][0].sentence_vectors for row in ended]
            results = dict(zip(ended, [None] * len(ended)))
            for wanted in (True, False):  # the rows that want vectors read together, those that want layers too
                chosen = [row for row, want in zip(ended, vectors) if want is wanted]
                if chosen:
                    results.update(zip(chosen, self.recurrence.take(chosen, sentence_vectors=wanted)))
            for row in ended:
                job, index = self.rows.pop(row)
                self.live_tokens -= len(job.sentences[index])
                job.results[index] = results[row]  # (2P,) or (L+1, n, 2P)
                job.remaining -= 1
                if job.remaining == 0:
                    del self.jobs[job.id]
                    self.answer_seconds.append(time.perf_counter() - job.started)
                    self.answers.append((job.id, job.results, None))
        except Exception as error:  # noqa: BLE001 - handed to each request in the recurrence
            jobs = {job for job, _ in self.rows.values()}
            self.rows.clear()
            self.live_tokens = 0
            self.recurrence.clear()
            self._fail(jobs, error)

    def _fail(self, jobs: set[Job], error: Exception) -> None:
        """Answer `jobs` with `error`; the rest of their sentences do not start."""
        for job in jobs:
            self.jobs.pop(job.id, None)
            if job in self.queue:
                self.queue.remove(job)
                self.queued_tokens -= sum(map(len, job.sentences[job.admitted:]))
            self.answers.append((job.id, None, f"{type(error).__name__}: {error}"))

    def _send(self) -> None:
        """One message a step with what was answered (none when nothing was)."""
        if not self.answers:
            return
        stats = {"batches": self.batches, "answer_seconds": self.answer_seconds, "steps": self.steps,
                 "row_steps": self.row_steps, "computed_row_steps": self.recurrence.computed_row_steps}
        self.outbox.put(("answers", self.answers, stats))
        self.answers, self.batches, self.answer_seconds = [], [], []
