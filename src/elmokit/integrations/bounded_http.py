"""One HTTP exchange with a server this process does not control, bounded in time, in size and in
where it may lead: the client side of `elmokit.integrations.texts` (stdlib only).

- **Time.** The whole exchange (connecting, sending, each redirect, the headers, the body) ends
  within `timeout` seconds: every read waits at most the time left. A socket timeout alone bounds
  each read, so a server sending a byte at a time could hold a call for ever.
- **Size.** At most `max_bytes` of an answer are read; a longer one, announced or streamed, is an
  error (`AnswerTooLarge`), never a growing buffer.
- **Redirects.** 301, 302, 303, 307 and 308, at most `MAX_REDIRECTS`, and only to http(s)
  addresses. The `Authorization` header goes only to the origin (scheme, host, port) it was given
  for: a redirect to another origin is followed without it, as requests does, and it is not sent
  again after that. 307 and 308 repeat the method and body; the others become a GET without
  body, as urllib and requests make them.
"""

from __future__ import annotations

import http.client
import io
import time
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

MAX_REDIRECTS = 5
REDIRECTS = frozenset({301, 302, 303, 307, 308})
CHUNK_BYTES = 1 << 16  # what one read asks the socket for


class AnswerTooLarge(RuntimeError):
    """An answer longer than the bytes the caller allowed for it."""


@dataclass(frozen=True)
class Answer:
    url: str  # the address that answered, after any redirects
    status: int
    body: bytes


def exchange(method: str, url: str, body: bytes | None, headers: dict[str, str], *, timeout: float,
             max_bytes: int) -> Answer:
    """The final answer to `method url` (after redirects), its body at most `max_bytes`.

    Raises TimeoutError past `timeout` seconds in all, AnswerTooLarge, RuntimeError for a redirect
    refused (not http(s), or more than MAX_REDIRECTS), OSError or http.client.HTTPException when
    the server cannot be reached or breaks the protocol."""
    deadline = time.monotonic() + timeout
    headers = dict(headers)
    for _ in range(MAX_REDIRECTS + 1):
        status, location, data = _once(method, url, body, headers, deadline, max_bytes)
        if status not in REDIRECTS or location is None:
            return Answer(url, status, data)
        target = urljoin(url, location)
        if urlsplit(target).scheme not in ("http", "https"):
            raise RuntimeError(f"{url} redirected to {target!r}: only redirects to http(s) addresses are followed")
        if _origin(target) != _origin(url):
            headers = {key: value for key, value in headers.items() if key.lower() != "authorization"}
        if status not in (307, 308):
            method, body = "GET", None
            headers = {key: value for key, value in headers.items() if key.lower() != "content-type"}
        url = target
    raise RuntimeError(f"{url}: more than {MAX_REDIRECTS} redirects")


def _origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) address, the port made explicit."""
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80)


def _once(method: str, url: str, body: bytes | None, headers: dict[str, str], deadline: float,
          max_bytes: int) -> tuple[int, str | None, bytes]:
    """(status, Location of a redirect or None, body) of one request on a fresh connection."""
    parts = urlsplit(url)
    kind = _DeadlineHTTPS if parts.scheme == "https" else _DeadlineHTTP
    connection = kind(parts.hostname or "", parts.port, deadline=deadline)
    try:
        connection.request(method, (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), body=body,
                           headers=headers)
        response = connection.getresponse()
        if response.status in REDIRECTS:
            return response.status, response.getheader("Location"), b""
        return response.status, None, _read_capped(response, url, max_bytes)
    finally:
        connection.close()


def _read_capped(response: http.client.HTTPResponse, url: str, max_bytes: int) -> bytes:
    """The body, refused (AnswerTooLarge) as soon as it is known to pass `max_bytes`."""
    announced = response.getheader("Content-Length")
    if announced is not None and announced.strip().isdigit() and int(announced) > max_bytes:
        raise AnswerTooLarge(f"{url} announced an answer of {int(announced):,} bytes: more than the "
                             f"{max_bytes:,} expected at most")
    data = bytearray()
    while chunk := response.read(min(CHUNK_BYTES, max_bytes + 1 - len(data))):
        data += chunk
        if len(data) > max_bytes:
            raise AnswerTooLarge(f"{url} sent an answer longer than the {max_bytes:,} bytes expected at most")
    return bytes(data)


def _left(deadline: float) -> float:
    """Seconds left before `deadline`; TimeoutError once there are none."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the time given for the request ran out")
    return left


class _DeadlineReader(io.RawIOBase):
    """The socket's reader, each read waiting at most the time left before the deadline."""

    def __init__(self, sock, deadline: float):
        super().__init__()
        self._sock, self._raw, self._deadline = sock, sock.makefile("rb", buffering=0), deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int | None:
        self._sock.settimeout(_left(self._deadline))
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineSocket:
    """A connected socket whose sends and reads (through `makefile`, as http.client reads) end
    by the deadline; everything else is the socket's own."""

    def __init__(self, sock, deadline: float):
        self._sock, self._deadline = sock, deadline

    def sendall(self, data) -> None:
        self._sock.settimeout(_left(self._deadline))  # sendall's timeout bounds the whole send
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args, **kwargs):
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


class _Deadline:
    """Connects within the time left, then reads and sends by the deadline. (A TLS handshake
    waits at most the time left at its start for each of its reads.)"""

    def __init__(self, host: str, port: int | None, *, deadline: float):
        super().__init__(host, port, timeout=_left(deadline))
        self.deadline = deadline

    def connect(self) -> None:
        self.timeout = _left(self.deadline)
        super().connect()
        self.sock = _DeadlineSocket(self.sock, self.deadline)


class _DeadlineHTTP(_Deadline, http.client.HTTPConnection):
    pass


class _DeadlineHTTPS(_Deadline, http.client.HTTPSConnection):
    pass
