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

import pytest

from mlxd.api.batches.db import SCHEMA_VERSION, open_database
from mlxd.api.batches.jsonl import BadLine, check_lines, parse_line, request_lines
from mlxd.api.batches.lane import ChatLoad, chat_room, embedding_room, in_hours, may_load
from mlxd.api.batches.store import FileRow, Store
from mlxd.config import BatchesSettings

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
