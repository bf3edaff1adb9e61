"""Served throughput and latency of `elmo serve` under concurrent load, against in-process
`ElmoEmbedder.embed_sentences` on the same sentences in the same run.

    .venv/bin/python bench/serve.py                         # -> bench/results/serve.md
    .venv/bin/python bench/serve.py --limit 300 --clients 1 16 --output /tmp/serve.md

The sentences are the 2,001 of UD English EWT dev (already tokenized: sent as token lists to
POST /v1/embeddings, so no tokenizer runs on either side); the model is the built-in one unless
--model says otherwise. A bounded load generator (this process, asyncio, one keep-alive
connection per client, every request sent once) posts them at 1, 4, 16 and 64 concurrent
clients, 1, 1 to 4 (drawn) or 8 sentences a request, to a server on 127.0.0.1 started here with
the same torch threads as the in-process run, its rows of the recurrence its own default unless
--rows says (the in-process run's rows are the engine's choice unless --batch-size says).
Throughput is tokens over the wall time from the first request to the last answer; latency is
per request. Both sides run with a warm token cache (one unmeasured pass each first). In-process
and served runs alternate (--repeats of each per row, the fastest kept), and both are also
measured in CPU time (the server's two processes and the load generator), the steadier figure on
a shared machine. The first answer of every run is checked against the in-process vector.

What bounds a closed loop (each client waits for its answer before sending again) is written
beside it: in-process embed_sentences with as many rows as sentences in flight (clients x
sentences a request), and with as many rows as the server kept busy on average (a comparison
point, not a bound), the mean rows busy in the server (from /metrics), and the CPU seconds of
the model's process, the server's HTTP process and the load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import heapq
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embed import UD_DEV, read_conllu_forms
from machine import busy_processes, page_header  # bench/machine.py: the CPU, its flags, the rooflines

REPO = Path(__file__).resolve().parents[1]


class InProcess:
    """`embed_sentences` in this process, warm: tokens/s by the wall clock and by CPU time, and
    the sentence vectors (the mean over tokens of the layer average, what /v1/embeddings answers)."""

    def __init__(self, sentences: list[list[str]], model: str | None, threads: int, batch_size: int | None):
        from elmokit import ElmoEmbedder

        torch.set_num_threads(threads)
        self.sentences, self.batch_size = sentences, batch_size
        self.embedder = ElmoEmbedder(model, device="cpu")
        self.vectors = self.run()[2]  # the warm-up pass fills the token cache

    def run(self, batch_size: int | None = None) -> tuple[float, float, list[np.ndarray]]:
        """(tokens/s, tokens per CPU second, sentence vectors) of one pass, `batch_size` rows (default:
        the bench's --batch-size; None, the engine's choice)."""
        n_tokens = sum(map(len, self.sentences))
        wall, cpu = time.perf_counter(), time.process_time()
        vectors = [v.mean(axis=0).mean(axis=0)
                   for v in self.embedder.embed_sentences(self.sentences, batch_size or self.batch_size)]
        return n_tokens / (time.perf_counter() - wall), n_tokens / (time.process_time() - cpu), vectors

    @property
    def rows(self) -> int:
        """The rows of a pass without `batch_size`: --batch-size, else the engine's choice."""
        return self.batch_size or self.embedder.stream_rows(self.sentences)

    def best_of(self, rows: int, repeats: int, default_speed: float) -> float:
        """The fastest tokens/s of `repeats` passes with `rows` rows (`default_speed`, the default's
        measured already, where those are the rows it ran)."""
        if rows == self.rows:
            return default_speed
        return max(self.run(rows)[0] for _ in range(repeats))


def process_cpu_seconds(pid: int, children: bool = True) -> float:
    """User + system CPU seconds so far of a process and its threads, and with `children` of its
    child processes (the server's model process), from Linux /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    if not children:
        return own
    pids = [int(child) for task in Path(f"/proc/{pid}/task").iterdir() for child in (task / "children").read_text().split()]
    return own + sum(map(process_cpu_seconds, pids))


def server_info(host: str, port: int) -> dict:
    """The server's GET /info."""
    import urllib.request

    return json.loads(urllib.request.urlopen(f"http://{host}:{port}/info", timeout=60).read())


def recurrence_counts(host: str, port: int) -> tuple[float, float, float]:
    """The server's steps of the recurrence so far, its busy rows summed over them, and the rows
    it computed (busy or idle) summed over them (/metrics)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=60).read().decode()
    values = dict(line.split() for line in text.splitlines() if line.startswith("elmo_recurrence_"))
    return (float(values["elmo_recurrence_steps"]), float(values["elmo_recurrence_busy_row_steps"]),
            float(values["elmo_recurrence_computed_row_steps"]))


def start_server(model: str | None, threads: int, rows: int | None,
                 extra: list[str]) -> tuple[subprocess.Popen, str, int]:
    argv = [sys.executable, "-m", "elmokit", "serve", "--port", "0", "--device", "cpu", "--threads", str(threads),
            *(["--rows", str(rows)] if rows is not None else []), "-q", *(["--model", model] if model else []), *extra]
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)  # the address is a message: on stderr
    while (line := process.stderr.readline()) and not line.startswith("listening on http://"):
        sys.stderr.write(line)
    threading.Thread(target=process.stderr.read, daemon=True).start()  # the rest, read so that the pipe never fills
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


def request_sizes(per_request: str, n_sentences: int) -> list[int]:
    """The sentences of each request: "8" is 8 each, "1-4" a uniform draw from 1..4 each (seeded:
    the same requests in every run)."""
    low, _, high = per_request.partition("-")
    if not (low.isdigit() and (not high or high.isdigit()) and 1 <= int(low) <= int(high or low)):
        raise SystemExit(f"--per-request takes N or LOW-HIGH (1 <= LOW <= HIGH), got {per_request!r}")
    draws = np.random.default_rng(0).integers(int(low), int(high or low) + 1, size=n_sentences)
    sizes = draws[:np.searchsorted(np.cumsum(draws), n_sentences) + 1].tolist()
    sizes[-1] -= sum(sizes) - n_sentences  # the last request takes what is left
    return sizes


def request_bodies(sentences: list[list[str]], per_request: str) -> list[bytes]:
    starts = np.cumsum([0, *request_sizes(per_request, len(sentences))])
    return [json.dumps({"input": sentences[start:end]}).encode() for start, end in zip(starts[:-1], starts[1:])]


def closed_loop_rows(sentences: list[list[str]], per_request: str, clients: int) -> float:
    """The mean rows busy that `clients` closed-loop clients let a server keep at best: the same
    requests, taken in order by whichever client is free, each sentence busy for its steps (tokens + 1:
    `elmokit.serve.recurrence`), each request answered at its longest sentence's last step and the
    client's next request joining at the very next step (no time for HTTP, JSON or the pipe: a server
    with a zero hop). Rows busy summed over the steps, over the steps: an upper bound, no row limit."""
    starts = np.cumsum([0, *request_sizes(per_request, len(sentences))])
    free = [0] * clients  # the step at which each client sends its next request (a heap)
    row_steps = 0
    for start, stop in zip(starts[:-1], starts[1:]):
        steps = [len(sentence) + 1 for sentence in sentences[start:stop]]
        row_steps += sum(steps)
        heapq.heappush(free, heapq.heappop(free) + max(steps))
    return row_steps / max(free)  # the last answer's step


def mean_size(per_request: str) -> float:
    low, _, high = per_request.partition("-")
    return (int(low) + int(high or low)) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="the model to serve (default: the built-in gutenberg-en)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads, the server's and the in-process run's (default: 1)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--per-request", nargs="+", default=["1", "1-4", "8"],
                        help="sentences a request: N, or LOW-HIGH drawn uniformly for each request "
                             "(default: 1 1-4 8)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each row, the fastest kept (default: 2)")
    parser.add_argument("--limit", type=int, help="the first N sentences only")
    parser.add_argument("--batch-size", type=int,
                        help="embed_sentences' batch_size (default: none given, the engine's choice of rows)")
    parser.add_argument("--rows", type=int, help="the server's --rows (default: none given, the server's default)")
    parser.add_argument("--server-args", default="", help="more `elmo serve` flags, e.g. '--max-wait-ms 5'")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "serve.md")
    args = parser.parse_args()

    sentences = read_conllu_forms(UD_DEV)[:args.limit]
    n_tokens = sum(map(len, sentences))
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_before = busy_processes()
    local = InProcess(sentences, args.model, args.threads, args.batch_size)
    process, host, port = start_server(args.model, args.threads, args.rows, args.server_args.split())
    rows = []
    try:
        info = server_info(host, port)
        args.server_rows, args.server_batch_tokens = info["rows"], info["limits"]["max_batch_tokens"]
        asyncio.run(load(host, port, request_bodies(sentences, "8"), 64))  # warm-up: the server's token cache
        for per_request, clients in itertools.product(args.per_request, args.clients):
            bodies = request_bodies(sentences, per_request)
            best: dict = {}
            pairs: list[float] = []  # each run's served / the in-process run just before it
            for _ in range(args.repeats):  # in-process and served interleaved: both see the same neighbours
                wall, cpu, _ = local.run()
                best["local"] = max(best.get("local", 0.0), wall)
                best["local_cpu"] = max(best.get("local_cpu", 0.0), cpu)
                before = (process_cpu_seconds(process.pid, False), process_cpu_seconds(process.pid),
                          time.process_time(), *recurrence_counts(host, port))
                seconds, latencies, first = asyncio.run(load(host, port, bodies, clients))
                after = (process_cpu_seconds(process.pid, False), process_cpu_seconds(process.pid),
                         time.process_time(), *recurrence_counts(host, port))
                http_cpu, server_cpu, client_cpu, *steps = [a - b for a, b in zip(after, before)]
                cpu_seconds = server_cpu + client_cpu
                vector = np.asarray(json.loads(first)["data"][0]["embedding"])
                np.testing.assert_allclose(vector, local.vectors[0], atol=1e-5, rtol=1e-4)
                pairs.append(n_tokens / seconds / wall)
                if n_tokens / seconds > best.get("served", 0.0):
                    best.update(served=n_tokens / seconds, latencies=latencies, busy_rows=steps[1] / steps[0],
                                computed_rows=steps[2] / steps[0], load=os.getloadavg()[0], seconds=seconds,
                                http_cpu=http_cpu,
                                model_cpu=server_cpu - http_cpu, client_cpu=client_cpu, steps=steps[0])
                best["served_cpu"] = max(best.get("served_cpu", 0.0), n_tokens / cpu_seconds)
            # sentences the recurrence can hold at once (on average where requests' sizes vary)
            in_flight = min(round(clients * mean_size(per_request)), args.server_rows)
            best["bound"] = local.best_of(in_flight, args.repeats, best["local"])
            # the engine at the rows the server kept busy
            best["busy_bound"] = local.best_of(max(1, round(best["busy_rows"])), args.repeats, best["local"])
            # the engine at the rows these clients let a server with no hop keep busy
            best["loop_rows"] = min(closed_loop_rows(sentences, per_request, clients), args.server_rows)
            best["loop_bound"] = local.best_of(max(1, round(best["loop_rows"])), args.repeats, best["local"])
            p50, p95, p99 = np.percentile(np.array(best["latencies"]) * 1000, [50, 95, 99])
            rows.append({"per_request": per_request, "clients": clients, "requests": len(bodies),
                         "in_flight": in_flight, "p50": p50, "p95": p95, "p99": p99, "pairs": pairs, **best})
            print(f"{clients:3d} clients x {per_request}: served {best['served']:,.0f} tokens/s, in-process "
                  f"{best['local']:,.0f} ({best['served'] / best['local']:.2f}x; with {in_flight} rows "
                  f"{best['bound'] / best['local']:.2f}x, with a closed loop's {best['loop_rows']:.1f} "
                  f"{best['loop_bound'] / best['local']:.2f}x; each pair {', '.join(f'{r:.2f}' for r in pairs)}); per CPU s {best['served_cpu']:,.0f} vs "
                  f"{best['local_cpu']:,.0f}; {best['busy_rows']:.1f} rows busy of {best['computed_rows']:.1f} computed; p50 {p50:.1f} ms, p99 {p99:.1f} ms; "
                  f"load {best['load']:.2f}", flush=True)
    finally:
        process.terminate()
        process.wait(timeout=60)
    write_report(args, rows, len(sentences), n_tokens, started, load_before, busy_processes(), local.rows)


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


def write_report(args, rows, n_sentences: int, n_tokens: int, started: str, load_before: str, load_after: str,
                 local_rows: int) -> None:
    flags = [*(["--rows", str(args.rows)] if args.rows is not None else []), *args.server_args.split()]
    lines = [
        "# Serving benchmark (`bench/serve.py`)", "",
        page_header("cpu", args.threads),
        f"Run of {started}. The server's model process and the in-process "
        f"run each use {args.threads} torch thread(s); the server's HTTP process and the load generator "
        "(asyncio, in the benchmark's process) share the cores with them. Whatever else ran is below (the "
        "processes over 10% CPU before and after the run) and in the 1-minute load average at the end of each "
        "served run (the table); the wall-clock figures move from run to run on a shared machine; the "
        "CPU-time column (tokens per CPU second of the server's two processes plus the "
        "load generator, against those of the in-process run) does not count time spent waiting for a core.", "",
        f"Data: UD English EWT dev, {n_sentences:,} sentences, {n_tokens:,} tokens, sent as token lists to "
        f"POST /v1/embeddings; model: {args.model or 'gutenberg-en (built in)'}; server flags: "
        f"{' '.join(flags) or 'none'} beside --threads (so {args.server_rows} rows, --max-batch-tokens "
        f"{args.server_batch_tokens}; --max-wait-ms 2 unless given). "
        f"In-process: `ElmoEmbedder.embed_sentences(batch_size={args.batch_size})` on the same sentences "
        f"({'the engine chooses the rows: ' if args.batch_size is None else ''}{local_rows} rows), run "
        f"just before each served run ({args.repeats} of each per row, interleaved, the fastest of each kept).", "",
        f"Server stack: {stack()}.", "",
        f"Machine load: before, {load_before}. After, {load_after}.", "",
        "| sentences / request | clients | requests | served tokens/s | in-process tokens/s | served / in-process | "
        "served / in-process (CPU time) | each run: served / the in-process run before it | p50 ms | p95 ms | p99 ms | load |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row['per_request']} | {row['clients']} | {row['requests']:,} | {row['served']:,.0f} | "
                     f"{row['local']:,.0f} | {row['served'] / row['local']:.2f}x | "
                     f"{row['served_cpu'] / row['local_cpu']:.2f}x | {', '.join(f'{r:.2f}x' for r in row['pairs'])} | "
                     f"{row['p50']:.1f} | {row['p95']:.1f} | "
                     f"{row['p99']:.1f} | {row['load']:.2f} |")
    lines += ["", "Every request is sent once; each client waits for its answer before sending the next (a "
              "closed loop). The server runs the sentences of every request in flight in one recurrence of "
              f"{args.server_rows} rows, each joining as soon as a row is free (continuous batching; docs/serve.md), "
              "so the rows it can fill are the sentences in flight: clients x sentences a request, at most "
              f"{args.server_rows}. The first answer of every run matched the in-process vector (atol 1e-5).", "",
              "## What bounds it", "",
              "A step of the recurrence has a fixed cost besides that of its rows, so the fewer rows busy, the "
              "fewer tokens a second: each step reads every layer's weights, input and recurrent (most of its "
              "time at a few dozen rows is its products), where `embed_sentences` makes a layer's input products "
              "for a block of steps at once and reads only the recurrent weights a step. *In-process with the rows "
              "in flight* is `embed_sentences(batch_size=` sentences in flight `)` "
              "on the same sentences, in this run: what any server could reach with that many sentences at once, "
              "had HTTP, JSON and the clients cost nothing. *In-process with the rows busy* is "
              "`embed_sentences(batch_size=` the server's mean rows busy `)`: a closed loop keeps fewer rows busy "
              "than it has sentences in flight (a request's shorter sentences end first, and its client waits "
              "for the longest), so this is what the engine gives with the rows the clients let a server fill: a "
              "comparison point, not a bound (the mean rounded; the server can beat it). *Rows a closed loop "
              "keeps busy* is the most these clients let any server keep busy (`closed_loop_rows`: the same "
              "requests, each sentence busy for its tokens + 1 steps, each client's next request joining at the "
              "step after its answer, as if HTTP, JSON and the pipe took no time; at most the server's rows), and "
              "*in-process with a closed loop's rows* the engine with that many rows: the bound, on this CPU, of "
              "a server whose steps cost what the engine's do. "
              "*Rows busy* is the mean over the server's steps "
              "(from /metrics); *rows computed*, the mean rows a step computed (rows 0 up to the last busy one: "
              "an idle row below it costs as much as a busy one; the server keeps its busy rows compact, so the "
              "two agree). The CPU seconds are those of the fastest served run: the model's process, the "
              "server's HTTP process (event loop: HTTP, JSON, the pipe), and the load generator. *Model process: "
              "in-process CPU s / its CPU s* compares the CPU time of the model's process alone with that of the "
              "in-process run on the same tokens: what the served rate reaches where the HTTP process and the "
              "load generator have a core of their own and the model's process one to itself.", "",
              "| sentences / request | clients | sentences in flight | in-process with the rows in flight / in-process | "
              "rows a closed loop keeps busy | in-process with a closed loop's rows / in-process | "
              "in-process with the rows busy / in-process | served / in-process | served / in-process with the rows busy | "
              "model process: in-process CPU s / its CPU s | rows busy | rows computed | "
              "steps | wall s | model process CPU s | HTTP process CPU s | load generator CPU s |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['per_request']} | {row['clients']} | {row['in_flight']} | "
                     f"{row['bound'] / row['local']:.2f}x | {row['loop_rows']:.1f} | {row['loop_bound'] / row['local']:.2f}x | "
                     f"{row['busy_bound'] / row['local']:.2f}x | "
                     f"{row['served'] / row['local']:.2f}x | {row['served'] / row['busy_bound']:.2f}x | "
                     f"{n_tokens / row['model_cpu'] / row['local_cpu']:.2f}x | {row['busy_rows']:.1f} | "
                     f"{row['computed_rows']:.1f} | {row['steps']:,.0f} | {row['seconds']:.2f} | {row['model_cpu']:.2f} | "
                     f"{row['http_cpu']:.2f} | {row['client_cpu']:.2f} |")
    capped = [f"{row['clients']} x {row['per_request']}" for row in rows if row["bound"] / row["local"] < 0.8]
    looped = [f"{row['clients']} x {row['per_request']} ({row['loop_bound'] / row['local']:.2f}x)" for row in rows
              if row["bound"] / row["local"] >= 0.8 > row["loop_bound"] / row["local"]]
    busy = [row["served"] / row["busy_bound"] for row in rows]
    reached = [f"{row['clients']} x {row['per_request']}" for row in rows if row["served"] / row["local"] >= 0.8]
    lines += ["", f"Served at 0.8x in-process or more in this run: {', '.join(reached) or 'none'} (clients x sentences "
              f"a request). Where in-process `embed_sentences` itself, given only the rows in flight, stays under "
              f"0.8x ({', '.join(capped) or 'none'}), no server could reach it with these clients; nor, with steps that "
              f"cost what the engine's do, where the engine with the rows a closed loop keeps busy stays under it "
              f"({', '.join(looped) or 'none'} beside those). Against the engine with the rows the server kept busy, "
              f"the server reached {min(busy):.2f}x to {max(busy):.2f}x.", ""]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
