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
from typing import Any

from mlx_lm.generate import TextStateMachine

from mlxd.engine.messages import ToolCall

logger = logging.getLogger(__name__)


@dataclass
class Split:
    """What one piece of text turned into."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


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
    ):
        edges = _transitions(tokenizer, tools=parse_tools, reasoning=reasoning)
        self._machine = TextStateMachine(edges) if edges else None
        self._state = self._machine.make_state(initial) if self._machine else None
        self._parser: Callable[[str, Any], Any] = (
            tokenizer.tool_parser if parse_tools else _no_tool_parser
        )
        self._markers = (tokenizer.tool_call_start or "", tokenizer.tool_call_end or "")
        self._tools = [dict(t) for t in tools] or None
        self._tool_text: list[str] = []
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
                self._tool_text.append(text)
            else:
                if self.phase == "tool" and phase != "tool":
                    self._close_call(out)
                if phase == "reasoning":
                    out.reasoning += text
                elif phase is not None:
                    out.text += text
            if phase is not None:
                self.phase = phase

    def _close_call(self, out: Split, *, ended: bool = True) -> None:
        raw = "".join(self._tool_text)
        self._tool_text = []
        try:
            parsed = self._parser(raw, self._tools)
            calls = parsed if isinstance(parsed, list) else [parsed]
            made = [m for m in (self._tool_call(c) for c in calls) if m is not None]
        except Exception as exc:  # every parser raises its own kind
            self.failed_calls += 1
            logger.warning("a tool call did not parse (%s); sent as text", exc)
            start, end = self._markers
            out.text += f"{start}{raw}{end if ended else ''}"
            return
        out.tool_calls.extend(made)

    def _tool_call(self, call: Any) -> ToolCall | None:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"not a tool call: {call!r}")
        args = call.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(args, dict):
            raise ValueError(f"arguments are not an object: {args!r}")
        seen = (call["name"], json.dumps(args, sort_keys=True))
        if seen in self._sent:
            logger.info("a tool call repeated verbatim in one answer was dropped: %s", seen[0])
            return None
        self._sent.add(seen)
        call_id = call.get("id") if isinstance(call.get("id"), str) else None
        made = ToolCall(
            index=self.calls,
            id=call_id or f"call_{uuid.uuid4().hex[:24]}",
            name=call["name"],
            arguments=json.dumps(args, ensure_ascii=False),
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
        loaded.tokenizer, parse_tools=parse, tools=tools, initial=phase, reasoning=chat
    )
