"""The Batch API's pure parts: the idle-time lane's rules, request lines, the store on disk.

No daemon, no model: the lane's room per model state, ``[batches] hours``
windows, line checks, and the SQLite store's migration, resume bookkeeping
and a corrupt database set aside.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sqlite3
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlxd.api.batches import runner as runner_module
from mlxd.api.batches.db import SCHEMA_VERSION, open_database
from mlxd.api.batches.jsonl import BadLine, check_lines, parse_line, request_lines
from mlxd.api.batches.lane import ChatLoad, chat_room, embedding_room, in_hours, may_load
from mlxd.api.batches.runner import Runner
from mlxd.api.batches.store import BatchRow, FileRow, Store
from mlxd.api.http.caller import caller_of
from mlxd.config import BatchesSettings, Settings
from mlxd.engine import FleetStatus

# ---------------------------------------------------------------- the lane


@pytest.mark.parametrize(
    ("load", "mine", "max_rows", "room"),
    [
        (ChatLoad(True, 0, 0, 4), 0, None, 3),  # idle: all but one row
        (ChatLoad(True, 3, 0, 4), 3, None, 0),  # ours fill what we may take
        (ChatLoad(True, 2, 0, 4), 1, None, 1),  # one interactive row: one left for us
        (ChatLoad(True, 3, 0, 4), 0, None, 0),  # interactive rows keep the last free
        (ChatLoad(True, 0, 1, 4), 0, None, 0),  # someone waits: nothing for batches
        (ChatLoad(False, 0, 0, 4), 0, None, 0),  # not ready
        (ChatLoad(True, 0, 0, 4), 0, 2, 2),  # max_rows caps
        (ChatLoad(True, 0, 0, 4), 0, 4, 4),  # the whole batch, when asked for
        (ChatLoad(True, 0, 0, 4), 0, 9, 4),  # never more than the batch
        (ChatLoad(True, 1, 0, 1), 0, None, 0),  # a serial model: only when idle
        (ChatLoad(True, 0, 0, 1), 0, None, 1),
        (ChatLoad(True, 1, 0, 1), 1, None, 0),
    ],
)
def test_chat_room(load: ChatLoad, mine: int, max_rows: int | None, room: int) -> None:
    assert chat_room(load, mine, max_rows) == room


def test_embedding_room_and_loading() -> None:
    assert embedding_room(True, 0, 0, 0) == 1
    assert embedding_room(True, 1, 0, 0) == embedding_room(True, 0, 1, 0) == 0
    assert embedding_room(True, 0, 0, 1) == embedding_room(False, 0, 0, 0) == 0
    assert may_load(100, 50, 0) and not may_load(100, 150, 0)
    assert not may_load(100, 50, 1) and not may_load(100, None, 0)


@pytest.mark.parametrize(
    ("hours", "now", "inside"),
    [
        (None, "12:00", True),
        ("22:00-07:00", "23:30", True),
        ("22:00-07:00", "06:59", True),
        ("22:00-07:00", "07:00", False),
        ("22:00-07:00", "12:00", False),
        ("09:00-17:00", "09:00", True),
        ("09:00-17:00", "17:00", False),
    ],
)
def test_hours_window(hours: str | None, now: str, inside: bool) -> None:
    assert in_hours(hours, dt.time.fromisoformat(now)) is inside


@pytest.mark.parametrize("bad", ["22-07", "25:00-07:00", "22:00-22:00", "10:00 - 11:00"])
def test_bad_hours_are_config_errors(bad: str) -> None:
    with pytest.raises(ValueError):
        BatchesSettings(hours=bad)


# ---------------------------------------------------------------- lines


def _line(custom_id: str = "a", **over: object) -> bytes:
    line = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": []},
        **over,
    }
    return json.dumps(line).encode() + b"\n"


def test_check_lines_counts_and_names_the_first_bad_line() -> None:
    lines = [_line("a"), b"\n", _line("b")]
    urls = [url for _, url in check_lines(lines, max_lines=5, max_line_bytes=1000)]
    assert urls == ["/v1/chat/completions", "", "/v1/chat/completions"]
    with pytest.raises(BadLine) as caught:
        list(check_lines([_line("a"), _line("a")], max_lines=5, max_line_bytes=1000))
    assert caught.value.line == 2 and "twice" in str(caught.value)
    with pytest.raises(BadLine, match="max_body_bytes"):
        list(check_lines([_line("a")], max_lines=5, max_line_bytes=10))
    with pytest.raises(BadLine, match="max_lines"):
        list(check_lines([_line("a"), _line("b")], max_lines=1, max_line_bytes=1000))


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"{", "not valid JSON"),
        (b"[]", "JSON object"),
        (_line(extra=1), "unknown field"),
        (_line(""), "custom_id"),
        (_line(method="GET"), "'method'"),
        (_line(url="/v1/messages"), "'url'"),
        (_line(body=[1]), "'body'"),
        (_line(body={"stream": True}), "stream"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_parse_line_refuses(raw: bytes, says: str) -> None:
    with pytest.raises(BadLine, match=says):
        parse_line(raw, 7)


def test_request_lines_number_from_zero_skipping_blanks() -> None:
    got = list(request_lines([_line("a"), b"  \n", _line("b")]))
    assert [(x.index, x.custom_id) for x in got] == [(0, "a"), (1, "b")]


# ---------------------------------------------------------------- the store


def test_store_keeps_results_once_and_survives_reopening(tmp_path: Path) -> None:
    async def run() -> None:
        store = Store(tmp_path / "batches")
        store.open()
        size, sha = await store.call(store.write_file, "file-x", [b"one\n", b"two\n"])
        assert store.file_path("file-x").read_bytes() == b"one\ntwo\n" and size == 8
        row = FileRow("file-x", None, "batch", "x.jsonl", size, 2, sha, 0)
        await store.call(store.add_file, row)
        assert await store.call(store.add_result, "batch_1", 0, True, "{}")
        assert not await store.call(store.add_result, "batch_1", 0, False, "{}")  # kept once
        assert await store.call(store.add_result, "batch_1", 1, False, "{}")
        store.close()
        again = Store(tmp_path / "batches")
        again.open()
        assert await again.call(again.get_file, "file-x") == row
        assert await again.call(again.done_lines, "batch_1") == {0, 1}
        counts = await again.call(again.counts, "batch_1")
        assert (counts.completed, counts.failed) == (1, 1)
        again.close()

    asyncio.run(run())


def test_a_corrupt_database_is_set_aside(tmp_path: Path, caplog) -> None:
    path = tmp_path / "batches.db"
    path.write_bytes(b"garbage" * 1000)
    conn = open_database(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()
    assert list(tmp_path.glob("batches.db.unusable-*"))
    assert "unusable" in caplog.text


def test_a_database_from_a_newer_mlxd_is_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "batches.db"
    newer = sqlite3.connect(path)
    newer.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    newer.close()
    open_database(path).close()
    assert list(tmp_path.glob("batches.db.unusable-*"))


# ---------------------------------------------------------------- the runner, in process


class _Fleet:
    """No configured model: every line routes nowhere, one at a time (the app answers)."""

    def status(self) -> FleetStatus:
        return FleetStatus(budget_bytes=0, used_bytes=0, models=(), events=())


def _app(answers: dict[int, list[int]]):
    """An ASGI app answering line ``n`` with the next status of ``answers[n]`` (then 200)."""

    async def app(scope, receive, send) -> None:
        body = json.loads((await receive())["body"])
        queue = answers.get(body["n"], [])
        status = queue.pop(0) if queue else 200
        data = json.dumps({"echo": body["n"], "status": status}).encode()
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": data})

    return app


async def _batch(
    store: Store, lines: int, *, expires_at: int | None, batch_id: str = "batch_t", model: str = ""
) -> BatchRow:
    file_id = f"file-{batch_id}"
    data = [_line(f"c{i}", body={"n": i, "model": model}) for i in range(lines)]
    size, sha = await store.call(store.write_file, file_id, data)
    await store.call(store.add_file, FileRow(file_id, None, "batch", "in", size, lines, sha, 0))
    row = BatchRow(
        batch_id, None, "/v1/chat/completions", file_id, "24h", "validating", None, None,
        None, None, lines, 0, 0, 0, expires_at, None, None, None, None, None, None, None,
    )  # fmt: skip
    await store.call(store.add_batch, row)
    return row


def _run(
    tmp_path: Path, answers: dict[int, list[int]], lines: int, expires_at: int | None
) -> BatchRow:
    async def go() -> BatchRow:
        store = Store(tmp_path / "batches")
        store.open()
        state = SimpleNamespace(settings=Settings(), shutting_down=False, fleet=_Fleet())
        runner = Runner(state, store, _app(answers))  # type: ignore[arg-type]
        row = await _batch(store, lines, expires_at=expires_at)
        runner.add(row)
        await runner.start()
        for _ in range(400):
            if not runner.jobs:
                break
            await asyncio.sleep(0.025)
        await runner.stop()
        final = await store.call(store.get_batch, row.id)
        store.close()
        assert final is not None
        return final

    return asyncio.run(go())


def _file_lines(tmp_path: Path, file_id: str | None) -> list[dict]:
    assert file_id is not None
    text = (tmp_path / "batches" / "files" / f"{file_id}.jsonl").read_text()
    return [json.loads(x) for x in text.splitlines()]


def test_runner_retries_429_and_503_then_keeps_the_answer(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(runner_module, "RETRY_AFTER_S", 0.0)
    # Line 0: 503 twice, then 200. Line 1: 429 five times: kept as failed. Line 2: a 400 at once.
    answers = {0: [503, 503], 1: [429] * 5, 2: [400]}
    final = _run(tmp_path, answers, 3, expires_at=None)
    assert final.status == "completed" and (final.completed, final.failed) == (1, 2)
    out = _file_lines(tmp_path, final.output_file_id)
    assert [(o["custom_id"], o["response"]["status_code"]) for o in out] == [("c0", 200)]
    errors = _file_lines(tmp_path, final.error_file_id)
    assert [(e["custom_id"], e["response"]["status_code"]) for e in errors] == [
        ("c1", 429),
        ("c2", 400),
    ]


def test_an_expired_batch_lists_its_unrun_lines_as_batch_expired(tmp_path: Path) -> None:
    final = _run(tmp_path, {}, 3, expires_at=1)  # expired long ago
    assert final.status == "expired" and final.expired_at and final.output_file_id is None
    errors = _file_lines(tmp_path, final.error_file_id)
    assert [e["custom_id"] for e in errors] == ["c0", "c1", "c2"]
    assert all(e["error"]["code"] == "batch_expired" and e["response"] is None for e in errors)


def test_batches_run_in_creation_order(tmp_path: Path) -> None:
    seen: list[str] = []

    async def app(scope, receive, send) -> None:
        await receive()
        seen.append(caller_of(scope).line.batch_id)  # type: ignore[union-attr]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def go() -> None:
        store = Store(tmp_path / "batches")
        store.open()
        state = SimpleNamespace(settings=Settings(), shutting_down=False, fleet=_Fleet())
        runner = Runner(state, store, app)  # type: ignore[arg-type]
        # Each batch's lines name another model: they never compete for one model's room,
        # so only the runner's order keeps b's lines behind a's.
        for name in ("batch_a", "batch_b"):
            runner.add(await _batch(store, 4, expires_at=None, batch_id=name, model=name))
        await runner.start()
        for _ in range(400):
            if not runner.jobs:
                break
            await asyncio.sleep(0.025)
        await runner.stop()
        store.close()

    asyncio.run(go())
    assert seen == ["batch_a"] * 4 + ["batch_b"] * 4
