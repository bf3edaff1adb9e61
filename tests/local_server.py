"""What the tests' HTTP servers share: a `ThreadingHTTPServer` on 127.0.0.1 (a free port), served
from a daemon thread while a `with` block runs. Each server (tests/http_mirror.py, hub_server.py,
hostile_http.py) subclasses it with its own handler and state (tests never reach the internet)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LocalServer:
    """Call `_listen()` at the end of a subclass's `__init__`, once `_handler()` can be built."""

    def _listen(self, block_on_close: bool = True) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.block_on_close = block_on_close  # False: a request still answering ends with its client
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        raise NotImplementedError

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
