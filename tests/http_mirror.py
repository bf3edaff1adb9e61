"""A real HTTP server on 127.0.0.1 that serves a folder, for the download tests (tests never reach
the internet): set it as ELMOKIT_MIRROR and the published URLs are fetched from it.

    with MirrorServer(folder, break_first=(".hdf5",)) as server:
        os.environ["ELMOKIT_MIRROR"] = server.url
        ...
        server.requests   # [(path, status, bytes sent)], in order, each recorded before it is
                          # answered (a client that has its answer finds it there); -1 bytes: the
                          # client hung up before the body was sent

A file whose name ends with one of `break_first` gets a first response that announces its whole
length and breaks off halfway (the connection closed), as a dropped connection does. `dribble`
sends every body one byte at a time, that many seconds apart (a server that stalls without going
silent); `routes` answers a path (query included) with a fixed status, headers and body (an HTTP
error, a gzip bomb).

    pin(monkeypatch, root, "small")   # the published sizes and SHA-256 of `small` become those
                                      # of the files under root (a world where they are published)
"""

from __future__ import annotations

import hashlib
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import urlsplit

from tests.local_server import LocalServer


def pin(monkeypatch, root: Path, name: str) -> None:
    """Make the files a mirror folder holds for the published `name` the published ones: their
    sizes and SHA-256 are pinned in `elmokit.sources.published.PUBLISHED_FILES` for this test."""
    from elmokit.sources.download import Expected
    from elmokit.sources import published

    files = dict(published.PUBLISHED_FILES)
    for url in (published.PUBLISHED[name].options_url, published.PUBLISHED[name].weight_url):
        data = (Path(root) / urlsplit(url).path.lstrip("/")).read_bytes()
        files[url] = Expected(len(data), hashlib.sha256(data).hexdigest(), "pinned by the test")
    monkeypatch.setattr(published, "PUBLISHED_FILES", files)


class MirrorServer(LocalServer):
    def __init__(self, root: Path, break_first: tuple[str, ...] = (), delay: float = 0.0, dribble: float = 0.0,
                 routes: dict[str, tuple[int, dict[str, str], bytes]] | None = None):
        self.root = Path(root)
        self.break_first = break_first
        self.delay = delay
        self.dribble = dribble
        self.routes = routes or {}
        self.requests: list[tuple[str, int, int]] = []
        self._broken: set[str] = set()
        self._lock = threading.Lock()
        self._listen()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                if self.path in server.routes:
                    status, headers, body = server.routes[self.path]
                    server._record(self.path, status, len(body))
                    self.send_response(status)
                    for key, value in {"Content-Length": str(len(body)), **headers}.items():
                        self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(body)
                    return
                path = server.root / self.path.split("?")[0].lstrip("/")
                if not path.is_file() or ".." in self.path:
                    server._record(self.path, 404, 0)
                    self.send_error(404)
                    return
                data = path.read_bytes()
                with server._lock:
                    breaks = path.name.endswith(server.break_first) and self.path not in server._broken
                    if breaks:
                        server._broken.add(self.path)
                sent = len(data) // 2 if breaks else len(data)
                record = server._record(self.path, 200, sent)
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                time.sleep(server.delay)
                try:
                    if server.dribble:
                        for index in range(sent):
                            self.wfile.write(data[index:index + 1])
                            self.wfile.flush()
                            time.sleep(server.dribble)
                    else:
                        self.wfile.write(data[:sent])
                        self.wfile.flush()
                except OSError:  # the client gave up
                    with server._lock:
                        server.requests[record] = (self.path, 200, -1)
                if breaks:
                    self.close_connection = True

        return Handler

    def _record(self, path: str, status: int, sent: int) -> int:
        """Record a request before it is answered; its place in `requests`."""
        with self._lock:
            self.requests.append((path, status, sent))
            return len(self.requests) - 1
