"""Messages' content blocks as the chat path's messages and parts.

Text, ``tool_use`` (an assistant's tool call), ``tool_result`` (a ``tool``
message, with the images a tool returned), ``image`` (a user's image part),
and what is skipped (earlier ``thinking``) or refused (documents, server
tools), each error naming the block (``messages[2].content[1]``).
"""

from __future__ import annotations

from typing import Any

from mlxd.api.images import Images, text_part
from mlxd.api.images import content as content_of
from mlxd.api.params import bad, unsupported


def _text(block: Any, where: str) -> str | None:
    """A text block's text; None for blocks that carry nothing the model reads again."""
    if isinstance(block, str):
        raise bad(
            where,
            "A content block must be an object such as {'type': 'text', 'text': ...}, "
            "not a bare string (a whole 'content' may be one string).",
        )
    if not isinstance(block, dict):
        raise bad(where, f"A content block must be an object, got {type(block).__name__}.")
    kind = block.get("type")
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise bad(f"{where}.text", "A text block needs a string 'text'.")
        return block["text"]
    if kind in ("thinking", "redacted_thinking"):
        return None  # earlier reasoning is not fed back, as Anthropic's own API does
    if kind == "image":
        raise bad(where, "'image' blocks are taken in user messages only.")
    if kind in ("document", "search_result"):
        raise unsupported(where, f"mlxd takes text and images; {kind!r} blocks are not accepted.")
    raise bad(f"{where}.type", f"Unexpected content block type {kind!r} here.")


def content_text(content: Any, where: str) -> str:
    """A string ``content``, or a list of blocks' text joined (nothing read again skipped)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = (_text(b, f"{where}[{j}]") for j, b in enumerate(content))
        return "".join(t for t in texts if t is not None)
    raise bad(where, "'content' must be a string or a list of content blocks.")


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, dict):
        raise bad(where, f"{where} (tool_use) needs string 'id' and 'name' and an object 'input'.")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _image(block: dict[str, Any], where: str, images: Images) -> dict[str, Any]:
    """An ``image`` block with a base64 source as an image part."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad(f"{where}.source", "An image block needs a 'source' object.")
    kind = source.get("type")
    if not isinstance(kind, str):
        raise bad(f"{where}.source.type", "An image source needs a 'type' ('base64').")
    if kind == "url":
        return images.data_url(source.get("url"), f"{where}.source.url")
    if kind != "base64":
        raise unsupported(
            f"{where}.source.type", f"image sources of type {kind!r} (send type 'base64')."
        )
    return images.base64(source.get("data"), source.get("media_type"), f"{where}.source")


def _tool_result(content: Any, where: str, images: Images) -> str | list[dict[str, Any]]:
    """A tool_result's content: text, or text and images (a screenshot a tool took)."""
    if not isinstance(content, list) or not any(
        isinstance(b, dict) and b.get("type") == "image" for b in content
    ):
        return content_text(content, where)
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        if isinstance(block, dict) and block.get("type") == "image":
            parts.append(_image(block, at, images))
        else:
            text = _text(block, at)
            if text is not None:
                parts.append(text_part(text))
    return content_of(parts)


def turn(role: str, content: Any, where: str, images: Images) -> list[dict]:
    """One Anthropic message as chat messages: tool results become ``tool`` messages."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad(where, "'content' must be a string or a list of content blocks.")
    out: list[dict] = []
    texts: list[str] = []
    parts: list[dict] = []
    calls: list[dict] = []
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "image" and role == "user":
            assert isinstance(block, dict)
            if texts:
                parts.append(text_part("".join(texts)))
                texts = []
            parts.append(_image(block, at, images))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise bad(f"{at}.tool_use_id", f"{at} (tool_result) needs 'tool_use_id'.")
            result = _tool_result(block.get("content", ""), f"{at}.content", images)
            if block.get("is_error"):
                result = (
                    f"Error: {result}"
                    if isinstance(result, str)
                    else [text_part("Error: "), *result]
                )
            out.append({"role": "tool", "tool_call_id": call_id, "content": result})
        elif kind in ("tool_use", "tool_result"):
            owner = "assistant" if kind == "tool_use" else "user"
            raise bad(at, f"'{kind}' blocks belong in {owner} messages.")
        elif kind in ("server_tool_use", "web_search_tool_result"):
            raise unsupported(at, f"server tools ({kind!r}) are not implemented.")
        else:
            text = _text(block, at)
            if text is not None:
                texts.append(text)
    if calls:
        out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
    elif parts:
        if texts:
            parts.append(text_part("".join(texts)))
        out.append({"role": role, "content": parts})
    elif texts or not out:
        out.append({"role": role, "content": "".join(texts)})
    return out
