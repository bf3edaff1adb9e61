"""tests/http_mirror.py itself: a request is in `server.requests` before its answer is sent, so a
test that has read its answer finds it there (no race with the server's thread)."""

from __future__ import annotations

import urllib.error
import urllib.request

from tests.http_mirror import MirrorServer


def test_a_request_is_recorded_before_it_is_answered(tmp_path):
    """`dribble` pauses after every byte, the last one too: a server recording after its answer
    would still be pausing when the client, its answer whole, looks."""
    (tmp_path / "file.bin").write_bytes(b"ab")
    with MirrorServer(tmp_path, dribble=1.5) as server:
        with urllib.request.urlopen(server.url + "/file.bin", timeout=30) as response:
            assert response.read() == b"ab"
        assert server.requests == [("/file.bin", 200, 2)]
        try:
            urllib.request.urlopen(server.url + "/missing", timeout=30)
        except urllib.error.HTTPError as error:
            assert error.code == 404
        assert server.requests[1:] == [("/missing", 404, 0)]
