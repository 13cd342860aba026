"""A tool call's arguments streamed while the model writes them: append-only JSON pieces.

The arguments a client finally gets are ``json.dumps`` of what the model's
parser reads from the finished call. While the call is written, this module
reads the unfinished text and says how much of that final JSON is already
certain, so it can be sent before the call ends and never taken back:

- **JSON formats** (``json_tools``, ``mistral``, ``kimi_k2``, ``kimi_k3``'s
  JSON block, ``harmony``): every finished member of the arguments object,
  and the characters of a string value being written.
- **Formats that write one parameter at a time** (``qwen3_coder``, ``glm47``,
  ``longcat``, ``minimax_m2``, ``minicpm5``, ``muse_spark``, ``gemma4``,
  ``function_gemma``, ``pythonic``): the parameters whose closing tag has
  come, read by the model's own parser from the text so far (so each value
  is converted exactly as it will be), and, for a string parameter the
  parser keeps as text, the characters written so far, less what the parser
  would strip at the end.

What cannot yet be known (a number that may grow, the blanks a parser
strips, a tag that may be closing) is held back; the rest of the arguments
come when the call ends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["PartialCall", "open_member", "read_partial", "trial_args"]

Parser = Callable[[str, Any], Any]


@dataclass(frozen=True)
class PartialCall:
    """One call of a tool region so far: its name once known, and a certain prefix of its
    arguments' final JSON (``""`` while nothing is certain)."""

    name: str | None
    prefix: str


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _string_piece(text: str) -> str:
    """``text`` as it appears inside a JSON string (no quotes)."""
    return _dumps(text)[1:-1]


def open_member(done: str, key: str, partial: str) -> str:
    """``done`` (a prefix ending before the closing brace) with one more string member open."""
    sep = ", " if done != "{" else ""
    return f'{done}{sep}{_dumps(key)}: "{_string_piece(partial)}'


# ---------------------------------------------------------------- JSON arguments

_DECODER = json.JSONDecoder()
# A JSON string's body as far as it is written: whole escapes only.
_STRING_BODY = re.compile(r'"((?:[^"\\]|\\.)*)')
# An escape cut short at the end (\u with fewer than 4 digits, or a high surrogate
# still waiting for its pair), preceded by an odd run of backslashes.
_CUT_ESCAPE = re.compile(r"(\\+)(u[0-9a-fA-F]{0,3}|u[dD][89abAB][0-9a-fA-F]{2})$")


def _partial_string(text: str, at: int) -> str:
    """The characters of the JSON string starting at ``text[at]`` (a quote) written so far
    (C-speed: a long file's content is read again at every token)."""
    match = _STRING_BODY.match(text, at)
    body = match.group(1) if match else ""
    while (cut := _CUT_ESCAPE.search(body)) is not None and len(cut.group(1)) % 2 == 1:
        body = body[: cut.start() + len(cut.group(1)) - 1]
    try:
        return json.loads(f'"{body}"')
    except json.JSONDecodeError as exc:  # a bad escape: what comes before it
        return json.loads(f'"{body[: exc.pos - 1]}"') if exc.pos > 1 else ""


def json_prefix(text: str, at: int) -> tuple[str, int | None]:
    """The certain prefix of the canonical JSON of the object starting at ``text[at]``,
    and where the object ends in ``text`` (None while it is unfinished)."""
    if at >= len(text) or text[at] != "{":
        return "", None
    members: list[str] = []
    i = at + 1
    try:
        while True:
            while i < len(text) and text[i] in " \t\r\n,":
                i += 1
            if i >= len(text):
                break
            if text[i] == "}":
                return "{" + ", ".join(members) + "}", i + 1
            key, i = _DECODER.raw_decode(text, i)
            while i < len(text) and text[i] in " \t\r\n:":
                i += 1
            if i >= len(text):
                break
            try:
                value, end = _DECODER.raw_decode(text, i)
            except json.JSONDecodeError:
                if text[i] == '"':
                    done = "{" + ", ".join(members)
                    return open_member(done, key, _partial_string(text, i)), None
                break
            rest = text[end:].lstrip()
            if not rest or (not isinstance(value, (str, dict, list)) and rest[0] not in ",}"):
                break  # a number may still grow
            members.append(f"{_dumps(key)}: {_dumps(value)}")
            i = end
    except (json.JSONDecodeError, ValueError):
        pass
    return "{" + ", ".join(members), None


@dataclass(frozen=True)
class JsonFormat:
    """Calls whose arguments are one JSON object after a header naming the function."""

    header: re.Pattern[str]


def _json_calls(fmt: JsonFormat, raw: str) -> list[PartialCall]:
    calls: list[PartialCall] = []
    pos = 0
    while (m := fmt.header.search(raw, pos)) is not None:
        start = m.end()
        while start < len(raw) and raw[start] in " \t\r\n":
            start += 1
        prefix, end = json_prefix(raw, start)
        calls.append(PartialCall(m.group("name"), prefix))
        if end is None:
            break
        pos = end
    return calls


# ---------------------------------------------------------------- one parameter at a time


@dataclass(frozen=True)
class KvFormat:
    """Calls that write each parameter between an opening and a closing tag."""

    call: re.Pattern[str]  # a call's header; group "name"; a region may hold several
    param: re.Pattern[str]  # a parameter's opening; group "key"
    close: str  # a value's closing tag
    closer: str  # what completes a call's text for a trial parse
    # What the parser strips from a text value: "nl" (one \n each end), "ws"; "json"
    # when every value is JSON (an unfinished one is not streamed).
    strip: str
    null: bool  # the parser reads a text value "null" as None


def _string_keys(tools: Any, name: str) -> set[str]:
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {
                k for k, s in props.items() if isinstance(s, dict) and s.get("type") == "string"
            }
    return set()


def _held_text(value: str, fmt: KvFormat, close: str) -> str | None:
    """What of an unfinished text value is certain, or None while nothing is."""
    for n in range(min(len(close) - 1, len(value)), 0, -1):
        if close.startswith(value[-n:]):  # maybe the closing tag beginning
            value = value[:-n]
            break
    if fmt.strip == "nl":
        if not value:
            return None
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
    elif fmt.strip == "ws":
        value = value.strip()
    if fmt.null and "null".startswith(value.lower()):
        return None
    return value or None


def trial_args(parser: Parser, text: str, tools: Any) -> dict[str, Any] | None:
    try:
        parsed = parser(text, tools)
    except Exception:  # every parser raises its own kind
        return None
    if isinstance(parsed, list):
        parsed = parsed[0] if parsed else None
    args = parsed.get("arguments") if isinstance(parsed, dict) else None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return args if isinstance(args, dict) else None


def _kv_call(fmt: KvFormat, chunk: str, name: str, parser: Parser, tools: Any) -> str:
    """The certain prefix of one call's arguments, from its text so far."""
    done_end, open_key, open_at = None, None, None
    pos = 0
    while (m := fmt.param.search(chunk, pos)) is not None:
        close = chunk.find(fmt.close, m.end())
        if close < 0:
            open_key, open_at = m.group("key"), m.end()
            break
        done_end = pos = close + len(fmt.close)
    args: dict[str, Any] = {}
    if done_end is not None:
        trial = trial_args(parser, chunk[:done_end] + fmt.closer, tools)
        if trial is None:
            return ""
        args = trial
    prefix = _dumps(args)[:-1]
    text_keys = _string_keys(tools, name)
    streams = fmt.strip != "json" and open_key is not None and open_at is not None
    if streams and open_key in text_keys - set(args):
        held = _held_text(chunk[open_at:], fmt, fmt.close)
        if held:
            prefix = open_member(prefix, open_key, held)
    return prefix


def _kv_calls(fmt: KvFormat, raw: str, parser: Parser, tools: Any) -> list[PartialCall]:
    heads = list(fmt.call.finditer(raw))
    calls = []
    for k, m in enumerate(heads):
        end = heads[k + 1].start() if k + 1 < len(heads) else len(raw)
        name = m.group("name").strip().strip("\"'")
        calls.append(PartialCall(name, _kv_call(fmt, raw[m.start() : end], name, parser, tools)))
    return calls


# ---------------------------------------------------------------- the formats

_JSON: dict[str, JsonFormat] = {
    "json_tools": JsonFormat(
        re.compile(r'^\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]*)"\s*,\s*"arguments"\s*:\s*')
    ),
    "mistral": JsonFormat(re.compile(r"(?P<name>[\w-]+)\s*\[ARGS\]\s*")),
    "kimi_k2": JsonFormat(
        re.compile(
            r"<\|tool_call_begin\|>\s*(?:functions\.)?(?P<name>[^<]+?):\d+\s*"
            r"<\|tool_call_argument_begin\|>"
        )
    ),
    "kimi_k3": JsonFormat(
        re.compile(
            r'<\|open\|>call[^<]*?tool="(?P<name>[^"]*)"[^<]*?<\|sep\|>\s*'
            r"<\|open\|>json[^<]*?<\|sep\|>"
        )
    ),
    "harmony": JsonFormat(
        re.compile(
            r"^\s*(?:functions\.)?(?P<name>[^\s<|]+)[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>"
        )
    ),
}
_KV: dict[str, KvFormat] = {
    "qwen3_coder": KvFormat(
        re.compile(r"<function=(?P<name>[^>\n]+)>"),
        re.compile(r"<parameter=(?P<key>[^>\n]+)>"),
        "</parameter>",
        "\n</function>",
        "nl",
        True,
    ),
    "glm47": KvFormat(
        re.compile(r"^(?P<name>[^<]+?)(?=\s*<arg_key>)"),
        re.compile(r"<arg_key>(?P<key>[^<]*)</arg_key>\s*<arg_value>"),
        "</arg_value>",
        "",
        "ws",
        False,
    ),
    "longcat": KvFormat(
        re.compile(r"^(?P<name>[^<{]+?)(?=\s*<longcat_arg_key>)"),
        re.compile(r"<longcat_arg_key>(?P<key>[^<]*)</longcat_arg_key>\s*<longcat_arg_value>"),
        "</longcat_arg_value>",
        "",
        "ws",
        False,
    ),
    "minimax_m2": KvFormat(
        re.compile(r"<invoke name=(?P<name>[^>]+)>"),
        re.compile(r"<parameter name=(?P<key>[^>]+)>"),
        "</parameter>",
        "</invoke>",
        "ws",
        True,
    ),
    "minicpm5": KvFormat(
        re.compile(r"^\s*(?P<name>\"[^\"]*\"|'[^']*'|[^\s\"'<>]+)\s*>"),
        re.compile(r"<param\s+name\s*=\s*\"?(?P<key>[^\"\s>]+)\"?\s*>"),
        "</param>",
        "",
        "ws",
        True,
    ),
    "muse_spark": KvFormat(
        re.compile(r"<atem:invoke\b[^>]*?\bname=\"(?P<name>[^\"]+)\">"),
        re.compile(r"<atem:parameter\b[^>]*?\bname=\"(?P<key>[^\"]+)\"[^>]*?>"),
        "</atem:parameter>",
        "</atem:invoke>",
        "json",
        False,
    ),
}
_KV["laguna"] = _KV["glm47"]


def read_partial(fmt: str | None, raw: str, parser: Parser, tools: Any) -> list[PartialCall]:
    """The calls of an unfinished tool region in format ``fmt`` (none for a format
    this module cannot read: ``gemma4``, ``function_gemma`` and ``pythonic`` are read
    by :mod:`mlxd.engine.chat.tool_scan`; any other's calls come whole)."""
    if fmt in _JSON:
        return _json_calls(_JSON[fmt], raw)
    if fmt in _KV:
        return _kv_calls(_KV[fmt], raw, parser, tools)
    return []
