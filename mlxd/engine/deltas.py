"""What a row sends while it generates: a :class:`Delta` of text, tokens and calls.

Plain frozen dataclasses, no logic and no MLX, like the rest of
:mod:`mlxd.engine.messages` (which re-exports these names).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TopLogprob:
    token: str
    id: int
    logprob: float
    bytes: tuple[int, ...]


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    id: int
    logprob: float
    bytes: tuple[int, ...]
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call; ``arguments`` is a JSON object as text.

    ``index`` counts the calls of one answer from 0. A call the model's parser
    could not read never becomes a ToolCall: its raw text is sent as ``text``
    instead (and counted), so nothing is dropped silently.
    """

    index: int
    id: str
    name: str
    arguments: str
    # A custom tool's call: its input string (``arguments`` is ``{"input": ...}``).
    input: str | None = None


@dataclass(frozen=True)
class ToolCallPart:
    """A piece of a tool call's arguments, sent while the model writes the call.

    The first part of a call (its ``index``) opens it with its ``id`` and
    ``name``; every part's ``arguments`` appends to what came before, and the
    parts of a call that ends well join to exactly the finished
    :class:`ToolCall`'s ``arguments`` (its last part comes in the same
    :class:`Delta` as that ToolCall). A call whose text then fails to parse
    gets no ToolCall: its raw text is sent as ``text``, and the opened call is
    left as it is (streamed renderers close it).
    """

    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Delta:
    """New output: answer text (possibly empty while a stop string may be
    forming), reasoning text, pieces of calls being written, finished tool
    calls, and the tokens.

    ``text`` never contains think or tool-call markers when the model has
    them: reasoning goes to ``reasoning``, calls to ``tool_calls``. Streamed
    renderers send ``tool_call_parts`` and close a call at its ToolCall; a
    whole answer reads ``tool_calls`` alone.
    """

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_parts: tuple[ToolCallPart, ...] = ()
