"""A batch survives its daemon: SIGTERM and ``kill -9`` mid-batch, then a restart finishes it.

After both restarts the batch completes with exactly one output line per
input line (no duplicates, none lost), each equal to the direct call's
answer, and each restart took up the lines already done rather than
starting over. A corrupt database is set aside with a warning at start.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import Daemon, toml_config

LINES = 30


def _config(tiny_models) -> str:
    return toml_config(
        model={"path": str(tiny_models("llama")), "name": "tiny"},
        batch={"size": 4},
        server={"shutdown_timeout": 20.0},
    )


def _line(i: int) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"Write a long story about the number {i}."}],
        "max_tokens": 48,
        "temperature": 0,
    }
    return {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def _done(daemon: Daemon, batch_id: str) -> tuple[str, int]:
    batch = daemon.openai().batches.retrieve(batch_id)
    counts = batch.request_counts
    return batch.status, (counts.completed + counts.failed) if counts else 0


def _wait_for(daemon: Daemon, batch_id: str, at_least: int, timeout: float = 180) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, done = _done(daemon, batch_id)
        if done >= at_least or status not in ("in_progress", "validating"):
            return done
        time.sleep(0.05)
    raise AssertionError(f"{batch_id} did not reach {at_least} lines:\n{daemon.log()[-3000:]}")


def _resumed(daemon: Daemon, batch_id: str) -> list[int]:
    return [
        int(n) for n in re.findall(rf"batch {batch_id}: resumed \w+ \((\d+) lines", daemon.log())
    ]


def _start_upload(daemon: Daemon, sent: int) -> socket.socket:
    """A ``POST /v1/files`` that has sent ``sent`` bytes of a body twice as long."""
    boundary = "kill9"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    request = (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
        f"Content-Length: {len(head) + 2 * sent}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
    sock.sendall(request + head + json.dumps(_line(0)).encode() * (sent // 200))
    time.sleep(0.5)  # the daemon reads and spools it
    return sock


def test_a_batch_survives_sigterm_and_kill_9(tmp_path: Path, tiny_models):
    config = _config(tiny_models)
    daemon = Daemon(tmp_path, config).start()
    client = daemon.openai()
    data = b"".join(json.dumps(_line(i)).encode() + b"\n" for i in range(LINES))
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    try:
        before_term = _wait_for(daemon, batch.id, 5)
        assert before_term < LINES, "the batch finished before the SIGTERM: make it longer"
        assert daemon.stop() == 0

        daemon = Daemon(tmp_path, config).start()
        resumed = _resumed(daemon, batch.id)
        assert resumed and resumed[-1] >= before_term
        before_kill = _wait_for(daemon, batch.id, resumed[-1] + 5)
        assert before_kill < LINES, "the batch finished before the kill: make it longer"
        assert daemon.proc is not None
        # An upload under way when the process dies leaves no file behind (issue 34, N10).
        uploading = _start_upload(daemon, 1 << 20)
        daemon.proc.kill()
        daemon.proc.wait(10)
        uploading.close()
        daemon.stop()
        files = tmp_path / "state" / "batches" / "files"
        assert [p.name for p in files.iterdir() if not p.name.startswith("file-")] == []

        daemon = Daemon(tmp_path, config).start()
        assert [p.name for p in files.iterdir() if not p.name.startswith("file-")] == []
        after_kill = _resumed(daemon, batch.id)[-1]
        print(
            f"\nlines done: {before_term}+ at SIGTERM, {resumed[-1]} resumed; "
            f"{before_kill}+ at kill -9, {after_kill} resumed"
        )
        assert after_kill >= before_kill
        _wait_for(daemon, batch.id, LINES)
        client = daemon.openai()
        deadline = time.monotonic() + 60
        while (done := client.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < deadline, done
            time.sleep(0.1)
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0)
        output = [
            json.loads(x) for x in client.files.content(done.output_file_id).text.split("\n") if x
        ]
        assert len(output) == LINES
        assert [o["custom_id"] for o in output] == [f"line-{i}" for i in range(LINES)]
        with daemon.client() as http:
            for i in (0, LINES // 2, LINES - 1):
                direct = http.post("/v1/chat/completions", json=_line(i)["body"]).json()
                got = output[i]["response"]["body"]
                assert got["choices"] == direct["choices"]
    finally:
        daemon.stop()


def test_a_corrupt_database_or_input_file_is_a_warning_not_a_crash(tmp_path: Path, tiny_models):
    state = tmp_path / "state" / "batches"
    state.mkdir(parents=True)
    (state / "batches.db").write_bytes(b"this is not an SQLite database" * 100)
    daemon = Daemon(tmp_path, _config(tiny_models)).start()
    try:
        assert "batch database" in daemon.log() and "unusable" in daemon.log()
        assert list(state.glob("batches.db.unusable-*"))
        client = daemon.openai()
        data = b"".join(json.dumps(_line(i)).encode() + b"\n" for i in range(3))
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        assert client.files.retrieve(uploaded.id).id == uploaded.id
        # The input file damaged on disk after its upload: its batch fails, nothing runs.
        body = state / "files" / f"{uploaded.id}.jsonl"
        body.write_bytes(data[: len(data) // 2])
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 30
        while (got := client.batches.retrieve(batch.id)).status == "validating":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert got.status == "failed" and got.errors is not None
        assert got.errors.data[0].code == "file_corrupt"
    finally:
        daemon.stop()


def test_a_batch_on_a_path_less_demo_entry_resumes_after_a_restart(tmp_path: Path, tiny_models):
    """Issue 33 item 1: an unloaded demo entry (no ``path``) fits, so its lines start.

    The batch waits outside ``[batches] hours`` in the first daemon; the second
    (no hours) must run it on the demo embedding model, which is not loaded.
    """
    pytest.importorskip("mlx_embeddings")
    now = dt.datetime.now()
    later = f"{(now + dt.timedelta(hours=2)):%H:%M}-{(now + dt.timedelta(hours=3)):%H:%M}"
    models = {"chat": {"path": str(tiny_models("llama"))}, "minilm": {"kind": "embedding"}}
    daemon = Daemon(tmp_path, toml_config(models=models, batches={"hours": later})).start()
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "minilm", "input": f"line {i}"},
        }
        for i in range(3)
    ]
    try:
        client = daemon.openai()
        data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        assert _done(daemon, batch.id)[1] == 0
    finally:
        assert daemon.stop() == 0
    daemon = Daemon(tmp_path, toml_config(models=models)).start()
    try:
        assert _wait_for(daemon, batch.id, 3, timeout=60) == 3, daemon.log()[-2000:]
        (minilm,) = [m for m in daemon.stats()["fleet"]["models"] if m["id"] == "minilm"]
        assert minilm["path"] is None and minilm["load_bytes"] > 0
        assert _done(daemon, batch.id) == ("completed", 3) or _wait_completed(daemon, batch.id)
    finally:
        daemon.stop()


def _wait_completed(daemon: Daemon, batch_id: str) -> bool:
    deadline = time.monotonic() + 30
    while _done(daemon, batch_id)[0] != "completed":
        assert time.monotonic() < deadline, _done(daemon, batch_id)
        time.sleep(0.1)
    return True
