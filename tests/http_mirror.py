"""A real HTTP server on 127.0.0.1 that serves a folder, for the download tests (tests never reach
the internet): set it as ELMOKIT_MIRROR and the published URLs are fetched from it.

    with MirrorServer(folder, break_first=(".hdf5",)) as server:
        os.environ["ELMOKIT_MIRROR"] = server.url
        ...
        server.requests   # [(path, status, bytes sent)], in order

A file whose name ends with one of `break_first` gets a first response that announces its whole
length and breaks off halfway (the connection closed), as a dropped connection does.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class MirrorServer:
    def __init__(self, root: Path, break_first: tuple[str, ...] = (), delay: float = 0.0):
        self.root = Path(root)
        self.break_first = break_first
        self.delay = delay
        self.requests: list[tuple[str, int, int]] = []
        self._broken: set[str] = set()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "MirrorServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                import time

                path = server.root / self.path.split("?")[0].lstrip("/")
                if not path.is_file() or ".." in self.path:
                    self.send_error(404)
                    with server._lock:
                        server.requests.append((self.path, 404, 0))
                    return
                data = path.read_bytes()
                with server._lock:
                    breaks = path.name.endswith(server.break_first) and self.path not in server._broken
                    if breaks:
                        server._broken.add(self.path)
                sent = len(data) // 2 if breaks else len(data)
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                time.sleep(server.delay)
                self.wfile.write(data[:sent])
                self.wfile.flush()
                if breaks:
                    self.close_connection = True
                with server._lock:
                    server.requests.append((self.path, 200, sent))

        return Handler
