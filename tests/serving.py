"""A real `elmo serve` process on 127.0.0.1 for the tests, and a small HTTP client (stdlib only)."""

from __future__ import annotations

import http.client
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from elmokit import BiLM, save_pretrained
from tests.conftest import tiny_config

pytest.importorskip("starlette", reason="elmo serve needs the serve extra: pip install 'elmokit[serve]'")
pytest.importorskip("uvicorn", reason="elmo serve needs the serve extra: pip install 'elmokit[serve]'")
pytest.importorskip("prometheus_client", reason="elmo serve needs the serve extra: pip install 'elmokit[serve]'")

# Seconds a server may take to start: the wait ends as soon as the process prints its address or
# exits; the limit is only against a wedged process, generous for a machine under load (importing
# torch there took over 120 s).
START_LIMIT = 900


def save_tiny_model(directory: Path) -> Path:
    """The conftest's tiny model, seeded (0), saved as `directory`/model for a server to load."""
    torch.manual_seed(0)
    path = directory / "model"
    save_pretrained(BiLM(tiny_config()).eval(), path)
    return path


class Server:
    """`python -m elmokit serve --port 0 ...` in a subprocess; `url` once it listens."""

    def __init__(self, model: Path, *arguments: str, api_key: str | None = None):
        env = dict(os.environ, ELMOKIT_OFFLINE="1")
        env.pop("ELMOKIT_API_KEY", None)
        self.api_key = api_key
        self.model_name = str(model)  # the name it serves (/v1/embeddings' "model")
        argv = [sys.executable, "-m", "elmokit", "serve", "--model", str(model), "--port", "0", "--device", "cpu",
                "--threads", "1", *arguments, *(["--api-key", api_key] if api_key else [])]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.stderr: list[str] = []  # every line the server writes there, read as it comes (the pipe never fills)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_stderr, args=(lines,), daemon=True).start()
        try:
            first = lines.get(timeout=START_LIMIT)
        except queue.Empty:
            self.stop()
            raise RuntimeError(f"elmo serve printed no address in {START_LIMIT} s; its log:\n{''.join(self.stderr)}") from None
        if not first.startswith("listening on http://"):
            self.stop()
            raise RuntimeError(f"elmo serve did not start (exit {self.process.poll()}); its log:\n{''.join(self.stderr)}")
        self.url = first.split()[2]
        self.host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        deadline = time.monotonic() + START_LIMIT
        while self.call("GET", "/health", key=None)[0] != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("elmo serve never became healthy")
            time.sleep(0.05)

    def _read_stderr(self, lines: queue.Queue) -> None:
        """(A thread.) Keep the server's stderr; hand over its `listening on` line (or its last)."""
        for line in self.process.stderr:
            self.stderr.append(line)
            if line.startswith("listening on http://"):
                lines.put(line)
        lines.put("")

    def call(self, method: str, path: str, body=None, *, raw: bytes | None = None, key: str | None = "default",
             headers: dict | None = None, chunked: bool = False, timeout: float = 60):
        """(status, JSON or text, headers) of one request on a fresh connection; `body` is sent as
        JSON, `raw` as it is; `key` defaults to the server's."""
        key = self.api_key if key == "default" else key
        sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
                **(headers or {})}
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            if chunked:
                connection.request(method, path, body=iter([data]), headers=sent, encode_chunked=True)
            else:
                connection.request(method, path, body=data, headers=sent)
            response = connection.getresponse()
            payload = response.read()
        except ConnectionError:
            return 0, None, {}
        finally:
            connection.close()
        kind = response.getheader("Content-Type", "")
        value = json.loads(payload) if kind.startswith("application/json") else payload.decode()
        return response.status, value, dict(response.getheaders())

    def metric(self, name: str) -> float:
        """The value of one sample of /metrics (a name with its labels, as Prometheus writes it)."""
        for line in self.call("GET", "/metrics")[1].splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.stdout = self.process.stdout.read()  # what it wrote there (nothing: its messages go to stderr)
        self.process.stdout.close()
        return self.process.returncode
