"""Streamed tool-call arguments rendered by each API, in process (no model).

A call opened by its first part, its arguments in pieces, closed by its
finished ToolCall; a second call that comes whole; a streamed call whose text
then did not parse (no ToolCall) closed as sent. Whole answers read only the
finished calls.
"""

from __future__ import annotations

import json
from typing import Any

from mlxd.api.anthropic.render import MessagesOutput
from mlxd.api.openai.render import Renderer
from mlxd.api.openai.routes import ChatOutput
from mlxd.api.responses.render import ResponsesOutput
from mlxd.engine import Delta, ToolCall, ToolCallPart
from tests.support.translate import data_lines, finished, named_events

ARGS = '{"path": "a/long/file/name.txt", "n": 3}'
PIECES = ["", '{"path": "a/lo', "ng/file/na", 'me.txt"', ', "n": 3}']
CALL = ToolCall(0, "call_a", "write", ARGS)
WHOLE = ToolCall(1, "call_b", "add", '{"a": 1}')
STREAMED = [
    *(
        Delta("", (i,), tool_call_parts=(ToolCallPart(0, "call_a", "write", p),))
        for i, p in enumerate(PIECES[:-1])
    ),
    Delta(
        "\n",
        (9,),
        tool_calls=(CALL, WHOLE),
        tool_call_parts=(ToolCallPart(0, "call_a", "write", PIECES[-1]),),
    ),
]
# A call that opened, then its text did not parse: the text comes as content.
BROKEN = [
    Delta("", (1,), tool_call_parts=(ToolCallPart(0, "call_x", "write", ""),)),
    Delta("", (2,), tool_call_parts=(ToolCallPart(0, "call_x", "write", '{"pa'),)),
    Delta('<tool_call>{"pa</tool_call>', (3,)),
]


def test_chat_streams_the_pieces_and_a_whole_call_once():
    out = ChatOutput(Renderer("chat", "req", "tiny", logprobs=False), False)
    chunks = out.stream_start()
    for d in STREAMED:
        chunks += out.stream_delta(d)
    lines = data_lines(chunks + out.stream_end(finished("tool_calls")))
    entries = [
        e
        for line in lines
        if isinstance(line, dict) and line["choices"]
        for e in line["choices"][0]["delta"].get("tool_calls", [])
    ]
    first = entries[0]
    assert (first["index"], first["id"], first["function"]) == (
        0,
        "call_a",
        {"name": "write", "arguments": ""},
    )
    mine = [e["function"]["arguments"] for e in entries if e["index"] == 0]
    assert "".join(mine) == ARGS and len([m for m in mine if m]) == 4
    assert all("id" not in e for e in entries[1:] if e["index"] == 0)  # the id is said once
    (second,) = [e for e in entries if e["index"] == 1]
    assert second["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert all(
        "content" not in line["choices"][0]["delta"]
        or not line["choices"][0]["delta"]["content"].strip()
        for line in lines
        if isinstance(line, dict) and line["choices"]
    )
    whole = ChatOutput(Renderer("chat", "req", "tiny", logprobs=False), False)
    for d in STREAMED:
        whole.collect(d)
    message = whole.response(finished("tool_calls"))["choices"][0]["message"]
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == [ARGS, '{"a": 1}']


def _messages(deltas: list[Delta]) -> list[tuple[str, dict[str, Any]]]:
    out = MessagesOutput("msg", "tiny", prompt_tokens=3)
    chunks = out.stream_start()
    for d in deltas:
        chunks += out.stream_delta(d)
    return named_events(chunks + out.stream_end(finished("tool_calls")))


def test_messages_streams_input_json_pieces_in_one_block_per_call():
    events = _messages(STREAMED)
    starts = [
        e
        for k, e in events
        if k == "content_block_start" and e["content_block"]["type"] == "tool_use"
    ]
    assert [s["content_block"]["name"] for s in starts] == ["write", "add"]
    assert [s["index"] for s in starts] == [0, 1]
    pieces = [
        e["delta"]["partial_json"]
        for k, e in events
        if k == "content_block_delta" and e["index"] == 0
    ]
    assert "".join(pieces) == ARGS and len(pieces) == 4
    kinds = [k for k, _ in events]
    # Block 0 stops before block 1 starts: blocks come one after another.
    assert kinds.index("content_block_stop") < kinds.index(
        "content_block_start", kinds.index("content_block_start") + 1
    )
    out = MessagesOutput("msg", "tiny", prompt_tokens=3)
    for d in STREAMED:
        out.collect(d)
    blocks = out.response(finished("tool_calls"))["content"]
    assert [b["input"] for b in blocks if b["type"] == "tool_use"] == [json.loads(ARGS), {"a": 1}]


def test_messages_closes_a_broken_streamed_call_before_its_text():
    events = _messages(BROKEN)
    kinds = [(k, e.get("index")) for k, e in events if k.startswith("content_block")]
    assert kinds[0] == ("content_block_start", 0)
    assert ("content_block_stop", 0) in kinds
    assert kinds.index(("content_block_stop", 0)) < kinds.index(("content_block_start", 1))
    texts = [
        e["delta"]["text"] for k, e in events if k == "content_block_delta" and e["index"] == 1
    ]
    assert "".join(texts).startswith("<tool_call>")


def _responses(deltas: list[Delta]) -> list[tuple[str, dict[str, Any]]]:
    out = ResponsesOutput("resp", "tiny", {})
    chunks = out.stream_start()
    for d in deltas:
        chunks += out.stream_delta(d)
    return named_events(chunks + out.stream_end(finished("tool_calls")))


def test_responses_streams_argument_deltas_and_closes_each_call():
    events = _responses(STREAMED)
    added = [
        e["item"]
        for k, e in events
        if k == "response.output_item.added" and e["item"]["type"] == "function_call"
    ]
    assert [(i["type"], i["name"], i["arguments"]) for i in added] == [
        ("function_call", "write", ""),
        ("function_call", "add", ""),
    ]
    first = added[0]["id"]
    pieces = [
        e["delta"]
        for k, e in events
        if k == "response.function_call_arguments.delta" and e["item_id"] == first
    ]
    assert "".join(pieces) == ARGS and len(pieces) == 4
    done = [e for k, e in events if k == "response.function_call_arguments.done"]
    assert [d["arguments"] for d in done] == [ARGS, '{"a": 1}']
    final = events[-1][1]["response"]
    assert [o.get("arguments") for o in final["output"] if o["type"] == "function_call"] == [
        ARGS,
        '{"a": 1}',
    ]


def test_responses_closes_a_broken_streamed_call_incomplete():
    events = _responses(BROKEN)
    done = [e["item"] for k, e in events if k == "response.output_item.done"]
    assert done[0]["type"] == "function_call" and done[0]["status"] == "incomplete"
    assert done[0]["arguments"] == '{"pa'
