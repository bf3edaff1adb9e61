"""The server's Prometheus metrics (`GET /metrics`), in a registry of its own (one per app):
requests by route and status, inputs and tokens embedded and answered, how many sentences joined the
recurrence together, time in the queue, time in the model, request latency, what is queued, how
full the rows of the recurrence were, and refusals by status.

The per-step figures (the batch histograms, the queue and inference times, the steps) come from
the model's process with its answers: they arrive when a request is answered, and include the
steps of work later abandoned; `elmo_inputs_total` and `elmo_tokens_total` count only what was
answered to a client still waiting for it."""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from elmokit.serve.batching import Batcher, BatchStats

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_BUCKETS = (8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 65536)


class ServeMetrics:
    """The metrics and the middleware hooks that feed them."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, routes: set[str]):
        self.routes = routes  # labelled by their path; any other path counts as "other"
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("elmo_requests", "HTTP requests answered, by route and status", ["route", "status"],
                                registry=r)
        self.request_seconds = Histogram("elmo_request_seconds", "time from request to response, by route",
                                         ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.inputs = Counter("elmo_inputs", "inputs (texts or token lists) embedded and answered (abandoned "
                              "work not counted)", registry=r)
        self.tokens = Counter("elmo_tokens", "tokens embedded and answered (abandoned work not counted)", registry=r)
        self.batch_sentences = Histogram("elmo_batch_sentences", "sentences that joined the recurrence at one step",
                                         buckets=SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram("elmo_batch_tokens", "tokens that joined the recurrence at one step",
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.queue_seconds = Histogram("elmo_queue_seconds", "time a request waited for its first sentence to start",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.inference_seconds = Histogram("elmo_inference_seconds", "time from a request's first sentence "
                                           "starting to its last ending", buckets=LATENCY_BUCKETS, registry=r)
        self.refused = Counter("elmo_refused", "requests a route refused with a JSON error, by reason: the status "
                               "(400, 404, 408, 413, 422, 429 a full queue, 503 the model's process failed)",
                               ["reason"], registry=r)
        self.abandoned = Counter("elmo_abandoned", "requests whose client hung up before the answer (their work "
                                 "dropped from the queue and the recurrence)", registry=r)
        self.queue_requests = Gauge("elmo_queue_requests", "requests waiting in the queue", registry=r)
        self.queue_tokens = Gauge("elmo_queue_tokens", "tokens waiting in the queue", registry=r)
        self.steps = Gauge("elmo_recurrence_steps", "steps the recurrence has run (a count)", registry=r)
        self.row_steps = Gauge("elmo_recurrence_busy_row_steps", "busy rows summed over the steps run (a count): "
                               "divided by elmo_recurrence_steps, the mean sentences in the recurrence", registry=r)
        self.computed_row_steps = Gauge("elmo_recurrence_computed_row_steps", "rows computed (busy or idle, the "
                                        "span of the busy rows) summed over the steps run (a count)", registry=r)

    def watch(self, batcher: Batcher) -> None:
        self.queue_requests.set_function(lambda: len(batcher.queue))
        self.queue_tokens.set_function(lambda: batcher.queued_tokens)
        self.steps.set_function(lambda: batcher.steps)
        self.row_steps.set_function(lambda: batcher.row_steps)
        self.computed_row_steps.set_function(lambda: batcher.computed_row_steps)

    def record_batch(self, stats: BatchStats) -> None:
        self.batch_sentences.observe(stats.n_sentences)
        self.batch_tokens.observe(stats.n_tokens)
        for seconds in stats.queue_seconds:
            self.queue_seconds.observe(seconds)

    def record_answered(self, sentences: list[list[str]]) -> None:
        """A request's sentences (token lists) embedded, handed to the client that asked."""
        self.inputs.inc(len(sentences))
        self.tokens.inc(sum(map(len, sentences)))

    def route_of(self, path: str) -> str:
        return path if path in self.routes else "other"

    def record_request(self, path: str, status: int, started: float) -> None:
        route = self.route_of(path)
        self.requests.labels(route, str(status)).inc()
        self.request_seconds.labels(route).observe(time.perf_counter() - started)

    def text(self) -> bytes:
        return generate_latest(self.registry)
