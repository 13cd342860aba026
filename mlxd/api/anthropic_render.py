"""Engine events rendered as Anthropic Messages: a Message object or its SSE events.

Streaming follows Anthropic's sequence::

    message_start, content_block_start (text), ping,
    content_block_delta (text_delta) ...,
    content_block_stop, message_delta (stop_reason, usage), message_stop

and ``error`` when generation fails after the stream began. Usage follows
Anthropic's split: ``input_tokens`` are the prompt tokens not served from the
prompt cache, ``cache_read_input_tokens`` the ones that were.
"""

from __future__ import annotations

from typing import Any

import msgspec

from mlxd.api.errors import anthropic_error_body
from mlxd.engine.messages import Delta, Failed, Finished, Usage


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
    return "stop_sequence" if finished.stop_sequence is not None else "end_turn"


def event(kind: str, **fields: Any) -> bytes:
    body = msgspec.json.encode({"type": kind, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


class MessagesOutput:
    """Builds one message, whole or streamed (an :class:`mlxd.api.openai.Output`)."""

    def __init__(self, message_id: str, model: str, prompt_tokens: int):
        self.id = message_id
        self.model = model
        self.prompt_tokens = prompt_tokens
        self._text: list[str] = []

    def _message(
        self, content: list[dict[str, Any]], finished: Finished | None, usage: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason(finished) if finished else None,
            "stop_sequence": finished.stop_sequence if finished else None,
            "usage": usage,
        }

    # ------------------------------------------------------------ whole response

    def collect(self, delta: Delta) -> None:
        self._text.append(delta.text)

    def response(self, finished: Finished) -> dict[str, Any]:
        text = "".join(self._text)
        return self._message([{"type": "text", "text": text}], finished, usage_json(finished.usage))

    # ------------------------------------------------------------ streaming

    def stream_start(self) -> list[bytes]:
        usage = {
            "input_tokens": self.prompt_tokens,
            "output_tokens": 0,
            "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0,
        }
        return [
            event("message_start", message=self._message([], None, usage)),
            event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
            event("ping"),
        ]

    def stream_delta(self, delta: Delta) -> list[bytes]:
        if not delta.text:
            return []
        return [
            event("content_block_delta", index=0, delta={"type": "text_delta", "text": delta.text})
        ]

    def stream_end(self, finished: Finished) -> list[bytes]:
        return [
            event("content_block_stop", index=0),
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
