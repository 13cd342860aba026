"""A batch input file, line by line: what every request line must be (pure, no I/O of its own).

Each line is one JSON object ``{"custom_id", "method", "url", "body"}``:
``custom_id`` a string unique in the file, ``method`` ``POST``, ``url`` one of
:data:`ENDPOINTS`, ``body`` an object (what the direct call would send; it
is checked when the line runs, by the same code as the direct call). A
streamed body has no place in a batch. The first bad line refuses the whole
file, named by its 1-based number.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/rerank",
)
# Routes whose body is a multipart upload: OpenAI's batch format (JSON lines) cannot carry them.
FILE_ENDPOINTS = ("/v1/audio/transcriptions", "/v1/audio/translations")
MAX_CUSTOM_ID = 512
_KEYS = {"custom_id", "method", "url", "body"}


class BadLine(Exception):
    """Line ``line`` (1-based) is not a request line; ``message`` says why."""

    def __init__(self, line: int, message: str):
        super().__init__(f"Line {line} of the file: {message}")
        self.line = line


@dataclass(frozen=True)
class RequestLine:
    index: int  # 0-based, among the request lines
    custom_id: str
    url: str
    body: dict[str, Any]


def check_lines(
    lines: Iterable[bytes], *, max_lines: int, max_line_bytes: int
) -> Iterator[tuple[bytes, str]]:
    """Each line of a file checked, with its ``url``; raises :class:`BadLine` at the first bad one.

    Empty lines (and a missing final newline) are allowed; ``max_lines``
    counts request lines, ``max_line_bytes`` is the largest body a direct
    call may send (``[limits] max_body_bytes``).
    """
    seen: set[str] = set()
    count = 0
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            yield raw, ""
            continue
        count += 1
        if count > max_lines:
            raise BadLine(
                number, f"the file has more than {max_lines} request lines (batches.max_lines)."
            )
        if len(raw) > max_line_bytes:
            raise BadLine(
                number,
                f"the line is {len(raw)} bytes; a request body may be at most "
                f"{max_line_bytes} bytes (limits.max_body_bytes).",
            )
        line = parse_line(raw, number)
        if line.custom_id in seen:
            raise BadLine(number, f"custom_id {line.custom_id[:80]!r} is used twice in the file.")
        seen.add(line.custom_id)
        yield raw, line.url


def parse_line(raw: bytes, number: int) -> RequestLine:
    """One request line, checked; raises :class:`BadLine`."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadLine(number, f"not valid JSON ({_short(exc)}).") from None
    if not isinstance(value, dict):
        raise BadLine(number, "a request line must be a JSON object.")
    unknown = sorted(set(value) - _KEYS)
    if unknown:
        raise BadLine(
            number,
            f"unknown field {unknown[0][:40]!r}; a line has custom_id, method, url and body.",
        )
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadLine(number, "'custom_id' must be a non-empty string.")
    if len(custom_id) > MAX_CUSTOM_ID:
        raise BadLine(number, f"'custom_id' is longer than {MAX_CUSTOM_ID} characters.")
    if value.get("method") != "POST":
        raise BadLine(number, "'method' must be \"POST\".")
    url = value.get("url")
    refused = endpoint_refusal(url, "'url'")
    if refused is not None:
        raise BadLine(number, refused)
    body = value.get("body")
    if not isinstance(body, dict):
        raise BadLine(number, "'body' must be a JSON object (the request's body).")
    if body.get("stream") not in (None, False):
        raise BadLine(number, "'body.stream' must be false or absent: batch answers are whole.")
    return RequestLine(index=-1, custom_id=custom_id, url=str(url), body=body)


def endpoint_refusal(url: object, field: str) -> str | None:
    """Why ``url`` cannot be a batch's endpoint or a line's ``url`` (None: it can)."""
    if url in ENDPOINTS:
        return None
    if url in FILE_ENDPOINTS:
        return (
            f"{field} {url} cannot be batched: a transcription uploads its audio as a "
            "multipart file, and a batch line is a JSON body (as OpenAI's batch format); "
            f"send each upload to {url} directly."
        )
    return f"{field} {repr(url)[:80]} is not one of {', '.join(ENDPOINTS)}."


def request_lines(lines: Iterable[bytes]) -> Iterator[RequestLine]:
    """The request lines of a file already checked, numbered from 0 (blank lines skipped)."""
    index = 0
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        line = parse_line(raw, number)
        yield RequestLine(index, line.custom_id, line.url, line.body)
        index += 1


def _short(exc: Exception) -> str:
    return str(exc).splitlines()[0][:120]
