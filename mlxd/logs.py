"""Log output: escaping untrusted text so it cannot forge log lines.

Config keys and values, model names, header values and paths can come from
a client or a hand-edited file. :class:`EscapingFormatter` escapes control
characters (newlines included) in every log message, so one record is always
one line; tracebacks, which mlxd itself attaches, keep their lines.
"""

from __future__ import annotations

import logging
import re

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(char, f"\\x{ord(char):02x}")


def safe(value: object, limit: int = 200) -> str:
    """``value`` as one printable line, control characters escaped, cut at ``limit``."""
    text = _CONTROL.sub(_escape, str(value))
    return text if len(text) <= limit else text[:limit] + "…"


class EscapingFormatter(logging.Formatter):
    """A formatter whose messages never span lines (see the module docstring)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = _CONTROL.sub(_escape, record.message)
        return super().formatMessage(record)
