"""One ElmoEmbedder or Elmo shared by many threads gives what sequential calls give."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from elmokit import Elmo, ElmoEmbedder, TokenCache, batch_to_ids

N_THREADS = 8


def _sentence_lists(seed: int, n_lists: int, n_sentences: int, vocabulary: int) -> list[list[list[str]]]:
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(vocabulary)]
    return [[list(rng.choice(words, rng.integers(0, 12))) for _ in range(n_sentences)] for _ in range(n_lists)]


def _in_threads(work, inputs: list) -> list:
    """work(x) for every x, each in its own thread, all started together; re-raises any error."""
    results, errors = [None] * len(inputs), []
    start = threading.Barrier(len(inputs))

    def run(i: int) -> None:
        try:
            start.wait()
            results[i] = work(inputs[i])
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def test_embedder_without_cache_in_threads_equals_sequential_exactly(tiny_model):
    embedder = ElmoEmbedder(module=tiny_model, cache_tokens=False)
    lists = _sentence_lists(0, N_THREADS, 40, 300)
    sequential = [list(embedder.embed_sentences(sentences, batch_size=5)) for sentences in lists]
    for _ in range(3):
        threaded = _in_threads(lambda sentences: list(embedder.embed_sentences(sentences, batch_size=5)), lists)
        for got, expected in zip(threaded, sequential):
            assert len(got) == len(expected)
            for a, b in zip(got, expected):
                np.testing.assert_array_equal(a, b)


def test_token_cache_shared_by_threads_that_fill_and_reset_it(tiny_model):
    """A cache of 1,024 words, 8 threads over 6,000: it fills and starts over many times while
    other threads read it. A row read after another thread's reset would be another word's
    vector (differences of order 1, or a KeyError); the cache itself is exact to 1e-6 (the
    token encoder's sums depend slightly on how many words it runs at once)."""
    projection = tiny_model.config.lstm.projection_dim
    embedder = ElmoEmbedder(module=tiny_model)
    embedder.cache = TokenCache(embedder.bilm, max_bytes=1024 * 4 * projection)
    lists = _sentence_lists(1, N_THREADS, 60, 6000)
    plain = ElmoEmbedder(module=tiny_model, cache_tokens=False)
    sequential = [list(plain.embed_sentences(sentences, batch_size=4)) for sentences in lists]
    for _ in range(3):
        threaded = _in_threads(lambda sentences: list(embedder.embed_sentences(sentences, batch_size=4)), lists)
        for got, expected in zip(threaded, sequential):
            for a, b in zip(got, expected):
                np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert len(embedder.cache.index) <= embedder.cache.max_size == 1024


def test_embed_batch_and_sentence_in_threads(tiny_model):
    embedder = ElmoEmbedder(module=tiny_model, cache_tokens=False)
    lists = _sentence_lists(2, N_THREADS, 6, 200)
    sequential = [embedder.embed_batch(batch) for batch in lists]
    threaded = _in_threads(embedder.embed_batch, lists)
    for got, expected in zip(threaded, sequential):
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("word_inputs", [False, True])
def test_elmo_in_eval_mode_in_threads_equals_sequential_exactly(tiny_model, word_inputs):
    lists = _sentence_lists(3, N_THREADS, 6, 100)
    vocab = ["@@PADDING@@", *sorted({word for sentences in lists for sentence in sentences for word in sentence})]
    elmo = Elmo(module=tiny_model, num_output_representations=2, dropout=0.5,
                vocab_to_cache=vocab if word_inputs else None).eval()
    row = {word: i for i, word in enumerate(vocab)}  # 0: padding

    def inputs(sentences):
        if not word_inputs:
            return {"inputs": batch_to_ids(sentences)}
        width = max(1, max(map(len, sentences)))
        ids = torch.tensor([[row[w] for w in s] + [0] * (width - len(s)) for s in sentences], dtype=torch.long)
        return {"word_inputs": ids}

    def run(sentences):
        with torch.no_grad():
            output = elmo(**inputs(sentences))
        return [r.numpy() for r in output["elmo_representations"]], output["mask"].numpy()

    sequential = [run(sentences) for sentences in lists]
    for _ in range(3):
        for (got, got_mask), (expected, expected_mask) in zip(_in_threads(run, lists), sequential):
            np.testing.assert_array_equal(got_mask, expected_mask)
            for a, b in zip(got, expected):
                np.testing.assert_array_equal(a, b)


def test_stateful_embedder_calls_do_not_interleave(tiny_model):
    """Stateful results depend on the order of calls by design; shared by threads, each call
    must still see a whole state (one of the orders, never a mix): with identical batches the
    carried state after N calls is that of N sequential calls."""
    batch = _sentence_lists(4, 1, 3, 50)[0]
    threaded = ElmoEmbedder(module=tiny_model, stateful=True, cache_tokens=False)
    _in_threads(lambda _: threaded.embed_batch(batch), list(range(N_THREADS)))
    sequential = ElmoEmbedder(module=tiny_model, stateful=True, cache_tokens=False)
    for _ in range(N_THREADS):
        sequential.embed_batch(batch)
    for a, b in zip(threaded.carried.state, sequential.carried.state):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
