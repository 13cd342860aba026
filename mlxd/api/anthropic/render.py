"""Engine events rendered as Anthropic Messages: a Message object or its SSE events.

Content blocks open as the model produces them: ``thinking`` for reasoning
text, ``text`` for answer text, one ``tool_use`` per tool call. Streaming
follows Anthropic's sequence::

    message_start,
    per block: content_block_start (the first followed by ping), content_block_delta (text_delta |
               thinking_delta | input_json_delta) ..., content_block_stop
    message_delta (stop_reason, usage), message_stop

and ``error`` when generation fails after the stream began. Usage follows
Anthropic's split: ``input_tokens`` are the prompt tokens not served from the
prompt cache, ``cache_read_input_tokens`` the ones that were.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from mlxd.api.answer import call_events
from mlxd.api.anthropic.errors import anthropic_error_body
from mlxd.engine import Delta, Failed, Finished, ToolCall, ToolCallPart, Usage


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(finished: Finished) -> str:
    if finished.finish_reason == "length":
        return "max_tokens"
    if finished.finish_reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if finished.stop_sequence is not None else "end_turn"


def event(kind: str, **fields: Any) -> bytes:
    body = msgspec.json.encode({"type": kind, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": call.id,
        "name": call.name,
        "input": json.loads(call.arguments or "{}"),
    }


class MessagesOutput:
    """Builds one message, whole or streamed (an :class:`mlxd.api.openai.routes.Output`)."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int, cached_tokens: int = 0):
        self.id = message_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        # Known at admission, before the stream starts: message_start's usage is the real split.
        self.cached_tokens = cached_tokens
        self._blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # "text" or "thinking" while such a block is open
        self._pinged = False
        self._streaming = False  # a whole message reads finished calls only
        self._tool: tuple[int, int] | None = None  # (call index, block index) being streamed

    def _message(self, finished: Finished | None, usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self._blocks if finished else [],
            "stop_reason": stop_reason(finished) if finished else None,
            "stop_sequence": finished.stop_sequence if finished else None,
            "usage": usage,
        }

    # ------------------------------------------------------------ building blocks

    def _feed(self, delta: Delta) -> list[bytes]:
        out: list[bytes] = []
        calls_first = self._tool is not None  # text in this delta came after the open call
        if calls_first:
            out += self._calls(delta)
        if delta.reasoning:
            out += self._add("thinking", delta.reasoning)
        if delta.text:
            out += self._add("text", delta.text)
        if not calls_first:
            out += self._calls(delta)
        return out

    def _calls(self, delta: Delta) -> list[bytes]:
        out: list[bytes] = []
        for e in call_events(delta) if self._streaming else delta.tool_calls:
            if isinstance(e, ToolCallPart):
                out += self._part(e)
                continue
            if self._tool is None or self._tool[0] != e.index:
                out += self._part(ToolCallPart(e.index, e.id, e.name, e.arguments))
            out += self._end_tool(e)
        return out

    def _part(self, part: ToolCallPart) -> list[bytes]:
        """A tool_use block opened at a call's first part; each piece an input_json_delta."""
        out: list[bytes] = []
        if self._tool is None or self._tool[0] != part.index:
            out += self._close()
            block = {"type": "tool_use", "id": part.id, "name": part.name, "input": {}}
            self._blocks.append(block)
            self._tool = (part.index, len(self._blocks) - 1)
            out += self._start(len(self._blocks) - 1, block)
        if part.arguments:
            delta = {"type": "input_json_delta", "partial_json": part.arguments}
            out.append(event("content_block_delta", index=self._tool[1], delta=delta))
        return out

    def _end_tool(self, call: ToolCall | None) -> list[bytes]:
        """The streamed call's block closed: its input is the finished call's arguments
        (one whose text did not parse keeps what was sent; its text follows as text)."""
        if self._tool is None:
            return []
        _, at = self._tool
        self._tool = None
        if call is not None:
            self._blocks[at] = _tool_use(call)
        return [event("content_block_stop", index=at)]

    def _add(self, kind: str, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self._open != kind:
            out += self._close()
            empty = {"type": "text", "text": ""} if kind == "text" else _thinking("")
            self._blocks.append(empty)
            self._open = kind
            out += self._start(len(self._blocks) - 1, empty)
        block = self._blocks[-1]
        block[kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        out.append(event("content_block_delta", index=len(self._blocks) - 1, delta=delta))
        return out

    def _start(self, index: int, block: dict[str, Any]) -> list[bytes]:
        out = [event("content_block_start", index=index, content_block=block)]
        if not self._pinged:  # Anthropic pings once, after the first block starts
            self._pinged = True
            out.append(event("ping"))
        return out

    def _close(self) -> list[bytes]:
        if self._tool is not None:
            return self._end_tool(None)
        if self._open is None:
            return []
        self._open = None
        return [event("content_block_stop", index=len(self._blocks) - 1)]

    # ------------------------------------------------------------ whole response

    def collect(self, delta: Delta) -> None:
        self._feed(delta)  # the events are dropped: a whole message has none

    def response(self, finished: Finished) -> dict[str, Any]:
        if not self._blocks:
            self._blocks.append({"type": "text", "text": ""})
        return self._message(finished, usage_json(finished.usage))

    # ------------------------------------------------------------ streaming

    def stream_start(self) -> list[bytes]:
        self._streaming = True
        usage = {
            "input_tokens": self.prompt_tokens - self.cached_tokens,
            "output_tokens": 0,
            "cache_read_input_tokens": self.cached_tokens,
            "cache_creation_input_tokens": 0,
        }
        return [event("message_start", message=self._message(None, usage))]

    def stream_delta(self, delta: Delta) -> list[bytes]:
        return self._feed(delta)

    def stream_end(self, finished: Finished) -> list[bytes]:
        out = self._add("text", "") if not self._blocks else []
        return [
            *out,
            *self._close(),
            event(
                "message_delta",
                delta={
                    "stop_reason": stop_reason(finished),
                    "stop_sequence": finished.stop_sequence,
                },
                usage=usage_json(finished.usage),
            ),
            event("message_stop"),
        ]

    def stream_error(self, failed: Failed) -> list[bytes]:
        body = anthropic_error_body(failed.status, failed.message)
        return [event("error", error=body["error"])]

    def stream_keepalive(self) -> list[bytes]:
        # Anthropic's own keep-alive. Claude Code's idle timer skips pings (it
        # counts other events): see docs/agents.md for CLAUDE_STREAM_IDLE_TIMEOUT_MS.
        return [event("ping")]


def _thinking(text: str) -> dict[str, Any]:
    # mlxd does not sign reasoning; the field is there because clients expect it.
    return {"type": "thinking", "thinking": text, "signature": ""}
