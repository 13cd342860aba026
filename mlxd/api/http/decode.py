"""JSON bodies to msgspec Structs, with a clear 400 for every way a body can be wrong.

Structs forbid unknown fields, so a misspelled parameter is a 400 that names
it, like OpenAI's own "Unrecognized request argument". With ``[server]
unknown_parameters = "ignore"``, unknown top-level names are dropped instead,
logged, and named in a response header (:func:`decode_parameters`).
"""

from __future__ import annotations

import logging
import re
from typing import Any, TypeVar

import msgspec

from mlxd.api.http.errors import OpenAIError

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=msgspec.Struct)

# Bounds on what a body may carry (docs/api.md, "Limits").
MAX_JSON_DEPTH = 64

IGNORED_HEADER = "X-Mlxd-Ignored-Parameters"

_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]+)`")
_AT_PATH = re.compile(r"at `\$\.?([^`]*)`")
_HEADER_SAFE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Do arrays and objects nest more than ``limit`` levels in a decoded body?"""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for item in node.values() if type(node) is dict else node:
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((item, depth + 1))
    return False


def drop_unknown(raw: dict[str, Any], kind: type[msgspec.Struct]) -> list[str]:
    """Remove the top-level keys ``kind`` does not know from ``raw``; returns their names.

    For ``[server] unknown_parameters = "ignore"``: vendor extras some clients
    always send. Parameters mlxd knows but does not support stay (and get their
    400); nested objects are still checked strictly.
    """
    unknown = [k for k in raw if k not in kind.__struct_fields__]
    for name in unknown:
        del raw[name]
    return unknown


def decode(body: bytes, kind: type[T], *, ignored: list[str] | None = None) -> T:
    """Decode and type-check a JSON body, turning every failure into a clear 400.

    With ``ignored`` (a list to fill), unknown top-level parameters are dropped
    and their names appended to it instead of being refused.
    """
    deep = OpenAIError(
        400,
        f"The request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep.",
        code="invalid_json",
    )
    try:
        raw = msgspec.json.decode(body)
    except RecursionError:
        raise deep from None  # deeper than the interpreter allows: certainly too deep
    except msgspec.DecodeError as exc:
        raise OpenAIError(
            400, f"The request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(raw, dict):
        raise OpenAIError(
            400,
            f"The request body must be a JSON object, not {_json_kind(raw)}.",
            code="invalid_json",
        )
    if too_deep(raw):
        raise deep
    if ignored is not None:
        ignored.extend(drop_unknown(raw, kind))
    try:
        return msgspec.convert(raw, kind)
    except RecursionError:
        raise OpenAIError(400, "The request body nests too deeply.", code="invalid_json") from None
    except msgspec.ValidationError as exc:
        raise _invalid(str(exc)) from None


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "a string" if isinstance(value, str) else "an array"


def _invalid(text: str) -> OpenAIError:
    """msgspec's validation message as OpenAI's error: which parameter, and what is wrong."""
    unknown = _UNKNOWN_FIELD.search(text)
    if unknown:
        name = unknown.group(1)
        return OpenAIError(
            400,
            f"Unrecognized request argument supplied: {name}",
            code="unknown_parameter",
            param=name,
        )
    path = _AT_PATH.search(text)
    param = path.group(1) if path else None
    if "missing required field" in text:
        missing = re.search(r"`([^`]+)`", text)
        param = missing.group(1) if missing else param
        return OpenAIError(
            400,
            f"Missing required parameter: '{param}'.",
            code="missing_required_parameter",
            param=param,
        )
    return OpenAIError(400, f"Invalid value: {text}", code="invalid_type", param=param)


def decode_parameters(
    body: bytes, kind: type[T], unknown_parameters: str, where: str
) -> tuple[T, dict[str, str]]:
    """:func:`decode` under ``[server] unknown_parameters``; returns the value and the
    response headers that name what was ignored (none when nothing was)."""
    ignored: list[str] | None = [] if unknown_parameters == "ignore" else None
    value = decode(body, kind, ignored=ignored)
    if not ignored:
        return value, {}
    logger.debug("%s: ignored unknown parameters %s", where, ignored)
    return value, {IGNORED_HEADER: ignored_header(ignored)}


def ignored_header(names: list[str], limit: int = 20) -> str:
    """The ignored names for a response header: safe characters only, at most ``limit``."""
    safe = sorted({n for n in names if _HEADER_SAFE.match(n)})
    shown = safe[:limit]
    rest = len(names) - len(shown)
    return ", ".join(shown + ([f"({rest} more)"] if rest else []))
