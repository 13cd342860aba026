"""Uploads that leave nothing (issue 34, N10), and the Batch API's small protocol points.

An upload whose client goes away mid-body leaves no file in the spool folder and
no open descriptor, at once (not when garbage collection gets to it), and is
logged 499, not 500. An unauthenticated upload's 401 does not wait for the body.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from tests.support.daemon import toml_config

KEY = "sk-upload-test"
BOUNDARY = "b0undary"


@pytest.fixture(scope="module")
def daemon(apps, tiny_models):
    config = toml_config(
        model={"path": str(tiny_models("llama")), "name": "tiny"},
        server={"api_keys": [KEY]},
        batches={"max_file_bytes": "8MiB", "upload_timeout": 10.0},
    )
    return apps.get(config)


def files_dir(daemon) -> Path:
    return Path(daemon.state.settings.server.state_dir).expanduser() / "batches" / "files"


def spool_fds(folder: Path) -> list[str]:
    """This process's open descriptors on files in ``folder`` (deleted ones included)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)):
            out.append(target)
    return out


def upload_head(size: int, key: str | None = KEY) -> bytes:
    body_head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}"
        f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
        f"Content-Length: {len(body_head) + size}\r\n\r\n"
    ).encode() + body_head


def test_aborted_uploads_leave_no_file_and_no_descriptor(daemon):
    folder = files_dir(daemon)
    before = set(os.listdir(folder))
    log_before = daemon.log()
    line = b'{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    for _ in range(10):
        with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
            sock.sendall(upload_head(6 << 20))
            for _ in range(40):  # 300 KB of the promised 6 MiB, then gone
                sock.sendall(line * 100)
            time.sleep(0.05)
    deadline = time.monotonic() + 5
    left, fds, logged = {""}, [""], 0
    while time.monotonic() < deadline:
        left, fds = set(os.listdir(folder)) - before, spool_fds(folder)
        logged = daemon.log()[len(log_before) :].count("POST /v1/files 499")
        if not left and not fds and logged == 10:
            break
        time.sleep(0.05)
    assert not left and not fds, (left, fds)
    tail = daemon.log()[len(log_before) :]
    assert logged == 10, tail
    assert "POST /v1/files 500" not in tail


def test_an_unauthenticated_upload_is_closed_at_once(daemon):
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
        sock.sendall(upload_head(6 << 20, key="sk-wrong"))
        started = time.monotonic()
        chunks = [sock.recv(65536)]
        while chunks[-1]:  # the server closes the connection after its answer
            chunks.append(sock.recv(65536))
        waited = time.monotonic() - started
    answer = b"".join(chunks).decode()
    assert answer.startswith("HTTP/1.1 401"), answer
    assert "connection: close" in answer.lower()
    assert waited < 5, waited


def test_a_cancel_without_a_content_type_works(daemon):
    with daemon.client(headers={"Authorization": f"Bearer {KEY}"}) as http:
        # Long enough to be running still when the cancel comes.
        files = {
            "file": ("a.jsonl", b"".join(_one_line(i) for i in range(20)), "application/jsonl")
        }
        uploaded = http.post("/v1/files", data={"purpose": "batch"}, files=files).json()
        batch = http.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        ).json()
    # curl -X POST with no body and no Content-Type
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as sock:
        sock.sendall(
            f"POST /v1/batches/{batch['id']}/cancel HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {KEY}\r\nConnection: close\r\n\r\n".encode()
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 200"), answer
    assert '"status":"cancelling"' in body.replace(" ", "") or '"cancelled"' in body


def test_a_finalizing_batch_is_not_cancelled(daemon):
    from mlxd.api.batches.service import service
    from mlxd.api.batches.store import BatchRow
    from mlxd.api.http.keys import key_digest

    batches = service(daemon.state)
    row = BatchRow(
        *("batch_finalizing0", key_digest(KEY), "/v1/chat/completions", "file-x", "24h"),
        status="finalizing",
        **dict.fromkeys(("metadata", "errors", "output_file_id", "error_file_id"), None),
        total=3,
        completed=3,
        failed=0,
        created_at=1,
        expires_at=None,
        in_progress_at=1,
        finalizing_at=2,
        **dict.fromkeys(("completed_at", "failed_at", "expired_at"), None),
        **dict.fromkeys(("cancelling_at", "cancelled_at"), None),
    )
    batches.store._pool.submit(batches.store.add_batch, row).result()
    with daemon.client(headers={"Authorization": f"Bearer {KEY}"}) as http:
        r = http.post(f"/v1/batches/{row.id}/cancel", json={})
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "batch_not_cancellable" and "'finalizing'" in error["message"]


def _one_line(i: int = 0) -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 256}
    line = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    return (json.dumps(line) + "\n").encode()
