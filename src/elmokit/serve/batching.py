"""Dynamic batching: requests that arrive together are embedded together.

Each request is one job (its sentences, already tokenized). The batcher keeps a bounded queue of
jobs; one worker takes whole jobs in arrival order until the batch holds `max_batch_tokens`
tokens (a job larger than that runs alone), waiting for more while they keep coming (until none
has come for `max_wait_s`, at most `MAX_WAITS` x `max_wait_s` after the first), and runs the batch in one thread through a stateless embedding function
(`ElmoEmbedder.embed_many`): a sentence's vectors never depend on the other sentences of its
batch. While a batch runs, new jobs queue; the next batch takes them at once (their wait has
passed), so a busy server batches by itself and a lone request waits `max_wait_s` only.

A full queue (`max_queue_tokens`) refuses new jobs (`QueueFull`) rather than growing.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

EmbedFunction = Callable[[list[Sequence[str]]], list[np.ndarray]]


class QueueFull(Exception):
    """The queue holds `max_queue_tokens` tokens already: the server is overloaded."""


@dataclass
class Job:
    sentences: list[Sequence[str]]
    n_tokens: int
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class BatchStats:
    """What one batch was: reported to the metrics after it ran."""

    n_sentences: int
    n_tokens: int
    queue_seconds: list[float]  # one per job
    run_seconds: float


class Batcher:
    """The queue and its worker; `start` inside the event loop, `submit` from request handlers,
    `stop` once no request is left (after the server has stopped accepting)."""

    MAX_WAITS = 10  # a batch waits for more requests at most this many times `max_wait_s`

    def __init__(self, embed: EmbedFunction, max_batch_tokens: int, max_wait_s: float, max_queue_tokens: int,
                 on_batch: Callable[[BatchStats], None] = lambda stats: None):
        self.embed = embed
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self.max_queue_tokens = max_queue_tokens
        self.on_batch = on_batch
        self.queue: collections.deque[Job] = collections.deque()
        self.queued_tokens = 0
        self._arrived: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elmo-batch")

    def start(self) -> None:
        self._arrived = asyncio.Event()
        self._worker = asyncio.get_running_loop().create_task(self._run(), name="elmo-batcher")

    async def stop(self) -> None:
        """End the worker and its thread. Called once the server has answered every request it
        accepted (uvicorn drains before the lifespan ends), so nothing is left queued; a job that
        still is gets QueueFull rather than a wait that never ends."""
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
        for job in self.queue:  # none once the server has drained; refuse rather than hang
            if not job.future.done():
                job.future.set_exception(QueueFull("the server is stopping"))
        self._executor.shutdown(wait=True)

    async def submit(self, sentences: list[Sequence[str]]) -> list[np.ndarray]:
        """Embed `sentences` (token lists) in the next batch with room: one float32 array
        (L+1, n_i, 2P) per sentence. QueueFull when the queue has no room for them."""
        n_tokens = sum(map(len, sentences))
        if self.queue and self.queued_tokens + n_tokens > self.max_queue_tokens:
            raise QueueFull(f"the queue holds {self.queued_tokens} tokens, its limit is {self.max_queue_tokens} "
                            f"(--max-queue-tokens): try again shortly")
        job = Job(list(sentences), n_tokens, asyncio.get_running_loop().create_future())
        self.queue.append(job)
        self.queued_tokens += n_tokens
        self._arrived.set()
        return await job.future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self._arrived.clear()
                await self._arrived.wait()
            await self._wait_for_more()
            jobs = self._take_batch()
            if not jobs:
                continue
            sentences = [sentence for job in jobs for sentence in job.sentences]
            started = time.perf_counter()
            try:
                vectors = await loop.run_in_executor(self._executor, self.embed, sentences)
            except Exception as error:  # noqa: BLE001 - handed to each request, which answers it
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(error)
                continue
            finished = time.perf_counter()
            start = 0
            for job in jobs:
                if not job.future.done():  # a client that went away leaves a cancelled future
                    job.future.set_result(vectors[start:start + len(job.sentences)])
                start += len(job.sentences)
            self.on_batch(BatchStats(len(sentences), sum(job.n_tokens for job in jobs),
                                     [started - job.enqueued for job in jobs], finished - started))

    async def _wait_for_more(self) -> None:
        """Until the queue fills a batch, or no job has come for `max_wait_s`, or
        `MAX_WAITS` x `max_wait_s` have passed since the first job came: a burst of requests (a
        batch's answers bring back their clients' next requests at once) goes into one batch,
        while a lone request waits `max_wait_s` only."""
        deadline = self.queue[0].enqueued + self.MAX_WAITS * self.max_wait_s
        while self.queued_tokens < self.max_batch_tokens:
            remaining = min(self.queue[-1].enqueued + self.max_wait_s, deadline) - time.perf_counter()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _take_batch(self) -> list[Job]:
        """Whole jobs in arrival order up to `max_batch_tokens` (at least one job)."""
        jobs = [self.queue.popleft()]
        tokens = jobs[0].n_tokens
        while self.queue and tokens + self.queue[0].n_tokens <= self.max_batch_tokens:
            jobs.append(self.queue.popleft())
            tokens += jobs[-1].n_tokens
        self.queued_tokens -= tokens
        return [job for job in jobs if not job.future.cancelled()]
