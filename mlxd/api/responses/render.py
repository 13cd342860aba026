"""Engine events rendered as OpenAI Responses: a Response object or its SSE events.

Output items open as the model produces them: a ``reasoning`` item for
reasoning text, a ``message`` item for answer text, one ``function_call``
item per tool call. Streaming follows the documented sequence, each event
with a growing ``sequence_number``::

    response.created, response.in_progress,
    per item: response.output_item.added,
      message:   response.content_part.added, response.output_text.delta ...,
                 response.output_text.done, response.content_part.done
      reasoning: response.reasoning_text.delta ..., response.reasoning_text.done
      call:      response.function_call_arguments.delta, ...arguments.done
      custom:    response.custom_tool_call_input.delta, ...input.done
    response.output_item.done,
    response.completed | response.incomplete (cut by max_output_tokens) | response.failed
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from mlxd.api.answer import call_events
from mlxd.engine import Delta, Failed, Finished, ToolCall, ToolCallPart, Usage

# Called with the final Response object and the assistant turn (a chat
# message in the template's shape) when a response ends: the route stores it.
OnDone = Callable[[dict[str, Any], dict[str, Any]], None]


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def event(kind: str, seq: int, **fields: Any) -> bytes:
    body = msgspec.json.encode({"type": kind, "sequence_number": seq, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Item:
    """One output item while it is built."""

    def __init__(self, kind: str, index: int, call: ToolCall | None = None):
        self.kind = kind  # message | reasoning | function_call | custom_tool_call
        self.index = index
        self.call = call
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}.get(kind, "ctc")
        self.id = f"{prefix}_{uuid.uuid4().hex}"
        self.parts: list[str] = []
        self.broken = False  # a streamed call whose text then did not parse

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def json(self, status: str) -> dict[str, Any]:
        if self.kind == "message":
            content = [_text_part(self.text)] if status != "in_progress" else []
            return {
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "status": status,
                "content": content,
            }
        if self.kind == "reasoning":
            body = (
                [{"type": "reasoning_text", "text": self.text}] if status != "in_progress" else []
            )
            return {"id": self.id, "type": "reasoning", "summary": [], "content": body}
        assert self.call is not None
        if self.kind == "custom_tool_call":
            return {
                "id": self.id,
                "type": "custom_tool_call",
                "status": status,
                "call_id": self.call.id,
                "name": self.call.name,
                "input": (self.call.input or "") if status != "in_progress" else "",
            }
        return {
            "id": self.id,
            "type": "function_call",
            "status": status,
            "call_id": self.call.id,
            "name": self.call.name,
            "arguments": self.call.arguments if status != "in_progress" else "",
        }


class ResponsesOutput:
    """Builds one response, whole or streamed (an :class:`mlxd.api.openai.routes.Output`)."""

    def __init__(
        self,
        response_id: str,
        model: str,
        echo: dict[str, Any],
        on_done: OnDone | None = None,
        *,
        warm_up: bool = False,
    ):
        self.warm_up = warm_up  # a generate=false request: no output items at all
        self.id = response_id
        self.model = model
        self.echo = echo
        self.created = int(time.time())
        self.on_done = on_done
        self._items: list[_Item] = []
        self._open: _Item | None = None
        self._seq = -1
        self._streaming = False  # a whole response reads finished calls only
        self._calls: dict[int, _Item] = {}  # streamed calls not yet finished, by call index

    # ------------------------------------------------------------ objects

    def _response(
        self,
        status: str,
        output: list[dict[str, Any]],
        *,
        usage: Usage | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "model": self.model,
            "output": output,
            **self.echo,
            "usage": usage_json(usage) if usage is not None else None,
        }

    def _item_status(self, finished: Finished) -> str:
        return "incomplete" if finished.finish_reason == "length" else "completed"

    def _final(self, finished: Finished) -> dict[str, Any]:
        status = "completed" if self.warm_up else self._item_status(finished)
        if not self._items and not self.warm_up:
            self._items.append(_Item("message", 0))
        body = self._response(
            status, [item.json(status) for item in self._items], usage=finished.usage
        )
        if status == "completed":
            body["completed_at"] = int(time.time())
        if self.on_done is not None:
            self.on_done(body, self._assistant_turn())
        return body

    def _assistant_turn(self) -> dict[str, Any]:
        text = "".join(i.text for i in self._items if i.kind == "message")
        turn: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [i.call for i in self._items if i.call is not None and not i.broken]
        if calls:
            turn["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.loads(c.arguments or "{}")},
                }
                for c in calls
            ]
        return turn

    # ------------------------------------------------------------ building items

    def _feed(self, delta: Delta) -> list[bytes]:
        """Add a delta's reasoning, text and calls to the items; the events they make."""
        out: list[bytes] = []
        if self.warm_up:
            return out
        calls_first = bool(self._calls)  # text in this delta came after the open call
        if calls_first:
            out += self._feed_calls(delta)
        if delta.reasoning:
            out += self._add_text("reasoning", delta.reasoning)
        if delta.text:
            out += self._add_text("message", delta.text)
        if not calls_first:
            out += self._feed_calls(delta)
        return out

    def _feed_calls(self, delta: Delta) -> list[bytes]:
        out: list[bytes] = []
        for e in call_events(delta) if self._streaming else delta.tool_calls:
            if isinstance(e, ToolCallPart):
                out += self._call_part(e)
            elif e.index in self._calls:
                out += self._call_done(self._calls.pop(e.index), e)
            elif e.input is not None:  # a custom tool's call: never streamed in parts
                out += self._close()
                item = _Item("custom_tool_call", len(self._items), e)
                self._items.append(item)
                out += self._custom_events(item, e.input)
            else:
                out += self._call_part(ToolCallPart(e.index, e.id, e.name, e.arguments))
                out += self._call_done(self._calls.pop(e.index), e)
        return out

    def _call_part(self, part: ToolCallPart) -> list[bytes]:
        """A call's item opened at its first part; each piece of its arguments a delta."""
        out: list[bytes] = []
        item = self._calls.get(part.index)
        if item is None:
            out += self._close()
            item = _Item(
                "function_call", len(self._items), ToolCall(part.index, part.id, part.name, "")
            )
            self._items.append(item)
            self._calls[part.index] = item
            out.append(
                self._event(
                    "response.output_item.added",
                    output_index=item.index,
                    item=item.json("in_progress"),
                )
            )
        if part.arguments:
            item.parts.append(part.arguments)
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=item.index,
                    delta=part.arguments,
                )
            )
        return out

    def _call_done(
        self, item: _Item, call: ToolCall | None, status: str = "completed"
    ) -> list[bytes]:
        """A streamed call's item closed: by its finished call, or as sent (incomplete)."""
        if call is None:
            sent = item.call
            assert sent is not None
            call = ToolCall(sent.index, sent.id, sent.name, item.text)
            item.broken = True
        item.call = call
        where = {"item_id": item.id, "output_index": item.index}
        return [
            self._event(
                "response.function_call_arguments.done",
                **where,
                name=item.call.name,
                arguments=item.call.arguments,
            ),
            self._event(
                "response.output_item.done", output_index=item.index, item=item.json(status)
            ),
        ]

    def _custom_events(self, item: _Item, text: str) -> list[bytes]:
        # The input arrives whole (checked against its grammar first): one delta.
        where = {"item_id": item.id, "output_index": item.index}
        return [
            self._event(
                "response.output_item.added", output_index=item.index, item=item.json("in_progress")
            ),
            self._event("response.custom_tool_call_input.delta", **where, delta=text),
            self._event("response.custom_tool_call_input.done", **where, input=text),
            self._event(
                "response.output_item.done", output_index=item.index, item=item.json("completed")
            ),
        ]

    def _add_text(self, kind: str, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self._open is None or self._open.kind != kind:
            out += self._close()
            item = _Item(kind, len(self._items))
            self._items.append(item)
            self._open = item
            out.append(
                self._event(
                    "response.output_item.added",
                    output_index=item.index,
                    item=item.json("in_progress"),
                )
            )
            if kind == "message":
                out.append(
                    self._event(
                        "response.content_part.added", **self._where(item), part=_text_part("")
                    )
                )
        item = self._open
        item.parts.append(text)
        kind_event = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self._event(kind_event, **self._where(item), delta=text, **extra))
        return out

    def _close(self, status: str = "completed") -> list[bytes]:
        # A streamed call still open here had text that did not parse: closed as sent.
        out = [
            b for call in self._calls.values() for b in self._call_done(call, None, "incomplete")
        ]
        self._calls.clear()
        item, self._open = self._open, None
        if item is None:
            return out
        where = self._where(item)
        if item.kind == "message":
            out += [
                self._event("response.output_text.done", **where, text=item.text, logprobs=[]),
                self._event("response.content_part.done", **where, part=_text_part(item.text)),
            ]
        else:
            out.append(self._event("response.reasoning_text.done", **where, text=item.text))
        out.append(
            self._event(
                "response.output_item.done", output_index=item.index, item=item.json(status)
            )
        )
        return out

    @staticmethod
    def _where(item: _Item) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.index, "content_index": 0}

    # ------------------------------------------------------------ whole response

    def collect(self, delta: Delta) -> None:
        self._feed(delta)  # the events are dropped: a whole response has none

    def response(self, finished: Finished) -> dict[str, Any]:
        self._open = None
        return self._final(finished)

    # ------------------------------------------------------------ streaming

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._seq += 1
        return event(kind, self._seq, **fields)

    def stream_start(self) -> list[bytes]:
        self._streaming = True
        started = self._response("in_progress", [])
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
        ]

    def stream_delta(self, delta: Delta) -> list[bytes]:
        return self._feed(delta)

    def stream_end(self, finished: Finished) -> list[bytes]:
        status = self._item_status(finished)
        out = []
        if not self._items and not self.warm_up:
            out += self._add_text("message", "")
        out += self._close(status)
        body = self._final(finished)
        done = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [*out, self._event(done, response=body)]

    def stream_keepalive(self) -> list[bytes]:
        # An event, not an SSE comment: Codex's idle timer counts events.
        output = [item.json("in_progress") for item in self._items]
        return [self._event("response.in_progress", response=self._response("in_progress", output))]

    def stream_error(self, failed: Failed) -> list[bytes]:
        error = {"code": failed.code, "message": failed.message}
        output = [item.json("incomplete") for item in self._items]
        body = self._response("failed", output, error=error)
        return [self._event("response.failed", response=body)]
