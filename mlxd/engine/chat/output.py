"""Splitting a row's text into answer, reasoning and tool calls, as it streams.

mlx-lm's :class:`TextStateMachine` finds the model's markers in the decoded
text (think markers, tool-call start/end) across any chunk boundary and strips
them; the tokenizer's own ``tool_parser`` (json_tools, mistral, pythonic, ...)
reads each finished call. mlxd adds only the bookkeeping: call ids and indexes,
and what happens to a call that does not parse (its raw text becomes answer
text and is counted, never dropped silently).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from mlx_lm.generate import TextStateMachine

from mlxd.engine.chat.tool_scan import SCANNED
from mlxd.engine.chat.tool_stream import PartialCall, read_partial
from mlxd.engine.custom_tools import INPUT, input_matches
from mlxd.engine.messages import CustomTool, ToolCall, ToolCallPart

logger = logging.getLogger(__name__)


@dataclass
class Split:
    """What one piece of text turned into."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_parts: list[ToolCallPart] = field(default_factory=list)


@dataclass
class _Opened:
    """A call of the current tool region whose arguments are being streamed."""

    index: int
    id: str
    name: str
    sent: str = ""


class RowOutput(Protocol):
    """What a row feeds its text to (:class:`OutputSplitter`, or a forced custom
    call's ``engine/chat/freeform.FreeformOutput``)."""

    @property
    def phase(self) -> str: ...

    @property
    def calls(self) -> int: ...

    @property
    def failed_calls(self) -> int: ...

    def feed(self, text: str) -> Split: ...

    def finish(self) -> Split: ...


def initial_phase(tokenizer: Any, prompt: list[int]) -> str:
    """``reasoning`` when the prompt leaves the model inside its think markers."""
    if not getattr(tokenizer, "has_thinking", False):
        return "normal"
    start = tokenizer.rfind_think_start(prompt)
    end = tokenizer.rfind_think_end(prompt)
    return "reasoning" if start > end else "normal"


def _transitions(
    tokenizer: Any, *, tools: bool, reasoning: bool
) -> dict[str, list[tuple[str, str]]]:
    # The same edges as mlx_lm.generate.make_text_state_machine, except that
    # tool markers are only read when the request asked for tools.
    edges: dict[str, list[tuple[str, str]]] = {}
    if reasoning and getattr(tokenizer, "has_thinking", False):
        edges.setdefault("normal", []).append((tokenizer.think_start, "reasoning"))
        edges["reasoning"] = [(tokenizer.think_end, "normal")]
    if tools and getattr(tokenizer, "has_tool_calling", False):
        edges.setdefault("normal", []).append((tokenizer.tool_call_start, "tool"))
        if "reasoning" in edges:
            edges["reasoning"].append((tokenizer.tool_call_start, "tool"))
        end = tokenizer.tool_call_end
        edges["tool"] = [(end, "normal")] if end else []
    return edges


def _read_partial(fmt: str | None, raw: str, parser: Any, tools: Any) -> list[PartialCall]:
    if fmt in SCANNED:
        return SCANNED[fmt](raw, parser, tools)
    return read_partial(fmt, raw, parser, tools)


def _no_tool_parser(text: str, tools: Any) -> Any:
    # Unreachable: without parse_tools there is no "tool" phase to close.
    raise ValueError("this row parses no tool calls")


class OutputSplitter:
    """One row's splitter. Feed it the row's text (stop strings already applied)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        parse_tools: bool = False,
        tools: tuple[dict, ...] = (),
        initial: str = "normal",
        reasoning: bool = True,
        tool_format: str | None = None,
        custom: tuple[CustomTool, ...] = (),
    ):
        edges = _transitions(tokenizer, tools=parse_tools, reasoning=reasoning)
        self._machine = TextStateMachine(edges) if edges else None
        self._state = self._machine.make_state(initial) if self._machine else None
        self._parser: Callable[[str, Any], Any] = (
            tokenizer.tool_parser if parse_tools else _no_tool_parser
        )
        self._markers = (tokenizer.tool_call_start or "", tokenizer.tool_call_end or "")
        self._tools = [dict(t) for t in tools] or None
        self._custom = {t.name: t for t in custom}
        self._tool_text: list[str] = []
        self._format = tool_format
        self._opened: list[_Opened] = []
        self.phase = initial
        self.calls = 0
        self.failed_calls = 0
        # (name, arguments) of the calls sent: a call repeated verbatim in one answer
        # is dropped (a small model under tool_choice "required", allowed several
        # calls, repeats its one call; running it twice helps no client).
        self._sent: set[tuple[str, str]] = set()

    def feed(self, text: str) -> Split:
        out = Split()
        if self._machine is None:
            out.text = text
            return out
        if text:
            self._state, segments = TextStateMachine.split(self._state, text)
            self._take(segments, out)
        return out

    def finish(self) -> Split:
        """The row ended: release held text and read an unfinished call."""
        out = Split()
        if self._machine is None:
            return out
        self._state, held, phase = TextStateMachine.flush(self._state)
        self._take([(phase, held)], out)
        if self._tool_text:
            # No end marker came: mistral's format has none; otherwise the call was cut.
            self._close_call(out, ended=False)
        return out

    def _take(self, segments: list[tuple[str | None, str]], out: Split) -> None:
        for phase, text in segments:
            if phase == "tool":
                if self.phase != "tool":
                    self._tool_text = []
                    self._opened = []
                self._tool_text.append(text)
                if text and self._format is not None:
                    self._stream(out)
            else:
                if self.phase == "tool" and phase != "tool":
                    self._close_call(out)
                if phase == "reasoning":
                    out.reasoning += text
                elif phase is not None:
                    out.text += text
            if phase is not None:
                self.phase = phase

    def _stream(self, out: Split) -> None:
        """Pieces of the region's calls that became certain (tool_stream.py)."""
        raw = "".join(self._tool_text)
        # Only a region's first call: in the formats that put several calls in one
        # section, the next would open while the first is unfinished (a client's
        # content blocks come one after another); they come whole at the end.
        partials = _read_partial(self._format, raw, self._parser, self._tools)[:1]
        for k, partial in enumerate(partials):
            if k == len(self._opened):
                if partial.name is None or partial.name in self._custom:
                    return  # a custom tool's input is checked whole: it comes whole
                opened = _Opened(self.calls + k, f"call_{uuid.uuid4().hex[:24]}", partial.name)
                self._opened.append(opened)
                out.tool_parts.append(ToolCallPart(opened.index, opened.id, opened.name, ""))
            opened = self._opened[k]
            if partial.prefix.startswith(opened.sent) and len(partial.prefix) > len(opened.sent):
                piece = partial.prefix[len(opened.sent) :]
                opened.sent = partial.prefix
                out.tool_parts.append(ToolCallPart(opened.index, opened.id, opened.name, piece))

    def _close_call(self, out: Split, *, ended: bool = True) -> None:
        raw = "".join(self._tool_text)
        opened, self._opened = self._opened, []
        self._tool_text = []
        try:
            parsed = self._parser(raw, self._tools)
            calls = parsed if isinstance(parsed, list) else [parsed]
            made = [
                m
                for k, c in enumerate(calls)
                if (m := self._tool_call(c, opened[k] if k < len(opened) else None)) is not None
            ]
        except Exception as exc:  # every parser raises its own kind
            self.failed_calls += 1
            self.calls += len(opened)  # their indexes were sent: never reused
            logger.warning("a tool call did not parse (%s); sent as text", exc)
            start, end = self._markers
            out.text += f"{start}{raw}{end if ended else ''}"
            return
        self.calls += max(0, len(opened) - len(made))
        for k, call in enumerate(made):
            if k < len(opened):
                out.tool_parts.append(self._rest(opened[k], call))
        out.tool_calls.extend(made)

    @staticmethod
    def _rest(opened: _Opened, call: ToolCall) -> ToolCallPart:
        """The last part of a streamed call: what its finished arguments add."""
        if call.name != opened.name or not call.arguments.startswith(opened.sent):
            # Not expected from the readers in tool_stream.py; said, never silent.
            logger.warning(
                "a streamed tool call ended other than it was sent (%s %r, then %s %r)",
                opened.name,
                opened.sent,
                call.name,
                call.arguments,
            )
            return ToolCallPart(call.index, call.id, call.name, "")
        return ToolCallPart(call.index, call.id, call.name, call.arguments[len(opened.sent) :])

    def _tool_call(self, call: Any, opened: _Opened | None = None) -> ToolCall | None:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"not a tool call: {call!r}")
        args = call.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(args, dict):
            raise ValueError(f"arguments are not an object: {args!r}")
        text = None
        custom = self._custom.get(call["name"])
        if custom is not None:
            # A custom tool's one string, checked against its grammar.
            text = args.get(INPUT)
            if not isinstance(text, str) or set(args) != {INPUT}:
                raise ValueError(f"a custom tool takes one string, {INPUT!r}: {args!r}")
            if not input_matches(custom, text):
                raise ValueError(f"the input to {custom.name!r} does not match its grammar")
        seen = (call["name"], json.dumps(args, sort_keys=True))
        if seen in self._sent and opened is None:  # a streamed one was seen: kept
            logger.info("a tool call repeated verbatim in one answer was dropped: %s", seen[0])
            return None
        self._sent.add(seen)
        call_id = call.get("id") if isinstance(call.get("id"), str) else None
        if opened is not None:  # its id and index were sent with its first part
            call_id = opened.id
            self.calls = opened.index
        made = ToolCall(
            index=self.calls,
            id=call_id or f"call_{uuid.uuid4().hex[:24]}",
            name=call["name"],
            arguments=json.dumps(args, ensure_ascii=False),
            input=text,
        )
        self.calls += 1
        return made


def make_output(loaded: Any, request: Any, phase: str) -> OutputSplitter:
    """The splitter for one request to ``loaded``.

    Chat answers are split (reasoning, and tool calls when the request has
    tools); a raw completion's text is passed through untouched.
    """
    chat = hasattr(request.prompt, "messages")
    tools = getattr(request.prompt, "tools", ())
    parse = chat and (
        request.parse_tools
        or (request.constraint is not None and request.constraint.kind == "tools")
    )
    return OutputSplitter(
        loaded.tokenizer,
        parse_tools=parse,
        tools=tools,
        initial=phase,
        reasoning=chat,
        tool_format=loaded.info.tool_format,
        custom=request.custom_tools,
    )
