"""The Batch API's SQLite database: opening it, its versioned schema, and a corrupt one set aside.

One file, ``<state_dir>/batches/batches.db``, in WAL mode with
``synchronous=FULL``: a row committed is on disk before the commit returns,
so a result counted survives a ``kill -9`` and a power cut. The schema
version is ``PRAGMA user_version``; :data:`MIGRATIONS` holds one script per
version and :func:`open_database` runs those not yet applied, each in its own
transaction. A database that SQLite cannot read (or one written by a newer
mlxd) is renamed aside with a warning and a fresh one takes its place: the
daemon always starts.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# One script per schema version, in order: MIGRATIONS[n] takes version n to n + 1.
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE files (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        owner TEXT,
        purpose TEXT NOT NULL,
        filename TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        lines INTEGER NOT NULL,
        sha256 TEXT NOT NULL,
        created_at INTEGER NOT NULL
    );
    CREATE TABLE batches (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        owner TEXT,
        endpoint TEXT NOT NULL,
        input_file_id TEXT NOT NULL,
        completion_window TEXT NOT NULL,
        status TEXT NOT NULL,
        metadata TEXT,
        errors TEXT,
        output_file_id TEXT,
        error_file_id TEXT,
        total INTEGER NOT NULL DEFAULT 0,
        completed INTEGER NOT NULL DEFAULT 0,
        failed INTEGER NOT NULL DEFAULT 0,
        created_at INTEGER NOT NULL,
        expires_at INTEGER,
        in_progress_at INTEGER,
        finalizing_at INTEGER,
        completed_at INTEGER,
        failed_at INTEGER,
        expired_at INTEGER,
        cancelling_at INTEGER,
        cancelled_at INTEGER
    );
    CREATE TABLE results (
        batch_id TEXT NOT NULL,
        line INTEGER NOT NULL,
        ok INTEGER NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (batch_id, line)
    ) WITHOUT ROWID;
    """,
)

SCHEMA_VERSION = len(MIGRATIONS)


class UnusableDatabase(Exception):
    """The file is not a database this mlxd can use (corrupt, or from a newer mlxd)."""


def open_database(path: Path) -> sqlite3.Connection:
    """The database at ``path``, migrated to :data:`SCHEMA_VERSION`; a fresh one if unusable.

    Call it on the thread that will own the connection.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return _open(path)
    except (sqlite3.DatabaseError, UnusableDatabase) as exc:
        aside = path.with_name(f"{path.name}.unusable-{int(time.time())}")
        logger.warning(
            "the batch database %s is unusable (%s): moved it to %s and started a new one; "
            "the batches and files it listed are gone (their file bodies stay on disk)",
            path,
            exc,
            aside,
        )
        for suffix in ("", "-wal", "-shm"):
            old = path.with_name(path.name + suffix)
            if old.exists():
                old.rename(aside.with_name(aside.name + suffix))
        return _open(path)


def _open(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=True)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA foreign_keys=ON")
        check = conn.execute("PRAGMA quick_check").fetchone()
        if check is None or check[0] != "ok":
            raise UnusableDatabase(f"quick_check says {check[0] if check else 'nothing'}")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise UnusableDatabase(
                f"schema version {version} is newer than this mlxd's {SCHEMA_VERSION}"
            )
        for target in range(version, SCHEMA_VERSION):
            conn.execute("BEGIN IMMEDIATE")
            for statement in _statements(MIGRATIONS[target]):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {target + 1}")
            conn.execute("COMMIT")
            logger.info("batch database %s: schema migrated to version %d", path, target + 1)
    except BaseException:
        conn.close()
        raise
    return conn


def _statements(script: str) -> list[str]:
    """A migration script's statements (they hold no semicolons inside literals)."""
    return [s.strip() for s in script.split(";") if s.strip()]
