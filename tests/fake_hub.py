"""A tiny stand-in for the Hugging Face Hub's HTTP endpoints, so that `mtplxd pull`
runs the real huggingface_hub client code (HF_ENDPOINT=hub.url) without a network.

It serves each repository folder it was given at one commit, through the endpoints
`snapshot_download` uses: repository info, the tree listing, HEAD and GET of
`/{repo}/resolve/{rev}/{file}` (with Range support). Faults can be injected per
file: `drop_once` cuts the connection 1 MB before the end of the first GET (the
client must resume with a Range request); `fail` answers 500 to every GET.

    with FakeHub({"org/tiny": folder}) as hub:
        env["HF_ENDPOINT"] = hub.url
        ...
        hub.requests  # [(method, path, range header or None), ...]
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, Path]):
        self.repos = {repo: Path(folder) for repo, folder in repos.items()}
        self.drop_once: set[str] = set()
        self.fail: set[str] = set()
        self.requests: list[tuple[str, str, str | None]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def gets(self, filename: str) -> list[str | None]:
        """The Range headers of every GET of one file (None: a full GET)."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith(f"/resolve/{COMMIT}/{filename}")]

    def files(self, repo: str) -> dict[str, bytes]:
        folder = self.repos[repo]
        return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet test output
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path):
                if m.group(1) in hub.repos and m.group(2) not in ("main", COMMIT):
                    return self._error(404, "RevisionNotFound")
                return self._info(m.group(1))
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path):
                return self._tree(m.group(1))
            if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                return self._file(m.group(1), m.group(3), body)
            self._error(404, "EntryNotFound")

        def _info(self, repo: str) -> None:
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            siblings = [{"rfilename": name} for name in hub.files(repo)]
            self._json({"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings})

        def _tree(self, repo: str) -> None:
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            entries = [{"type": "file", "path": name, "size": len(data), "oid": _etag(data)}
                       for name, data in hub.files(repo).items()]
            self._json(entries)

        def _file(self, repo: str, name: str, body: bool) -> None:
            files = hub.files(repo) if repo in hub.repos else {}
            if name not in files:
                return self._error(404, "EntryNotFound" if files else "RepoNotFound")
            if body and name in hub.fail:
                return self._error(500, None)
            data, start = files[name], _range_start(self.headers.get("Range"))
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{_etag(data)}"')
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            if name in hub.drop_once:
                hub.drop_once.discard(name)
                # Cut 1 MB before the end (half-way in a small file), past the client's
                # first 10 MB chunk in a large one, so there is something to resume from.
                self.wfile.write(data[: max(len(data) // 2, len(data) - (1 << 20))])
                self.wfile.flush()
                self.close_connection = True  # the client sees a body cut short
                return
            self.wfile.write(data[start:])

        def _json(self, value) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, code: str | None) -> None:
            data = json.dumps({"error": code or "server error"}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _range_start(header: str | None) -> int:
    m = re.fullmatch(r"bytes=(\d+)-", header or "")
    return int(m.group(1)) if m else 0
