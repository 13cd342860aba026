"""Responses API ``input`` items, ``tools``, ``tool_choice`` and ``text.format``, in the
shapes the chat path already takes.

Items become chat messages in the chat template's shape (``function_call``
and ``custom_tool_call`` items join the assistant turn as ``tool_calls``,
``function_call_output`` and ``custom_tool_call_output`` items become
``tool`` messages), function and custom tools become chat tools, and
``text.format`` becomes a ``response_format``. Validation and grammars are
then the chat path's own (:mod:`mlxd.api.openai.tools`, whose
:func:`~mlxd.api.openai.tools.plan_tools` names errors as this request does), not a
second copy.
"""

from __future__ import annotations

from typing import Any

from mlxd.api.http.errors import OpenAIError
from mlxd.api.images import Images
from mlxd.api.openai.tools import history_message, renamed, response_constraint
from mlxd.api.params import bad, relabel, unsupported
from mlxd.engine import Constraint

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}

# Items a client may send back from an earlier turn that carry nothing the
# model reads again (mlxd never sends encrypted reasoning).
_SKIPPED_ITEMS = {"reasoning"}

# Tool types that run on OpenAI's side, or on the client's in a shape no chat
# template knows: skipped, so a client that always sends them (Codex) still
# works. Naming one in tool_choice is refused.
SKIPPED_TOOL_TYPES = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "computer_use_preview",
        "computer",
        "image_generation",
        "mcp",
        "local_shell",
        "shell",
        "apply_patch",
        "tool_search",
        "namespace",
    }
)


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise bad(where, f"A content part must be an object, got {type(part).__name__}.")
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        if not isinstance(part.get("text"), str):
            raise bad(f"{where}.text", f"An {kind!r} part's 'text' must be a string.")
        return part["text"]
    if kind == "refusal":
        if not isinstance(part.get("refusal"), str):
            raise bad(f"{where}.refusal", "A 'refusal' part's 'refusal' must be a string.")
        return part["refusal"]
    if kind in ("input_file", "input_audio"):
        raise unsupported(where, f"mlxd takes text and images; {kind!r} parts are not accepted.")
    if kind == "input_image":
        raise bad(where, "An 'input_image' part is taken in user messages only.")
    raise bad(where, f"Unsupported content part type {kind!r}: use 'input_text'.")


# A Responses image part as messages keep it until the request is built: the data URL
# and where it came from. It stays in the stored conversation (previous_response_id),
# and is checked against [limits] again each time a request carries it.
IMAGE_REF = "image_ref"


def _image_ref(part: dict, where: str) -> dict[str, Any]:
    if part.get("file_id") is not None:
        raise unsupported(f"{where}.file_id", "files are not implemented; send image_url.")
    if part.get("detail") not in (None, "auto", "low", "high"):
        raise bad(f"{where}.detail", "detail must be auto, low or high.")
    url = part.get("image_url")
    if not isinstance(url, str):
        raise bad(f"{where}.image_url", "An 'input_image' part needs an 'image_url' string.")
    return {"type": IMAGE_REF, "url": url, "where": f"{where}.image_url"}


def _content(content: Any, where: str, *, images: bool = False) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for j, p in enumerate(content):
            at = f"{where}[{j}]"
            if images and isinstance(p, dict) and p.get("type") == "input_image":
                parts.append(_image_ref(p, at))
            else:
                parts.append({"type": "text", "text": _part_text(p, at)})
        if all(p["type"] == "text" for p in parts):
            return "".join(p["text"] for p in parts)
        return parts
    raise bad(where, "Content must be a string or a list of text parts.")


def resolve_images(messages: tuple[dict, ...], images: Images) -> tuple[dict, ...]:
    """``messages`` with every image reference checked and turned into an image part."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(p.get("type") == IMAGE_REF for p in content):
            parts = [
                images.data_url(p["url"], p["where"]) if p.get("type") == IMAGE_REF else p
                for p in content
            ]
            m = {**m, "content": parts}
        out.append(m)
    return tuple(out)


def _raw_item(item: Any, i: int, out: list[dict]) -> None:
    """Append ``item`` to ``out`` as a chat-shaped message (calls join the assistant turn)."""
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise bad(where, f"An input item must be an object, got {type(item).__name__}.")
    kind = item.get("type", "message")
    if kind in _SKIPPED_ITEMS:
        return
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise bad(
                f"{where}.role", f"Invalid role {role!r}: use user, assistant, system or developer."
            )
        if item.get("content") is None:
            raise bad(f"{where}.content", f"{where} has no content.")
        text = _content(item["content"], f"{where}.content", images=role == "user")
        out.append({"role": _ROLES[role], "content": text, "_at": i})
    elif kind in ("function_call", "custom_tool_call"):
        name, call_id = item.get("name"), item.get("call_id")
        if not isinstance(name, str) or not isinstance(call_id, str):
            raise bad(where, f"{where} ({kind}) needs string 'name' and 'call_id'.")
        if kind == "custom_tool_call":
            body = {"name": name, "input": item.get("input", "")}
            call: dict[str, Any] = {"id": call_id, "type": "custom", "custom": body}
        else:
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": item.get("arguments", "{}")},
            }
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call], "_at": i})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise bad(f"{where}.call_id", f"{where} ({kind}) needs 'call_id'.")
        text = _content(item.get("output"), f"{where}.output")
        out.append({"role": "tool", "tool_call_id": call_id, "content": text, "_at": i})
    else:
        raise unsupported(
            f"{where}.type",
            f"input items of type {kind!r} are not supported (mlxd takes message, "
            "function_call, function_call_output, custom_tool_call, custom_tool_call_output "
            "and reasoning items).",
        )


def input_messages(value: str | list[dict[str, Any]] | None) -> tuple[dict, ...]:
    """``input`` as chat messages in the template's shape (a string is one user message)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return ({"role": "user", "content": value},)
    raw: list[dict] = []
    for i, item in enumerate(value):
        _raw_item(item, i, raw)
    out = []
    for m in raw:
        at = m.pop("_at")
        if m["role"] == "tool" or m.get("tool_calls"):
            try:
                out.append(history_message(m, at, m.get("content")))
            except OpenAIError as exc:
                raise relabel(exc, f"messages[{at}]", f"input[{at}]") from None
        else:
            out.append(m)
    return tuple(out)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[tuple[int, dict[str, Any]]] | None:
    """Responses function tools in the chat completions shape, with their index in the
    request; hosted tool types skipped."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad(f"tools[{i}]", f"tools[{i}] must be an object.")
        kind = tool.get("type")
        if kind == "function":
            keys = ("name", "description", "parameters", "strict")
            fn = {k: tool[k] for k in keys if tool.get(k) is not None}
            extra = set(tool) - {"type", *keys}
            if extra:
                raise bad(
                    f"tools[{i}]",
                    f"Unrecognized field(s) in tools[{i}]: {', '.join(sorted(extra))}.",
                )
            out.append((i, {"type": "function", "function": fn}))
        elif kind == "custom":
            body = {k: v for k, v in tool.items() if k != "type"}
            out.append((i, {"type": "custom", "custom": body}))
        elif kind not in SKIPPED_TOOL_TYPES:
            raise unsupported(
                f"tools[{i}].type",
                f"unknown tool type {kind!r}; mlxd runs 'function' and 'custom' tools and skips "
                "OpenAI-hosted ones (see docs/api.md).",
            )
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    """A Responses ``tool_choice`` in the chat completions shape."""
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind == "custom":
        return {"type": "custom", "custom": {"name": choice.get("name")}}
    raise unsupported(
        "tool_choice",
        f"tool_choice of type {kind!r}: mlxd takes 'none', 'auto', 'required', "
        "{'type': 'function', 'name': ...} or {'type': 'custom', 'name': ...}.",
    )


def text_constraint(text: dict[str, Any] | None) -> Constraint | None:
    """``text.format`` (text, json_object, json_schema) as the chat path's grammar, or None."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad("text.format", "'text.format' must be an object.")
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if fmt.get(k) is not None}
        fmt = {"type": "json_schema", "json_schema": spec}
    try:
        return renamed(response_constraint(fmt), "response_format.json_schema", "text.format")
    except OpenAIError as exc:
        exc = relabel(exc, "response_format.json_schema", "text.format")
        raise relabel(exc, "response_format", "text.format") from None
