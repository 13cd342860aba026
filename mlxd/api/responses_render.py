"""Engine events rendered as OpenAI Responses: a Response object or its SSE events.

Streaming follows the documented sequence, each event with a growing
``sequence_number``::

    response.created, response.in_progress,
    response.output_item.added (message), response.content_part.added (output_text),
    response.output_text.delta ...,
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.completed | response.incomplete (cut by max_output_tokens) | response.failed
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from mlxd.engine.messages import Delta, Failed, Finished, Usage

# Called with the final Response object and the assistant's text when a
# response ends (completed or incomplete): the route stores it.
OnDone = Callable[[dict[str, Any], str], None]


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def event(kind: str, seq: int, **fields: Any) -> bytes:
    body = msgspec.json.encode({"type": kind, "sequence_number": seq, **fields})
    return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


class ResponsesOutput:
    """Builds one response, whole or streamed (an :class:`mlxd.api.openai.Output`)."""

    def __init__(
        self, response_id: str, model: str, echo: dict[str, Any], on_done: OnDone | None = None
    ):
        self.id = response_id
        self.model = model
        self.echo = echo
        self.created = int(time.time())
        self.on_done = on_done
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self._text: list[str] = []
        self._seq = -1

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

    def _message(self, status: str, text: str | None) -> dict[str, Any]:
        content = [] if text is None else [self._part(text)]
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _final(self, finished: Finished) -> dict[str, Any]:
        status = "incomplete" if finished.finish_reason == "length" else "completed"
        text = "".join(self._text)
        body = self._response(status, [self._message(status, text)], usage=finished.usage)
        if status == "completed":
            body["completed_at"] = int(time.time())
        if self.on_done is not None:
            self.on_done(body, text)
        return body

    # ------------------------------------------------------------ whole response

    def collect(self, delta: Delta) -> None:
        self._text.append(delta.text)

    def response(self, finished: Finished) -> dict[str, Any]:
        return self._final(finished)

    # ------------------------------------------------------------ streaming

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._seq += 1
        return event(kind, self._seq, **fields)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def stream_start(self) -> list[bytes]:
        started = self._response("in_progress", [])
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
            self._event(
                "response.output_item.added",
                output_index=0,
                item=self._message("in_progress", None),
            ),
            self._event("response.content_part.added", **self._where(), part=self._part("")),
        ]

    def stream_delta(self, delta: Delta) -> list[bytes]:
        if not delta.text:
            return []
        self._text.append(delta.text)
        return [
            self._event(
                "response.output_text.delta", **self._where(), delta=delta.text, logprobs=[]
            )
        ]

    def stream_end(self, finished: Finished) -> list[bytes]:
        body = self._final(finished)
        (item,) = body["output"]
        text = item["content"][0]["text"]
        done = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [
            self._event("response.output_text.done", **self._where(), text=text, logprobs=[]),
            self._event("response.content_part.done", **self._where(), part=self._part(text)),
            self._event("response.output_item.done", output_index=0, item=item),
            self._event(done, response=body),
        ]

    def stream_error(self, failed: Failed) -> list[bytes]:
        error = {"code": failed.code, "message": failed.message}
        text = "".join(self._text)
        body = self._response("failed", [self._message("incomplete", text)], error=error)
        return [self._event("response.failed", response=body)]
