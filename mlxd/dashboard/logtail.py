"""The last warnings and errors the daemon logged, for the dashboard's log tail.

A logging handler on the root logger keeps the last :data:`KEEP` records at
``WARNING`` and above in memory; the dashboard shows them to admins (they
can name paths and settings). The templates escape every message.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

KEEP = 50
MAX_MESSAGE = 2000


@dataclass(frozen=True)
class Entry:
    at: float
    level: str
    logger: str
    message: str


class LogTail(logging.Handler):
    """Keeps the most recent records at ``level`` and above."""

    def __init__(self, level: int = logging.WARNING, keep: int = KEEP):
        super().__init__(level)
        self._entries: deque[Entry] = deque(maxlen=keep)
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                message += f" ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
        except Exception:  # a bad format string must not break logging
            message = str(record.msg)
        entry = Entry(record.created, record.levelname, record.name, message[:MAX_MESSAGE])
        with self._guard:
            self._entries.append(entry)

    def entries(self) -> list[Entry]:
        """Newest first."""
        with self._guard:
            return list(reversed(self._entries))


TAIL = LogTail()


def install() -> LogTail:
    """Attach :data:`TAIL` to the root logger (once); returns it."""
    root = logging.getLogger()
    if TAIL not in root.handlers:
        root.addHandler(TAIL)
    return TAIL
