"""Engine events to OpenAI chat and completion JSON and SSE bytes, in process.

The renderer is driven the way the route drives it (:class:`ChatOutput`): whole
responses from collected deltas, streams chunk by chunk with and without
``stream_options.include_usage``, tool calls, reasoning, logprobs and errors.
"""

from __future__ import annotations

from typing import Any

import pytest

from mlxd.api.openai.render import Kind, Renderer, sse_error
from mlxd.api.openai.routes import ChatOutput
from mlxd.engine import Delta, Failed, TokenLogprob, ToolCall, TopLogprob
from tests.support.translate import data_lines, finished

CALL = ToolCall(index=0, id="call_abc", name="get_weather", arguments='{"city": "Oslo"}')
CALL2 = ToolCall(index=1, id="call_def", name="add", arguments='{"a": 1}')


def output(
    kind: Kind = "chat",
    *,
    usage: bool = False,
    logprobs: bool = False,
    field: str = "reasoning_content",
) -> ChatOutput:
    renderer = Renderer(kind, "req-1", "tiny", logprobs=logprobs, reasoning_field=field)
    return ChatOutput(renderer, usage)


def whole(out: ChatOutput, deltas: list[Delta], **fin: Any) -> dict[str, Any]:
    for delta in deltas:
        out.collect(delta)
    return out.response(finished(**fin))


def stream(out: ChatOutput, deltas: list[Delta], **fin: Any) -> list[Any]:
    chunks = out.stream_start()
    for delta in deltas:
        chunks += out.stream_delta(delta)
    return data_lines(chunks + out.stream_end(finished(**fin)))


def lp(token: str, logprob: float, *top: tuple[str, float]) -> TokenLogprob:
    tops = tuple(TopLogprob(t, i, p, tuple(t.encode())) for i, (t, p) in enumerate(top))
    return TokenLogprob(token, 7, logprob, tuple(token.encode()), tops)


# ---------------------------------------------------------------- whole responses


def test_a_whole_chat_completion():
    out = output()
    body = whole(out, [Delta("Hel", (1,)), Delta("", (2,)), Delta("lo", (3,))], cached=4)
    assert body == {
        "id": "req-1",
        "object": "chat.completion",
        "created": out.r.created,
        "model": "tiny",
        "system_fingerprint": "mlxd",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 12,
            "completion_tokens": 5,
            "total_tokens": 17,
            "prompt_tokens_details": {"cached_tokens": 4},
        },
    }


@pytest.mark.parametrize("reason", ["stop", "length", "tool_calls"])
def test_finish_reasons_pass_through(reason):
    body = whole(output(), [Delta("x", (1,))], reason=reason)
    assert body["choices"][0]["finish_reason"] == reason


def test_tool_calls_leave_content_null():
    body = whole(
        output(),
        [Delta("", (1,), tool_calls=(CALL,)), Delta("", (2,), tool_calls=(CALL2,))],
        reason="tool_calls",
    )
    message = body["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_abc",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            },
            {
                "id": "call_def",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 1}'},
            },
        ],
    }
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    # Text next to a call stays.
    body = whole(output(), [Delta("Sure.", (1,)), Delta("", (2,), tool_calls=(CALL,))])
    assert body["choices"][0]["message"]["content"] == "Sure."


@pytest.mark.parametrize(
    ("field", "expected"),
    [
        ("reasoning_content", {"reasoning_content": "hmm, ok"}),
        ("reasoning", {"reasoning": "hmm, ok"}),
        ("both", {"reasoning_content": "hmm, ok", "reasoning": "hmm, ok"}),
    ],
)
def test_reasoning_goes_to_the_configured_field(field, expected):
    deltas = [
        Delta("", (1,), reasoning="hmm"),
        Delta("", (2,), reasoning=", ok"),
        Delta("42", (3,)),
    ]
    message = whole(output(field=field), deltas)["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "42", **expected}
    # No reasoning, no field.
    assert set(whole(output(field=field), [Delta("42", (1,))])["choices"][0]["message"]) == {
        "role",
        "content",
    }


def test_chat_logprobs():
    deltas = [Delta("Hi", (7,), logprobs=(lp("Hi", -0.5, ("Hi", -0.5), ("Yo", -1.5)),))]
    choice = whole(output(logprobs=True), deltas)["choices"][0]
    assert choice["logprobs"] == {
        "content": [
            {
                "token": "Hi",
                "logprob": -0.5,
                "bytes": [72, 105],
                "top_logprobs": [
                    {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                    {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]},
                ],
            }
        ]
    }


def test_a_whole_legacy_completion_with_column_logprobs():
    out = output("completion", logprobs=True)
    deltas = [
        Delta("ab", (1, 2), logprobs=(lp("a", -0.1, ("a", -0.1)), lp("b", -0.2))),
        Delta("cd", (3,), logprobs=(lp("cd", -0.3),)),
    ]
    body = whole(out, deltas, reason="length", prompt=3, completion=3)
    assert body["object"] == "text_completion" and body["id"] == "req-1"
    assert body["choices"] == [
        {
            "index": 0,
            "text": "abcd",
            "logprobs": {
                "tokens": ["a", "b", "cd"],
                "token_logprobs": [-0.1, -0.2, -0.3],
                "top_logprobs": [{"a": -0.1}, {}, {}],
                "text_offset": [0, 1, 2],
            },
            "finish_reason": "length",
        }
    ]
    assert body["usage"]["total_tokens"] == 6
    assert whole(output("completion"), [Delta("x", (1,))])["choices"][0]["logprobs"] is None


# ---------------------------------------------------------------- streams


def test_a_chat_stream_with_usage_in_order():
    events = stream(
        output(usage=True),
        [Delta("He", (1,)), Delta("", (2,)), Delta("llo", (3,))],
        reason="length",
        cached=2,
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {"req-1"}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    # Every chunk carries "usage": null but the last, which carries only usage.
    assert [c["usage"] for c in chunks[:-1]] == [None] * 4
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [
        {"role": "assistant", "content": ""},
        {"content": "He"},  # the empty delta (a stop string forming) made no chunk
        {"content": "llo"},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None, None, None, "length"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 12,
        "completion_tokens": 5,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_without_include_usage_no_chunk_has_a_usage_key():
    events = stream(output(), [Delta("x", (1,))])
    assert events[-1] == "[DONE]" and len(events) == 4
    assert all("usage" not in c for c in events[:-1])
    assert events[-2]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }


def test_streamed_tool_calls_and_reasoning():
    deltas = [
        Delta("", (1,), reasoning="let me see"),
        Delta("", (2,), tool_calls=(CALL,)),
        Delta("", (3,), tool_calls=(CALL2,)),
    ]
    events = stream(output(field="both"), deltas, reason="tool_calls")
    bodies = [c["choices"][0]["delta"] for c in events[1:-2]]
    assert bodies == [
        {"reasoning_content": "let me see", "reasoning": "let me see"},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ]
        },
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "call_def",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1}'},
                }
            ]
        },
    ]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_chat_logprobs():
    events = stream(output(logprobs=True), [Delta("Hi", (7,), logprobs=(lp("Hi", -0.5),))])
    choice = events[1]["choices"][0]
    assert choice["logprobs"] == {
        "content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}]
    }
    assert events[0]["choices"][0]["logprobs"] is None  # the role chunk
    assert events[-2]["choices"][0]["logprobs"] is None  # the finish chunk


def test_a_legacy_completion_stream():
    out = output("completion", usage=True, logprobs=True)
    deltas = [
        Delta("ab", (1, 2), logprobs=(lp("a", -0.1), lp("b", -0.2))),
        Delta("c", (3,), logprobs=(lp("c", -0.3),)),
    ]
    events = stream(out, deltas)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"text_completion"}
    # No role chunk: text chunks, the finish chunk, the usage chunk.
    assert [c["choices"][0]["text"] for c in chunks[:3]] == ["ab", "c", ""]
    assert chunks[0]["choices"][0]["logprobs"]["text_offset"] == [0, 1]
    assert chunks[1]["choices"][0]["logprobs"] == {
        "tokens": ["c"],
        "token_logprobs": [-0.3],
        "top_logprobs": [{}],
        "text_offset": [2],  # counted on from the first chunk
    }
    assert chunks[2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["total_tokens"] == 17


def test_a_legacy_completion_stream_drops_empty_deltas_and_reasoning():
    events = stream(output("completion"), [Delta("", (1,), reasoning="r"), Delta("x", (2,))])
    assert [c["choices"][0]["text"] for c in events[:-1]] == ["x", ""]


def test_a_failure_mid_stream_is_an_error_chunk_without_done():
    out = output()
    failed = Failed("generation_error", "the batch broke", 500)
    (chunk,) = out.stream_error(failed)
    assert data_lines([chunk]) == [
        {
            "error": {
                "message": "the batch broke",
                "type": "server_error",
                "param": None,
                "code": "generation_error",
            }
        }
    ]
    assert sse_error({"error": {}}) == b'data: {"error":{}}\n\n'


def test_whitespace_between_parallel_tool_calls_is_not_content():
    """Issue 22: two calls answered content "\n", streamed as a {"content": "\n"} delta."""
    deltas = [
        Delta("", (2,), tool_calls=(CALL,)),
        Delta("\n", (3,)),
        Delta("", (4,), tool_calls=(CALL2,)),
        Delta("\n", (5,)),
    ]
    body = whole(output(), deltas, reason="tool_calls")
    assert body["choices"][0]["message"]["content"] is None
    events = stream(output(), deltas, reason="tool_calls")
    bodies = [c["choices"][0]["delta"] for c in events[1:-2]]
    assert [list(b) for b in bodies] == [["tool_calls"], ["tool_calls"]], bodies
    # Text after a call that says something is still content.
    said = whole(output(), [Delta("", (2,), tool_calls=(CALL,)), Delta("\nDone.", (3,))])
    assert said["choices"][0]["message"]["content"] == "\nDone."
