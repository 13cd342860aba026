"""Streamed arguments for the formats written like code (``gemma4``, ``function_gemma``, pythonic).

These write a call as ``call:name{key:value,...}`` or ``[name(key=value, ...)]``,
so a parameter is finished when a ``,`` or the closing bracket follows its
value at the top level. The text up to the last finished parameter, closed
with the bracket, is read by the model's own parser; a Gemma string being
written (between its ``<|"|>`` or ``<escape>`` quotes, which the parser keeps
exactly) is streamed as it grows. See :mod:`mlxd.engine.chat.tool_stream`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from mlxd.engine.chat.tool_stream import Parser, PartialCall, open_member, trial_args

__all__ = ["SCANNED"]

_KEY = re.compile(r"\s*(\w+)\s*[:=]\s*")
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


def _value_end(text: str, at: int, stops: str) -> int | None:
    """Where the value at ``text[at]`` ends (at a top-level character of ``stops``), or None."""
    depth: list[str] = []
    quote: str | None = None
    i = at
    while i < len(text):
        c = text[i]
        if quote is not None:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c in _CLOSERS:
            depth.append(_CLOSERS[c])
        elif depth and c == depth[-1]:
            depth.pop()
        elif not depth and c in stops:
            return i
        i += 1
    return None


def _params(
    raw: str, at: int, quote: str | None, end: str
) -> tuple[int | None, str | None, str, int]:
    """Read ``key<sep>value`` pairs from ``raw[at]``: where the last finished one ends
    (None if none), an unfinished quoted value's key and text, and where reading stopped."""
    done: int | None = None
    i = at
    while i < len(raw):
        m = _KEY.match(raw, i)
        if m is None:
            break
        j = m.end()
        if quote is not None and raw.startswith(quote, j):
            close = raw.find(quote, j + len(quote))
            if close < 0:
                return done, m.group(1), raw[j + len(quote) :], i
            j = close + len(quote)
            while j < len(raw) and raw[j] == " ":
                j += 1
        else:
            found = _value_end(raw, j, "," + end)
            if found is None:
                break
            j = found
        if j >= len(raw) or raw[j] not in "," + end:
            break
        done = j
        if raw[j] == end:
            return done, None, "", j + 1
        i = j + 1
    return done, None, "", i


def _held(text: str, quote: str) -> str:
    for n in range(min(len(quote) - 1, len(text)), 0, -1):
        if quote.startswith(text[-n:]):
            return text[:-n]
    return text


def _gemma(quote: str) -> Callable[[str, Parser, Any], list[PartialCall]]:
    def read(raw: str, parser: Parser, tools: Any) -> list[PartialCall]:
        m = re.match(r"\s*call:(?P<name>[\w-]+)\{", raw)
        if m is None:
            return []
        done, key, text, _ = _params(raw, m.end(), quote, "}")
        args: dict[str, Any] = {}
        if done is not None:
            args = trial_args(parser, raw[:done] + "}", tools) or {}
            if not args:
                return [PartialCall(m.group("name"), "")]
        prefix = json.dumps(args, ensure_ascii=False)[:-1]
        if key is not None and key not in args and (held := _held(text, quote)):
            prefix = open_member(prefix, key, held)
        return [PartialCall(m.group("name"), prefix)]

    return read


_PY_CALL = re.compile(r"\s*,?\s*\[?\s*(?P<name>[\w.]+)\(")


def _pythonic(raw: str, parser: Parser, tools: Any) -> list[PartialCall]:
    calls: list[PartialCall] = []
    pos = raw.find("[")
    if pos < 0:
        return calls
    while (m := _PY_CALL.match(raw, pos)) is not None:
        done, _, _, stopped = _params(raw, m.end(), None, ")")
        prefix = "{"
        if done is not None:
            args = trial_args(parser, f"[{m.group('name')}({raw[m.end() : done]})]", tools)
            prefix = json.dumps(args, ensure_ascii=False)[:-1] if args is not None else ""
        calls.append(PartialCall(m.group("name"), prefix))
        if stopped >= len(raw) or raw[stopped - 1] != ")":
            break
        pos = stopped
    return calls


SCANNED: dict[str, Callable[[str, Parser, Any], list[PartialCall]]] = {
    "gemma4": _gemma('<|"|>'),
    "function_gemma": _gemma("<escape>"),
    "pythonic": _pythonic,
}
