"""gpt-oss's Harmony format: its channels split into reasoning, answer and tool calls.

A Harmony answer is a run of messages, each a header and a body (one line
each, the second cut here)::

    <|channel|>analysis<|message|>thinking…<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city":"Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

The ``analysis`` channel is reasoning, a message addressed ``to=functions.NAME``
is a call to NAME whose body is its JSON arguments, and any other message
(``final``, a ``commentary`` preamble) is answer text. mlx-lm has no parser
for it, and the ``openai-harmony`` package needs to download its tokenizer
file on first use (no network here), so this is a small reader of the
channel markers in the decoded text, with :class:`OutputSplitter`'s
interface. Call arguments stream as the model writes them
(:func:`mlxd.engine.chat.tool_stream.json_prefix`).

Text that does not begin as a Harmony header (a model that ignores the
format) is answer text.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

from mlxd.engine.chat.output import OutputSplitter, Split, make_output
from mlxd.engine.chat.tool_stream import json_prefix
from mlxd.engine.messages import ToolCall, ToolCallPart

__all__ = ["HarmonySplitter", "looks_harmony", "make_splitter"]

logger = logging.getLogger(__name__)

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_HEADER_STARTS = ("<|start|>", "<|channel|>", "to=", " to=", "<|constrain|>", "assistant")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")


def looks_harmony(tokenizer: Any) -> bool:
    """Whether a tokenizer without a tool parser has a Harmony chat template (gpt-oss)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and all(
        m in template for m in ("<|channel|>", "<|message|>", "<|start|>")
    )


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` may be the start of one of ``markers``."""
    for n in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class HarmonySplitter:
    """One row's Harmony reader; feed it the row's text (stop strings already applied)."""

    def __init__(self, *, parse_tools: bool, reasoning: bool = True):
        self._tools = parse_tools
        self._reasoning = reasoning
        self._buffer = ""  # text not yet placed
        self._in_body = False
        self._kind = "normal"  # what the current body is: normal | reasoning | tool
        self._name = ""
        self._args = ""  # a call's body so far
        self._opened: ToolCallPart | None = None
        self._sent = ""
        self.phase = "normal"
        self.calls = 0
        self.failed_calls = 0

    # ------------------------------------------------------------ the interface

    def feed(self, text: str) -> Split:
        out = Split()
        self._buffer += text
        self._run(out, final=False)
        return out

    def finish(self) -> Split:
        """The row ended: the rest of the text placed; an unfinished call read as it is."""
        out = Split()
        self._run(out, final=True)
        if self._in_body:
            self._end_body(out, ended=False)
        elif self._buffer:
            self._emit(out, "normal", self._buffer)
        self._buffer = ""
        return out

    # ------------------------------------------------------------ reading

    def _run(self, out: Split, *, final: bool) -> None:
        while self._buffer:
            if not self._in_body:
                if not self._header(out, final=final):
                    return
                continue
            ends = [(i, m) for m in ENDS if (i := self._buffer.find(m)) >= 0]
            if not ends:
                keep = 0 if final else _held(self._buffer, ENDS)
                self._body_text(out, self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return
            at, marker = min(ends)
            self._body_text(out, self._buffer[:at])
            # <|start|> begins the next header; the others end the message.
            self._buffer = self._buffer[at if marker == "<|start|>" else at + len(marker) :]
            self._end_body(out)

    def _header(self, out: Split, *, final: bool) -> bool:
        """Read a header up to <|message|>; False while it is unfinished."""
        stripped = self._buffer.lstrip()
        if not stripped:
            return False
        if not any(stripped.startswith(h) or h.startswith(stripped) for h in _HEADER_STARTS):
            # Not Harmony: answer text, up to a header that may follow.
            self._in_body, self._kind = True, "normal"
            return True
        at = self._buffer.find(MESSAGE)
        if at < 0:
            return False
        header, self._buffer = self._buffer[:at], self._buffer[at + len(MESSAGE) :]
        channel = m.group(1) if (m := _CHANNEL.search(header)) else ""
        recipient = r.group(1) if (r := _RECIPIENT.search(header)) else ""
        self._in_body = True
        if recipient.startswith("functions.") and self._tools:
            self._kind, self._name, self._args = "tool", recipient[len("functions.") :], ""
            self._opened, self._sent = None, ""
        elif channel == "analysis" and self._reasoning:
            self._kind = "reasoning"
        else:
            self._kind = "normal"
        self.phase = self._kind
        return True

    def _body_text(self, out: Split, text: str) -> None:
        if not text:
            return
        if self._kind != "tool":
            self._emit(out, self._kind, text)
            return
        self._args += text
        if self._opened is None:
            self._opened = ToolCallPart(self.calls, f"call_{uuid.uuid4().hex[:24]}", self._name, "")
            out.tool_parts.append(self._opened)
        start = len(self._args) - len(self._args.lstrip())
        prefix, _ = json_prefix(self._args, start)
        if prefix.startswith(self._sent) and len(prefix) > len(self._sent):
            out.tool_parts.append(self._piece(prefix[len(self._sent) :]))
            self._sent = prefix

    def _piece(self, text: str) -> ToolCallPart:
        assert self._opened is not None
        return ToolCallPart(self._opened.index, self._opened.id, self._opened.name, text)

    def _emit(self, out: Split, kind: str, text: str) -> None:
        if kind == "reasoning":
            out.reasoning += text
        else:
            out.text += text

    def _end_body(self, out: Split, *, ended: bool = True) -> None:
        self._in_body = False
        self.phase = "normal"
        if self._kind != "tool":
            return
        try:
            args = json.loads(self._args) if self._args.strip() else {}
            if not isinstance(args, dict):
                raise ValueError(f"arguments are not an object: {args!r}")
        except ValueError as exc:
            self.failed_calls += 1
            self.calls += self._opened is not None  # its index was sent: never reused
            logger.warning("a tool call did not parse (%s); sent as text", exc)
            out.text += f"<|channel|>commentary to=functions.{self._name}{MESSAGE}{self._args}"
            out.text += "<|call|>" if ended else ""
            return
        arguments = json.dumps(args, ensure_ascii=False)
        call_id = self._opened.id if self._opened is not None else f"call_{uuid.uuid4().hex[:24]}"
        if self._opened is not None:
            rest = arguments[len(self._sent) :] if arguments.startswith(self._sent) else ""
            out.tool_parts.append(self._piece(rest))
        out.tool_calls.append(ToolCall(self.calls, call_id, self._name, arguments))
        self.calls += 1


def make_splitter(loaded: Any, request: Any, phase: str) -> OutputSplitter | HarmonySplitter:
    """The row's splitter: Harmony's reader for a chat request to a Harmony model, else
    :func:`mlxd.engine.chat.output.make_output`'s."""
    chat = hasattr(request.prompt, "messages")
    if not chat or loaded.info.tool_format != "harmony":
        return make_output(loaded, request, phase)
    parse = request.parse_tools or (
        request.constraint is not None and request.constraint.kind == "tools"
    )
    return HarmonySplitter(parse_tools=parse)
