"""Engine events rendered as OpenAI JSON: whole responses and SSE chunks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from mlxd.api.answer import call_events
from mlxd.api.openai import custom
from mlxd.engine import Delta, Finished, TokenLogprob, ToolCall, ToolCallPart, Usage

Kind = Literal["chat", "completion"]
FINGERPRINT = "mlxd"


def usage_json(usage: Usage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.reasoning_tokens:
        out["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    return out


def _chat_logprob(lp: TokenLogprob) -> dict[str, Any]:
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": list(lp.bytes),
        "top_logprobs": [
            {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in lp.top
        ],
    }


def tool_call_json(call: ToolCall, *, index: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    if call.input is not None:
        out = {"id": call.id, **custom.call_json(call.name, call.input)}
    if index:
        out = {"index": call.index, **out}
    return out


def reasoning_fields(text: str, field: str) -> dict[str, str]:
    """The reasoning text under the configured name(s) (``[server] reasoning_field``)."""
    if not text:
        return {}
    if field == "both":
        return {"reasoning_content": text, "reasoning": text}
    return {field: text}


@dataclass
class _LegacyLogprobs:
    """The completions API's column-wise logprobs."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, lps: tuple[TokenLogprob, ...], offset: int) -> None:
        for lp in lps:
            self.tokens.append(lp.token)
            self.token_logprobs.append(lp.logprob)
            self.top_logprobs.append({t.token: t.logprob for t in lp.top})
            self.text_offset.append(offset)
            offset += len(lp.token)

    def json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


class Renderer:
    """Builds the response objects for one request."""

    def __init__(
        self,
        kind: Kind,
        request_id: str,
        model: str,
        *,
        logprobs: bool,
        reasoning_field: str = "reasoning_content",
    ):
        self.kind = kind
        self.reasoning_field = reasoning_field
        self._reasoning: list[str] = []
        self._calls: list[ToolCall] = []
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self._text: list[str] = []
        self._chat_lps: list[dict[str, Any]] = []
        self._legacy = _LegacyLogprobs()
        self._length = 0
        self._streamed_call = False  # a tool call has been streamed
        self._opened: set[int] = set()  # calls whose arguments are being streamed
        self._entries: list[dict[str, Any]] = []  # the current delta's tool_calls entries

    # ------------------------------------------------------------ whole response

    def collect(self, delta: Delta) -> None:
        if self.logprobs and delta.logprobs:
            if self.kind == "chat":
                self._chat_lps.extend(_chat_logprob(lp) for lp in delta.logprobs)
            else:
                self._legacy.add(delta.logprobs, self._length)
        self._text.append(delta.text)
        self._reasoning.append(delta.reasoning)
        self._calls.extend(delta.tool_calls)
        self._length += len(delta.text)

    def _message(self, text: str) -> dict[str, Any]:
        # Whitespace between or around tool calls (the template's "\n" separators)
        # is not an answer: content stays null, as OpenAI answers a call.
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if self._calls and not text.strip() else text,
        }
        message.update(reasoning_fields("".join(self._reasoning), self.reasoning_field))
        if self._calls:
            message["tool_calls"] = [tool_call_json(c, index=False) for c in self._calls]
        return message

    def response(self, finished: Finished) -> dict[str, Any]:
        text = "".join(self._text)
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": self._message(text),
                "logprobs": {"content": self._chat_lps} if self.logprobs else None,
                "finish_reason": finished.finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": self._legacy.json() if self.logprobs else None,
                "finish_reason": finished.finish_reason,
            }
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": FINGERPRINT,
            "choices": [choice],
            "usage": usage_json(finished.usage),
        }

    # ------------------------------------------------------------ streaming

    def _chunk(
        self, choice: dict[str, Any] | None, *, usage: dict | None = None, with_usage: bool
    ) -> bytes:
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": FINGERPRINT,
            "choices": [choice] if choice is not None else [],
        }
        if with_usage:
            obj["usage"] = usage
        return b"data: " + msgspec.json.encode(obj) + b"\n\n"

    def has_output(self, delta: Delta) -> bool:
        """Whether a delta is worth a chunk of its own (called once per delta, first)."""
        self._entries = self._call_entries(delta) if self.kind == "chat" else []
        if self._entries:
            self._streamed_call = True
        if self._separator(delta):
            return bool(self.logprobs and delta.logprobs) or bool(delta.reasoning)
        if delta.text or (self.logprobs and delta.logprobs):
            return True
        return self.kind == "chat" and bool(delta.reasoning or self._entries)

    def _call_entries(self, delta: Delta) -> list[dict[str, Any]]:
        """``delta.tool_calls`` entries: a call opens with its id and name, its arguments
        follow in pieces; a call not streamed comes whole (its index said once)."""
        entries: list[dict[str, Any]] = []
        for e in call_events(delta):
            if isinstance(e, ToolCallPart):
                if e.index not in self._opened:
                    self._opened.add(e.index)
                    entries.append(
                        tool_call_json(ToolCall(e.index, e.id, e.name, e.arguments), index=True)
                    )
                elif e.arguments:
                    entries.append({"index": e.index, "function": {"arguments": e.arguments}})
            elif e.index not in self._opened:
                entries.append(tool_call_json(e, index=True))
        return entries

    def _separator(self, delta: Delta) -> bool:
        """Whitespace alone after a streamed tool call: the separator between calls,
        never streamed as ``{"content": "\n"}`` (the whole answer's content is null)."""
        return (
            self._streamed_call
            and not self._entries
            and bool(delta.text)
            and not delta.text.strip()
        )

    def first_chunk(self, *, with_usage: bool) -> bytes | None:
        if self.kind != "chat":
            return None
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._chunk(choice, with_usage=with_usage)

    def delta_chunk(self, delta: Delta, *, with_usage: bool) -> bytes:
        if self.kind == "chat":
            lps = (
                {"content": [_chat_logprob(lp) for lp in delta.logprobs]} if self.logprobs else None
            )
            body: dict[str, Any] = {}
            text = "" if self._separator(delta) else delta.text
            if text or not (delta.reasoning or self._entries or self._separator(delta)):
                body["content"] = text
            body.update(reasoning_fields(delta.reasoning, self.reasoning_field))
            if self._entries:
                body["tool_calls"] = self._entries
            choice = {
                "index": 0,
                "delta": body,
                "logprobs": lps,
                "finish_reason": None,
            }
        else:
            legacy = None
            if self.logprobs:
                part = _LegacyLogprobs()
                part.add(delta.logprobs, self._length)
                legacy = part.json()
            choice = {"index": 0, "text": delta.text, "logprobs": legacy, "finish_reason": None}
        self._length += len(delta.text)
        return self._chunk(choice, with_usage=with_usage)

    def final_chunks(self, finished: Finished, *, with_usage: bool) -> list[bytes]:
        if self.kind == "chat":
            choice = {
                "index": 0,
                "delta": {},
                "logprobs": None,
                "finish_reason": finished.finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": "",
                "logprobs": None,
                "finish_reason": finished.finish_reason,
            }
        chunks = [self._chunk(choice, with_usage=with_usage)]
        if with_usage:
            chunks.append(self._chunk(None, usage=usage_json(finished.usage), with_usage=True))
        chunks.append(b"data: [DONE]\n\n")
        return chunks


def sse_error(body: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"
