"""A forced custom call's output: the row's whole answer is the tool's input.

With a forced custom tool (``Constraint.kind == "custom"``) the row generates
the input itself under the tool's grammar, with no call markers around it
(:mod:`mlxd.engine.custom_tools`). This wrapper keeps the reasoning split as
usual, holds the answer text back, and ends the row with one call to the
tool whose ``input`` is that text, so every API renders it as its call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any

from mlxd.engine.chat.harmony import make_splitter
from mlxd.engine.chat.output import OutputSplitter, RowOutput, Split, make_output
from mlxd.engine.custom_tools import INPUT
from mlxd.engine.messages import ToolCall


class FreeformOutput:
    """The splitter of a row whose answer is one custom tool's input."""

    def __init__(self, inner: OutputSplitter, tool: str):
        self._inner = inner
        self._tool = tool
        self._input: list[str] = []
        self.calls = 0
        self.failed_calls = 0

    @property
    def phase(self) -> str:
        return "tool" if self._input else self._inner.phase

    def feed(self, text: str) -> Split:
        return self._hold(self._inner.feed(text))

    def finish(self) -> Split:
        out = self._hold(self._inner.finish())
        text = "".join(self._input)
        self.calls = 1
        out.tool_calls.append(
            ToolCall(
                index=0,
                id=f"call_{uuid.uuid4().hex[:24]}",
                name=self._tool,
                arguments=json.dumps({INPUT: text}, ensure_ascii=False),
                input=text,
            )
        )
        return out

    def _hold(self, split: Split) -> Split:
        self._input.append(split.text)
        return Split(reasoning=split.reasoning)


def make_row_output(loaded: Any, request: Any, phase: str) -> RowOutput:
    """The row's splitter (:func:`~mlxd.engine.chat.output.make_output`), wrapped
    when the request forces a custom call."""
    constraint = request.constraint
    if constraint is not None and constraint.kind == "custom" and constraint.tool:
        # The answer is raw input text: no call markers are read inside it.
        plain = replace(request, parse_tools=False, constraint=None)
        return FreeformOutput(make_output(loaded, plain, phase), constraint.tool)
    return make_splitter(loaded, request, phase)
