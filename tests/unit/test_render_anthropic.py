"""Engine events to Anthropic Message objects and their SSE events, in process.

Content blocks in the order the model produced them (thinking, text, tool_use),
Anthropic's event sequence with its one ``ping``, the ``stop_reason`` mapping,
the usage split between fresh and cached prompt tokens, and errors.
"""

from __future__ import annotations

from typing import Any

import pytest

from mlxd.api.anthropic.render import MessagesOutput, stop_reason, usage_json
from mlxd.engine import Delta, Failed, ToolCall, Usage
from tests.support.translate import finished, named_events

CALL = ToolCall(index=0, id="toolu_1", name="get_weather", arguments='{"city": "Oslo"}')
EMPTY_ARGS = ToolCall(index=1, id="toolu_2", name="add", arguments="")
MIXED = [
    Delta("", (1,), reasoning="hm"),
    Delta("", (2,), reasoning="m"),
    Delta("Let me ", (3,)),
    Delta("check.", (4,)),
    Delta("", (5,), tool_calls=(CALL,)),
]


def output() -> MessagesOutput:
    return MessagesOutput("msg_1", "tiny", prompt_tokens=12)


def whole(deltas: list[Delta], **fin: Any) -> dict[str, Any]:
    out = output()
    for delta in deltas:
        out.collect(delta)
    return out.response(finished(**fin))


def stream(deltas: list[Delta], **fin: Any) -> list[tuple[str, dict]]:
    out = output()
    chunks = out.stream_start()
    for delta in deltas:
        chunks += out.stream_delta(delta)
    return named_events(chunks + out.stream_end(finished(**fin)))


@pytest.mark.parametrize(
    ("reason", "sequence", "expected"),
    [
        ("stop", None, "end_turn"),
        ("stop", "\n\nHuman:", "stop_sequence"),
        ("length", None, "max_tokens"),
        ("tool_calls", None, "tool_use"),
    ],
)
def test_stop_reasons(reason, sequence, expected):
    assert stop_reason(finished(reason, stop_sequence=sequence)) == expected
    body = whole([Delta("x", (1,))], reason=reason, stop_sequence=sequence)
    assert (body["stop_reason"], body["stop_sequence"]) == (expected, sequence)


def test_usage_splits_cached_prompt_tokens():
    assert usage_json(Usage(prompt_tokens=12, completion_tokens=5, cached_tokens=8)) == {
        "input_tokens": 4,
        "output_tokens": 5,
        "cache_read_input_tokens": 8,
        "cache_creation_input_tokens": 0,
    }


def test_a_whole_message_with_thinking_text_and_a_tool_use():
    body = whole([*MIXED, Delta("", (6,), tool_calls=(EMPTY_ARGS,))], reason="tool_calls", cached=2)
    assert body == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "tiny",
        "content": [
            {"type": "thinking", "thinking": "hmm", "signature": ""},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "toolu_2", "name": "add", "input": {}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 10,
            "output_tokens": 5,
            "cache_read_input_tokens": 2,
            "cache_creation_input_tokens": 0,
        },
    }


def test_an_empty_answer_is_one_empty_text_block():
    assert whole([Delta("", (1,))])["content"] == [{"type": "text", "text": ""}]


def test_the_streamed_sequence():
    events = stream(MIXED, reason="tool_calls", cached=2)
    assert [n for n, _ in events] == [
        "message_start",
        "content_block_start",  # thinking
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",  # text
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",  # tool_use
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "tiny",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": 12,
            "output_tokens": 0,
            "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0,
        },
    }
    body = [e for n, e in events[1:-2] if n != "ping"]
    assert body == [
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": "", "signature": ""},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "hm"},
        },
        {
            "type": "content_block_delta",
            "index": 0,
            "delta": {"type": "thinking_delta", "thinking": "m"},
        },
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "text_delta", "text": "Let me "},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "text_delta", "text": "check."},
        },
        {"type": "content_block_stop", "index": 1},
        {
            "type": "content_block_start",
            "index": 2,
            "content_block": {
                "type": "tool_use",
                "id": "toolu_1",
                "name": "get_weather",
                "input": {},
            },
        },
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": '{"city": "Oslo"}'},
        },
        {"type": "content_block_stop", "index": 2},
    ]
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {
            "input_tokens": 10,
            "output_tokens": 5,
            "cache_read_input_tokens": 2,
            "cache_creation_input_tokens": 0,
        },
    }
    assert events[-1][1] == {"type": "message_stop"}


def test_a_stream_stopped_by_a_stop_sequence():
    events = stream([Delta("Hi", (1,))], stop_sequence="END")
    assert [n for n, _ in events] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_an_empty_stream_opens_and_closes_one_text_block():
    events = stream([Delta("", (1,))], reason="length")
    assert [n for n, _ in events] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[3][1]["delta"] == {"type": "text_delta", "text": ""}
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"


@pytest.mark.parametrize(
    ("status", "kind"),
    [(500, "api_error"), (503, "overloaded_error"), (400, "invalid_request_error")],
)
def test_a_failure_mid_stream_is_an_error_event(status, kind):
    out = output()
    chunks = out.stream_start() + out.stream_delta(Delta("pa", (1,)))
    chunks += out.stream_error(Failed("generation_error", "the batch broke", status))
    name, data = named_events(chunks)[-1]
    assert name == "error"
    assert data == {"type": "error", "error": {"type": kind, "message": "the batch broke"}}
