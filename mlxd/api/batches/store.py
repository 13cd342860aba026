"""The Batch API's durable state: files and batches in SQLite, file bodies next to it.

Everything lives under ``<[server] state_dir>/batches/``: ``batches.db`` (the
rows, :mod:`mlxd.api.batches.db`) and ``files/<id>.jsonl`` (each file's
bytes, written to a temporary name, flushed and renamed: a file is whole or
absent). One thread owns the connection and runs every query in turn
(datasette's pattern): the event loop awaits :meth:`Store.call`, nothing else
touches SQLite, so there is exactly one writer.

A batch's finished lines are rows of ``results`` keyed by (batch, line): a
line is counted only once its row is committed, and a line with a row is
never run again, so a daemon killed mid-batch resumes where it stopped
without doing a line twice or losing one.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import secrets
import sqlite3
import stat
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from mlxd.api.batches.db import open_database

logger = logging.getLogger(__name__)

T = TypeVar("T")

FILE_COLUMNS = "id, owner, purpose, filename, bytes, lines, sha256, created_at"
BATCH_COLUMNS = (
    "id, owner, endpoint, input_file_id, completion_window, status, metadata, errors, "
    "output_file_id, error_file_id, total, completed, failed, created_at, expires_at, "
    "in_progress_at, finalizing_at, completed_at, failed_at, expired_at, cancelling_at, "
    "cancelled_at"
)
TIMESTAMPS = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass(frozen=True)
class FileRow:
    id: str
    owner: str | None
    purpose: str
    filename: str
    bytes: int
    lines: int
    sha256: str
    created_at: int


@dataclass(frozen=True)
class BatchRow:
    id: str
    owner: str | None
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    metadata: dict[str, str] | None
    errors: list[dict[str, Any]] | None
    output_file_id: str | None
    error_file_id: str | None
    total: int
    # Lines answered 2xx and not, kept here once the batch is final (results hold them before).
    completed: int
    failed: int
    created_at: int
    expires_at: int | None
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None


@dataclass(frozen=True)
class Counts:
    completed: int
    failed: int


def _batch(row: tuple[Any, ...]) -> BatchRow:
    values = list(row)
    values[6] = json.loads(values[6]) if values[6] else None
    values[7] = json.loads(values[7]) if values[7] else None
    return BatchRow(*values)


class Store:
    """Files and batches on disk; every method but :meth:`file_path` runs on the store's thread.

    Args:
        root: ``<state_dir>/batches``; created on :meth:`open`.
    """

    def __init__(self, root: Path):
        self.root = root
        self.files_dir = root / "files"
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mlxd-batches-db")
        self._conn: sqlite3.Connection | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ the thread

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the store's thread (the connection's only user)."""
        work = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def open(self) -> None:
        """Open (or create, or set aside and recreate) the database; on the store's thread."""
        self._pool.submit(self._open).result()

    def _open(self) -> None:
        self.files_dir.mkdir(parents=True, exist_ok=True)
        sweep(self.files_dir)
        self._conn = open_database(self.root / "batches.db")

    def close(self) -> None:
        def shut() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        self._pool.submit(shut).result()
        self._pool.shutdown(wait=True)

    @property
    def db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("the batch store is not open")
        return self._conn

    # ------------------------------------------------------------ files

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def has_file(self, file_id: str) -> bool:
        """Whether the file's body is on disk as a regular file (any thread)."""
        return is_regular(self.file_path(file_id))

    def open_file(self, file_id: str) -> BinaryIO:
        """The file's body for reading (any thread); see :func:`open_regular`."""
        return open_regular(self.file_path(file_id))

    def add_file(self, row: FileRow) -> None:
        self.db.execute(
            f"INSERT INTO files ({FILE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.id,
                row.owner,
                row.purpose,
                row.filename,
                row.bytes,
                row.lines,
                row.sha256,
                row.created_at,
            ),
        )

    def file_count(self) -> int:
        return self.db.execute("SELECT count(*) FROM files").fetchone()[0]

    def get_file(self, file_id: str) -> FileRow | None:
        row = self.db.execute(f"SELECT {FILE_COLUMNS} FROM files WHERE id = ?", (file_id,))
        found = row.fetchone()
        return FileRow(*found) if found else None

    def list_files(
        self, owner: str | None, purpose: str | None, after: str | None, limit: int, order: str
    ) -> list[FileRow]:
        """Files newest first (``order="desc"``) or oldest first, after the file ``after``."""
        sql = f"SELECT {FILE_COLUMNS} FROM files WHERE owner IS ?"
        args: list[Any] = [owner]
        if purpose is not None:
            sql += " AND purpose = ?"
            args.append(purpose)
        desc = order == "desc"
        if after is not None:
            sql += f" AND seq {'<' if desc else '>'} (SELECT seq FROM files WHERE id = ?)"
            args.append(after)
        sql += f" ORDER BY seq {'DESC' if desc else 'ASC'} LIMIT ?"
        args.append(limit)
        return [FileRow(*r) for r in self.db.execute(sql, args).fetchall()]

    def delete_file(self, file_id: str) -> None:
        self.db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        self.file_path(file_id).unlink(missing_ok=True)

    def write_file(self, file_id: str, lines: Iterable[bytes]) -> tuple[int, str]:
        """Write a file's body atomically; its size and sha256."""
        digest = hashlib.sha256()
        size = 0
        tmp = self.files_dir / f".upload-{file_id}"
        try:
            with tmp.open("wb") as out:
                for line in lines:
                    out.write(line)
                    digest.update(line)
                    size += len(line)
                out.flush()
                os.fsync(out.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        commit_file(tmp, self.file_path(file_id))
        return size, digest.hexdigest()

    # ------------------------------------------------------------ batches

    def add_batch(self, row: BatchRow) -> None:
        values = list(row.__dict__.values())
        values[6] = json.dumps(row.metadata) if row.metadata is not None else None
        values[7] = json.dumps(row.errors) if row.errors is not None else None
        marks = ", ".join("?" * len(values))
        self.db.execute(f"INSERT INTO batches ({BATCH_COLUMNS}) VALUES ({marks})", values)

    def get_batch(self, batch_id: str) -> BatchRow | None:
        found = self.db.execute(
            f"SELECT {BATCH_COLUMNS} FROM batches WHERE id = ?", (batch_id,)
        ).fetchone()
        return _batch(found) if found else None

    def list_batches(self, owner: str | None, after: str | None, limit: int) -> list[BatchRow]:
        """An owner's batches newest first, after the batch ``after``."""
        sql = f"SELECT {BATCH_COLUMNS} FROM batches WHERE owner IS ?"
        args: list[Any] = [owner]
        if after is not None:
            sql += " AND seq < (SELECT seq FROM batches WHERE id = ?)"
            args.append(after)
        sql += " ORDER BY seq DESC LIMIT ?"
        args.append(limit)
        return [_batch(r) for r in self.db.execute(sql, args).fetchall()]

    def open_batches(self) -> list[BatchRow]:
        """Every batch not yet in a final state, oldest first (the order they run in)."""
        rows = self.db.execute(
            f"SELECT {BATCH_COLUMNS} FROM batches WHERE status IN "
            "('validating', 'in_progress', 'finalizing', 'cancelling') ORDER BY seq"
        ).fetchall()
        return [_batch(r) for r in rows]

    def recent_batches(self, limit: int) -> list[BatchRow]:
        """Every owner's batches, newest first (the dashboard)."""
        rows = self.db.execute(
            f"SELECT {BATCH_COLUMNS} FROM batches ORDER BY seq DESC LIMIT ?", (limit,)
        ).fetchall()
        return [_batch(r) for r in rows]

    def update_batch(self, batch_id: str, **values: Any) -> None:
        for key in ("metadata", "errors"):
            if key in values and values[key] is not None:
                values[key] = json.dumps(values[key])
        sets = ", ".join(f"{k} = ?" for k in values)
        self.db.execute(f"UPDATE batches SET {sets} WHERE id = ?", (*values.values(), batch_id))

    # ------------------------------------------------------------ results

    def add_result(self, batch_id: str, line: int, ok: bool, body: str) -> bool:
        """Keep one finished line (committed before this returns); False if it was kept already."""
        cur = self.db.execute(
            "INSERT OR IGNORE INTO results (batch_id, line, ok, body) VALUES (?, ?, ?, ?)",
            (batch_id, line, int(ok), body),
        )
        return cur.rowcount == 1

    def done_lines(self, batch_id: str) -> set[int]:
        rows = self.db.execute("SELECT line FROM results WHERE batch_id = ?", (batch_id,))
        return {r[0] for r in rows.fetchall()}

    def counts(self, batch_id: str) -> Counts:
        ok, failed = self.db.execute(
            "SELECT coalesce(sum(ok), 0), coalesce(sum(1 - ok), 0) FROM results WHERE batch_id = ?",
            (batch_id,),
        ).fetchone()
        return Counts(completed=ok, failed=failed)

    def result_bodies(self, batch_id: str, ok: bool) -> Iterable[bytes]:
        """The kept lines of one kind, in input order, as JSONL lines."""
        rows = self.db.execute(
            "SELECT body FROM results WHERE batch_id = ? AND ok = ? ORDER BY line",
            (batch_id, int(ok)),
        )
        for (body,) in rows:
            yield body.encode() + b"\n"

    def finish(self, batch_id: str, files: list[FileRow], **values: Any) -> None:
        """In one transaction: the result files' rows, the batch's final state, its kept
        lines dropped (the files hold them now)."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            for row in files:
                self.db.execute("DELETE FROM files WHERE id = ?", (row.id,))
                self.add_file(row)
            self.update_batch(batch_id, **values)
            self.db.execute("DELETE FROM results WHERE batch_id = ?", (batch_id,))
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")


def commit_file(tmp: Path, final: Path) -> None:
    """Rename a flushed temporary file into place and flush the directory entry."""
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Names a process killed mid-upload left in the files folder: the store's own
# half-written bodies, and python-multipart's named spool files of mlxd before
# uploads spooled to anonymous files.
_LEFTOVERS = (".upload-", "tmp")


def sweep(folder: Path) -> int:
    """Remove what a killed process left in ``folder``; how many files went.

    Only regular files are removed (a FIFO, a device or a symlink with such a
    name is left alone, and never opened).
    """
    removed = 0
    for entry in os.scandir(folder):
        if entry.name.startswith(_LEFTOVERS) and entry.is_file(follow_symlinks=False):
            Path(entry.path).unlink(missing_ok=True)
            removed += 1
    if removed:
        logger.info("batch files: removed %d unfinished upload(s) left by an earlier run", removed)
    return removed


def is_regular(path: Path) -> bool:
    """Whether ``path`` itself (not what a symlink names) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading, only if it is a regular file.

    Opened with ``O_NOFOLLOW`` (a symlink, which could point out of the
    folder, is refused) and ``O_NONBLOCK`` (a FIFO does not block the open),
    then checked with ``fstat``: a FIFO, a socket or a device is refused.

    Raises:
        OSError: missing, a symlink, or not a regular file.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path.name} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
