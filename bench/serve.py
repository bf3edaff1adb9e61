"""Served throughput and latency of `elmo serve` under concurrent load, against in-process
`ElmoEmbedder.embed_sentences` on the same sentences in the same run.

    .venv/bin/python bench/serve.py                         # -> bench/results/serve.md
    .venv/bin/python bench/serve.py --limit 300 --clients 1 16 --output /tmp/serve.md

The sentences are the 2,001 of UD English EWT dev (already tokenized: sent as token lists to
POST /v1/embeddings, so no tokenizer runs on either side); the model is the built-in one unless
--model says otherwise. A bounded load generator (this process, asyncio, one keep-alive
connection per client, every request sent once) posts them at 1, 4, 16 and 64 concurrent
clients, one sentence or 8 per request, to a server on 127.0.0.1 started here with the same torch
threads as the in-process run. Throughput is tokens over the wall time from the first request to
the last answer; latency is per request. Both sides run with a warm token cache (one unmeasured
pass each first). In-process and served runs alternate (--repeats of each per row, the fastest kept),
and both are also measured in CPU time, the steadier figure on a shared machine. The first answer
of every run is checked against the in-process vector.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed import UD_DEV, busy_processes, machine, read_conllu_forms  # noqa: E402  (bench/embed.py)

REPO = Path(__file__).resolve().parents[1]


class InProcess:
    """`embed_sentences` in this process, warm: tokens/s by the wall clock and by CPU time, and
    the sentence vectors (the mean over tokens of the layer average, what /v1/embeddings answers)."""

    def __init__(self, sentences: list[list[str]], model: str | None, threads: int, batch_size: int):
        from elmokit import ElmoEmbedder

        torch.set_num_threads(threads)
        self.sentences, self.batch_size = sentences, batch_size
        self.embedder = ElmoEmbedder(model, device="cpu")
        self.vectors = self.run()[2]  # the warm-up pass fills the token cache

    def run(self) -> tuple[float, float, list[np.ndarray]]:
        n_tokens = sum(map(len, self.sentences))
        wall, cpu = time.perf_counter(), time.process_time()
        vectors = [v.mean(axis=0).mean(axis=0) for v in self.embedder.embed_sentences(self.sentences, self.batch_size)]
        return n_tokens / (time.perf_counter() - wall), n_tokens / (time.process_time() - cpu), vectors


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its threads so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(model: str | None, threads: int, extra: list[str]) -> tuple[subprocess.Popen, str, int]:
    argv = [sys.executable, "-m", "elmokit", "serve", "--port", "0", "--device", "cpu", "--threads", str(threads),
            "-q", *(["--model", model] if model else []), *extra]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    line = process.stdout.readline()
    if not line.startswith("listening on http://"):
        sys.exit(f"elmo serve did not start: {line!r}")
    host, port = line.split()[2].removeprefix("http://").rsplit(":", 1)
    return process, host, int(port)


async def post(reader, writer, body: bytes) -> bytes:
    writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    status = await reader.readline()
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    answer = await reader.readexactly(length)
    if b" 200 " not in status:
        raise RuntimeError(f"{status!r}: {answer[:300]!r}")
    return answer


async def load(host: str, port: int, bodies: list[bytes], clients: int) -> tuple[float, list[float], bytes]:
    """Send every body once over `clients` connections; (wall seconds, latencies, first answer)."""
    pending = iter(bodies)
    latencies: list[float] = []
    first: list[bytes] = []

    async def client():
        reader, writer = await asyncio.open_connection(host, port)
        for body in pending:  # the iterator is shared: each body goes to whichever client is free
            sent = time.perf_counter()
            answer = await post(reader, writer, body)
            latencies.append(time.perf_counter() - sent)
            if body is bodies[0]:
                first.append(answer)
        writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - start, latencies, first[0]


def request_bodies(sentences: list[list[str]], per_request: int) -> list[bytes]:
    return [json.dumps({"input": sentences[i:i + per_request]}).encode()
            for i in range(0, len(sentences), per_request)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="the model to serve (default: the built-in gutenberg-en)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads, the server's and the in-process run's (default: 1)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--per-request", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each row, the fastest kept (default: 2)")
    parser.add_argument("--limit", type=int, help="the first N sentences only")
    parser.add_argument("--batch-size", type=int, default=64, help="embed_sentences' batch_size (default: 64)")
    parser.add_argument("--server-args", default="", help="more `elmo serve` flags, e.g. '--max-wait-ms 5'")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "serve.md")
    args = parser.parse_args()

    sentences = read_conllu_forms(UD_DEV)[:args.limit]
    n_tokens = sum(map(len, sentences))
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_before = busy_processes()
    local = InProcess(sentences, args.model, args.threads, args.batch_size)
    process, host, port = start_server(args.model, args.threads, args.server_args.split())
    rows = []
    try:
        asyncio.run(load(host, port, request_bodies(sentences, 8), 64))  # warm-up: the server's token cache
        for per_request, clients in itertools.product(args.per_request, args.clients):
            bodies = request_bodies(sentences, per_request)
            best: dict = {}
            for _ in range(args.repeats):  # in-process and served interleaved: both see the same neighbours
                wall, cpu, _ = local.run()
                best["local"] = max(best.get("local", 0.0), wall)
                best["local_cpu"] = max(best.get("local_cpu", 0.0), cpu)
                cpu_before = process_cpu_seconds(process.pid) + time.process_time()
                seconds, latencies, first = asyncio.run(load(host, port, bodies, clients))
                cpu_seconds = process_cpu_seconds(process.pid) + time.process_time() - cpu_before
                vector = np.asarray(json.loads(first)["data"][0]["embedding"])
                np.testing.assert_allclose(vector, local.vectors[0], atol=1e-5, rtol=1e-4)
                if n_tokens / seconds > best.get("served", 0.0):
                    best.update(served=n_tokens / seconds, latencies=latencies)
                best["served_cpu"] = max(best.get("served_cpu", 0.0), n_tokens / cpu_seconds)
            p50, p95, p99 = np.percentile(np.array(best["latencies"]) * 1000, [50, 95, 99])
            rows.append({"per_request": per_request, "clients": clients, "requests": len(bodies),
                         "p50": p50, "p95": p95, "p99": p99, **best})
            print(f"{clients:3d} clients x {per_request}: served {best['served']:,.0f} tokens/s, in-process "
                  f"{best['local']:,.0f} ({best['served'] / best['local']:.2f}x); per CPU s "
                  f"{best['served_cpu']:,.0f} vs {best['local_cpu']:,.0f}; p50 {p50:.1f} ms, p99 {p99:.1f} ms",
                  flush=True)
    finally:
        process.terminate()
        process.wait(timeout=60)
    write_report(args, rows, len(sentences), n_tokens, started, load_before, busy_processes())


def stack() -> str:
    """The versions of the HTTP stack `elmo serve` ran on."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("uvicorn", "httptools", "starlette", "orjson"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            found.append(f"no {package}")
    return ", ".join(found)


def write_report(args, rows, n_sentences: int, n_tokens: int, started: str, load_before: str, load_after: str) -> None:
    lines = [
        "# Serving benchmark (`bench/serve.py`)", "",
        f"Run of {started} on {machine('cpu', args.threads)}. The server and the in-process run each use "
        f"{args.threads} torch thread(s); the load generator (asyncio, in the benchmark's process) shares the "
        "cores. **This machine's 2 cores were shared with other engineers' work** (test suites, training, "
        "embedding: the processes below), so the wall-clock figures move from run to run; the CPU-time "
        "columns (tokens per CPU second of the server plus the load generator, against those of the "
        "in-process run) do not count time spent waiting for a core and are the steadier comparison.", "",
        f"Data: UD English EWT dev, {n_sentences:,} sentences, {n_tokens:,} tokens, sent as token lists to "
        f"POST /v1/embeddings; model: {args.model or 'gutenberg-en (built in)'}; server flags: "
        f"{args.server_args or 'the defaults'} (--max-batch-tokens 16384, --max-wait-ms 2 unless given). "
        f"In-process: `ElmoEmbedder.embed_sentences(batch_size={args.batch_size})` on the same sentences, run "
        f"just before each served run ({args.repeats} of each per row, interleaved, the fastest of each kept).", "",
        f"Server stack: {stack()}.", "",
        f"Machine load: before, {load_before}. After, {load_after}.", "",
        "| sentences / request | clients | requests | served tokens/s | in-process tokens/s | served / in-process | "
        "served / in-process (CPU time) | p50 ms | p95 ms | p99 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row['per_request']} | {row['clients']} | {row['requests']:,} | {row['served']:,.0f} | "
                     f"{row['local']:,.0f} | {row['served'] / row['local']:.2f}x | "
                     f"{row['served_cpu'] / row['local_cpu']:.2f}x | {row['p50']:.1f} | {row['p95']:.1f} | "
                     f"{row['p99']:.1f} |")
    lines += ["", "Every request is sent once; each client waits for its answer before sending the next (a "
              "closed loop), so at 1 client every request is a batch of its own (the model runs one row, or 8, "
              "at a time, against the in-process run's 64), while with more clients the queue batches what "
              "arrives together (up to `--max-batch-tokens`). The first answer of every run matched the "
              "in-process vector (atol 1e-5).", ""]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
