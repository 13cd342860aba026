"""A local fake Hugging Face hub: the endpoints ``huggingface_hub`` calls, over plain HTTP.

Serves model repos held in memory (a tiny model directory from
``tests/support/tinymodels.py`` read into one, typically) so ``mlxd pull``,
``[model] repo = …`` and the dashboard's downloads are tested through
``HF_ENDPOINT`` with the real ``huggingface_hub`` (2.x), never the internet.

What it answers, as the real hub does (read from ``huggingface_hub``'s own
``hf_api.py``, ``file_download.py`` and ``utils/_http.py``):

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}``
  (``HfApi.model_info``/``repo_info``): id, sha, siblings (with sizes, blob ids
  and LFS info when ``?blobs=true``), ``gated``, ``private``;
- ``GET /api/models/{repo}/tree/{rev}`` (``list_repo_tree``, the listing
  ``snapshot_download`` and ``verify_repo_checksums`` read): files with
  ``oid`` (the git blob sha1), ``size`` and, for ``*.safetensors``, an
  ``lfs`` record (sha256, size, pointer size);
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: ``X-Repo-Commit``,
  ``ETag`` (git sha1, or sha256 for LFS files with ``X-Linked-Etag`` and
  ``X-Linked-Size``), ``Content-Length``, ``Accept-Ranges``; a ``Range:
  bytes=N-`` GET answers 206 with ``Content-Range``;
- errors with the ``X-Error-Code`` header ``hf_raise_for_status`` reads: 404
  ``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``; 401
  ``GatedRepo`` for a gated repo asked without its token.

``throttle`` (bytes per second) slows file bodies so a test sees a
download in progress; ``served`` counts file-body bytes sent per path and
``requests`` records every request (method, path, Range header).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

CHUNK = 16 * 1024


@dataclass
class FakeRepo:
    """One model repo: its files by path, its commit, and who may read it."""

    files: dict[str, bytes]
    sha: str = ""
    gated_token: str | None = None  # set: a gated repo, readable with this token only

    def __post_init__(self) -> None:
        if not self.sha:
            digest = hashlib.sha1()
            for name in sorted(self.files):
                digest.update(name.encode() + b"\0" + self.files[name])
            self.sha = digest.hexdigest()

    @staticmethod
    def lfs(name: str) -> bool:
        return name.endswith(".safetensors")

    @staticmethod
    def git_oid(data: bytes) -> str:
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def etag(self, name: str) -> str:
        data = self.files[name]
        return hashlib.sha256(data).hexdigest() if self.lfs(name) else self.git_oid(data)

    def tree_entry(self, name: str) -> dict[str, Any]:
        data = self.files[name]
        entry: dict[str, Any] = {
            "type": "file",
            "oid": self.git_oid(data),
            "size": len(data),
            "path": name,
        }
        if self.lfs(name):
            entry["lfs"] = {
                "oid": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "pointerSize": 134,
            }
        return entry


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    sent: int = 0  # file-body bytes sent in answer


@dataclass
class FakeHub:
    """The server's state: repos, throttle, and what was asked and sent."""

    repos: dict[str, FakeRepo] = field(default_factory=dict)
    throttle: float | None = None  # bytes per second of file bodies; None: full speed
    requests: list[Request] = field(default_factory=list)
    served: dict[str, int] = field(default_factory=dict)
    url: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add_dir(self, repo_id: str, directory: Path, **kw: Any) -> FakeRepo:
        """Serve every file of ``directory`` as the repo ``repo_id``."""
        files = {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}
        repo = FakeRepo(files, **kw)
        self.repos[repo_id] = repo
        return repo

    def add_dir_files(self, repo_id: str, files: dict[str, bytes], **kw: Any) -> FakeRepo:
        """Serve ``files`` (name -> bytes) as the repo ``repo_id``."""
        repo = FakeRepo(dict(files), **kw)
        self.repos[repo_id] = repo
        return repo

    def bytes_served(self, suffix: str = "") -> int:
        """File-body bytes sent so far, for paths ending in ``suffix``."""
        with self._lock:
            return sum(n for p, n in self.served.items() if p.endswith(suffix))

    def weight_gets(self) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith(".safetensors")]

    def _count(self, path: str, n: int) -> None:
        with self._lock:
            self.served[path] = self.served.get(path, 0) + n


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_HEAD(self) -> None:
            self._route(head=True)

        def do_GET(self) -> None:
            self._route(head=False)

        # ------------------------------------------------------------ routing

        def _route(self, *, head: bool) -> None:
            parts = urlsplit(self.path)
            path = unquote(parts.path)
            query = parse_qs(parts.query)
            self.record = Request(self.command, path, self.headers.get("Range"))
            hub.requests.append(self.record)
            if path.startswith("/api/models/"):
                self._api(path.removeprefix("/api/models/"), query)
            elif "/resolve/" in path:
                repo_id, _, rest = path.lstrip("/").partition("/resolve/")
                revision, _, name = rest.partition("/")
                self._file(repo_id, revision, name, head=head)
            else:
                self._error(404, "RepoNotFound", "Not found")

        def _repo(self, repo_id: str, revision: str) -> FakeRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
                return None
            if repo.gated_token is not None:
                auth = self.headers.get("Authorization", "")
                if auth != f"Bearer {repo.gated_token}":
                    self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted.")
                    return None
            if revision not in ("main", repo.sha):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return None
            return repo

        def _api(self, rest: str, query: dict[str, list[str]]) -> None:
            if "/tree/" in rest:
                repo_id, _, revision = rest.partition("/tree/")
                revision = revision.split("/")[0]
                repo = self._repo(repo_id, revision)
                if repo is not None:
                    self._json([repo.tree_entry(n) for n in sorted(repo.files)])
                return
            repo_id, _, revision = rest.partition("/revision/")
            repo = self._repo(repo_id, revision or "main")
            if repo is None:
                return
            blobs = query.get("blobs", ["false"])[0].lower() == "true"
            siblings = []
            for name in sorted(repo.files):
                sib: dict[str, Any] = {"rfilename": name}
                if blobs:
                    entry = repo.tree_entry(name)
                    sib.update(size=entry["size"], blobId=entry["oid"])
                    if "lfs" in entry:
                        sib["lfs"] = {
                            "sha256": entry["lfs"]["oid"],
                            "size": entry["size"],
                            "pointerSize": 134,
                        }
                siblings.append(sib)
            self._json(
                {
                    "id": repo_id,
                    "modelId": repo_id,
                    "sha": repo.sha,
                    "private": False,
                    "gated": "auto" if repo.gated_token else False,
                    "siblings": siblings,
                    "tags": ["mlx"],
                }
            )

        def _file(self, repo_id: str, revision: str, name: str, *, head: bool) -> None:
            repo = self._repo(repo_id, revision)
            if repo is None:
                return
            data = repo.files.get(name)
            if data is None:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("X-Repo-Commit", repo.sha)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start = 0
            ranged = self.headers.get("Range")
            if ranged and not head:
                start = int(ranged.removeprefix("bytes=").split("-")[0] or 0)
            body = data[start:]
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", repo.sha)
            etag = repo.etag(name)
            self.send_header("ETag", f'"{etag}"')
            if repo.lfs(name):
                self.send_header("X-Linked-Etag", f'"{etag}"')
                self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Accept-Ranges", "bytes")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if head:
                return
            try:
                for at in range(0, len(body), CHUNK):
                    chunk = body[at : at + CHUNK]
                    self.wfile.write(chunk)
                    self.wfile.flush()
                    hub._count(name, len(chunk))
                    self.record.sent += len(chunk)
                    if hub.throttle:
                        time.sleep(len(chunk) / hub.throttle)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        # ------------------------------------------------------------ answers

        def _json(self, value: Any) -> None:
            body = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: int, code: str, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

    return Handler


@contextmanager
def running_hub(hub: FakeHub | None = None) -> Iterator[FakeHub]:
    """A :class:`FakeHub` serving on a free loopback port until the block ends."""
    hub = hub or FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="fakehub", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
