"""A stand-in for the Hugging Face Hub's HTTP API on 127.0.0.1, for the tests of `push_to_hub` and
`from_pretrained` (tests never reach the internet). It answers the few routes huggingface_hub's
own client uses to create a repository, commit files and download them, and keeps what it was
sent, so a test checks the requests the real client makes (which files, which bytes). It is no
evidence that huggingface.co accepts an upload: docs/integrations.md says so.

    with HubServer() as hub:
        hub.point_huggingface_hub_here(monkeypatch)   # what HF_ENDPOINT does, once huggingface_hub is imported
        bilm.push_to_hub("user/elmo")
        hub.repos["user/elmo"]   # {path: bytes} of the last commit
        hub.requests             # [(method, path)] in order

Routes (huggingface_hub 0.36's): POST /api/validate-yaml (the README's metadata block: kept, answered
"no error", NOT checked: the Hub's schema is the Hub's), POST /api/repos/create, POST /api/models/R/preupload/REV (every
file "regular": sent inline in the commit, not through LFS), POST /api/models/R/commit/REV (NDJSON),
GET /api/models/R/revision/REV, HEAD and GET /R/resolve/REV/PATH.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote, urlsplit

from tests.local_server import LocalServer


class HubServer(LocalServer):
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, str] = {}  # repo -> sha of its last commit
        self.requests: list[tuple[str, str]] = []
        self.validated: list[str] = []  # the README.md texts sent to /api/validate-yaml (answered "no error")
        self._listen()

    def point_huggingface_hub_here(self, monkeypatch) -> None:
        """Send huggingface_hub's requests here for this test, as HF_ENDPOINT set before its import
        does: its endpoint and the download URL template made from it on import."""
        from huggingface_hub import constants, file_download

        template = self.url + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(constants, "ENDPOINT", self.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        monkeypatch.setattr(file_download, "HUGGINGFACE_CO_URL_TEMPLATE", template)

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _answer(self, status: int, body: bytes = b"", headers: dict | None = None, kind="application/json"):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, value, status: int = 200):
                self._answer(status, json.dumps(value).encode())

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def do_POST(self):
                path = unquote(urlsplit(self.path).path)
                hub.requests.append(("POST", path))
                body = self._body()
                if path == "/api/validate-yaml":  # kept, not validated: only the Hub knows its schema
                    hub.validated.append(json.loads(body)["content"])
                    return self._json({"errors": [], "warnings": []})
                if path == "/api/repos/create":
                    request = json.loads(body)
                    repo = f"{request['organization']}/{request['name']}"
                    hub.repos.setdefault(repo, {})
                    return self._json({"url": f"{hub.url}/{repo}", "name": repo, "id": repo})
                match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit)/([^/]+)", path)
                if not match or match.group(1) not in hub.repos:
                    return self._json({"error": f"no route {path}"}, 404)
                repo, action = match.group(1), match.group(2)
                if action == "preupload":
                    files = json.loads(body)["files"]
                    return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                 for f in files]})
                files = {}
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    if item["key"] == "file":
                        assert item["value"]["encoding"] == "base64"
                        files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                hub.repos[repo] = files
                sha = hashlib.sha1(b"".join(k.encode() + v for k, v in sorted(files.items()))).hexdigest()
                hub.commits[repo] = sha
                return self._json({"commitUrl": f"{hub.url}/{repo}/commit/{sha}", "commitOid": sha})

            def do_HEAD(self):
                self.do_GET()

            def do_GET(self):
                path = unquote(urlsplit(self.path).path)
                hub.requests.append((self.command, path))
                match = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path)
                if match and match.group(1) in hub.commits:
                    repo = match.group(1)
                    return self._json({"id": repo, "modelId": repo, "sha": hub.commits[repo],
                                       "siblings": [{"rfilename": name} for name in sorted(hub.repos[repo])]})
                match = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if match and match.group(1) in hub.commits and match.group(3) in hub.repos[match.group(1)]:
                    data = hub.repos[match.group(1)][match.group(3)]
                    etag = hashlib.sha1(data).hexdigest()
                    return self._answer(200, data, {"X-Repo-Commit": hub.commits[match.group(1)], "ETag": f'"{etag}"'},
                                        kind="application/octet-stream")
                return self._answer(404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"})

        return Handler
