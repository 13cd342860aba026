"""Engine events to OpenAI Responses objects and their SSE events, in process.

Output items in the order the model produced them (reasoning, message,
function calls), the documented event sequence with a growing
``sequence_number``, ``incomplete`` for a length cut, the warm-up's empty
output, failures, and what the route stores for ``previous_response_id``.
"""

from __future__ import annotations

from typing import Any

from mlxd.api.responses.render import ResponsesOutput
from mlxd.engine import Delta, Failed, ToolCall
from tests.support.translate import finished, named_events

CALL = ToolCall(index=0, id="call_abc", name="get_weather", arguments='{"city": "Oslo"}')
ECHO = {"instructions": None, "temperature": 0.7}
USAGE = {
    "input_tokens": 12,
    "input_tokens_details": {"cached_tokens": 3},
    "output_tokens": 5,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 17,
}


class Stored:
    """The route's ``on_done``: what it would keep in the response store."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def __call__(self, body: dict[str, Any], turn: dict[str, Any]) -> None:
        self.calls.append((body, turn))


def output(on_done: Stored | None = None, *, warm_up: bool = False) -> ResponsesOutput:
    return ResponsesOutput("resp_1", "tiny", ECHO, on_done, warm_up=warm_up)


def whole(out: ResponsesOutput, deltas: list[Delta], **fin: Any) -> dict[str, Any]:
    for delta in deltas:
        out.collect(delta)
    return out.response(finished(**fin))


def stream(out: ResponsesOutput, deltas: list[Delta], **fin: Any) -> list[tuple[str, dict]]:
    chunks = out.stream_start()
    for delta in deltas:
        chunks += out.stream_delta(delta)
    return named_events(chunks + out.stream_end(finished(**fin)))


MIXED = [
    Delta("", (1,), reasoning="think"),
    Delta("", (2,), reasoning="ing"),
    Delta("Hel", (3,)),
    Delta("lo", (4,)),
    Delta("", (5,), tool_calls=(CALL,)),
]


def test_a_whole_response_with_reasoning_text_and_a_call():
    stored = Stored()
    out = output(stored)
    body = whole(out, MIXED, reason="tool_calls", cached=3)
    rs, msg, fc = body["output"]
    assert (
        rs["id"].startswith("rs_") and msg["id"].startswith("msg_") and fc["id"].startswith("fc_")
    )
    assert body == {
        "id": "resp_1",
        "object": "response",
        "created_at": out.created,
        "status": "completed",
        "error": None,
        "incomplete_details": None,
        "model": "tiny",
        "output": [
            {
                "id": rs["id"],
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "thinking"}],
            },
            {
                "id": msg["id"],
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}
                ],
            },
            {
                "id": fc["id"],
                "type": "function_call",
                "status": "completed",
                "call_id": "call_abc",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
        ],
        **ECHO,
        "usage": USAGE,
        "completed_at": body["completed_at"],
    }
    assert body["completed_at"] >= body["created_at"]
    # The route stores the response and the assistant turn, arguments as an object.
    ((kept, turn),) = stored.calls
    assert kept is body
    assert turn == {
        "role": "assistant",
        "content": "Hello",
        "tool_calls": [
            {
                "id": "call_abc",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
            }
        ],
    }


def test_a_length_cut_is_incomplete():
    body = whole(output(), [Delta("Hel", (1,))], reason="length")
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete" and "completed_at" not in body


def test_an_empty_answer_is_one_empty_message():
    stored = Stored()
    body = whole(output(stored), [])
    (item,) = body["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == ""
    assert stored.calls[0][1] == {"role": "assistant", "content": ""}


def test_a_warm_up_has_no_output():
    stored = Stored()
    body = whole(output(stored, warm_up=True), [Delta("x", (1,))], reason="length")
    assert body["status"] == "completed" and body["output"] == []
    assert body["usage"]["output_tokens"] == 5


def test_the_streamed_sequence():
    out = output()
    events = stream(out, MIXED, reason="tool_calls", cached=3)
    assert [n for n, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # reasoning
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",  # message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # function call
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["usage"] is None and created["id"] == "resp_1"
    # Items are announced empty and finished whole; deltas name their item.
    added = [e for n, e in events if n == "response.output_item.added"]
    assert [a["output_index"] for a in added] == [0, 1, 2]
    assert added[0]["item"]["content"] == [] and added[1]["item"]["content"] == []
    assert added[2]["item"]["arguments"] == "" and added[2]["item"]["status"] == "in_progress"
    deltas = [e for n, e in events if n == "response.output_text.delta"]
    assert [d["delta"] for d in deltas] == ["Hel", "lo"]
    assert {d["item_id"] for d in deltas} == {added[1]["item"]["id"]}
    assert all(d["content_index"] == 0 and d["logprobs"] == [] for d in deltas)
    text_done = next(e for n, e in events if n == "response.output_text.done")
    assert text_done["text"] == "Hello"
    args = next(e for n, e in events if n == "response.function_call_arguments.done")
    assert (args["name"], args["arguments"], args["output_index"]) == (
        "get_weather",
        '{"city": "Oslo"}',
        2,
    )
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["usage"] == USAGE
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]


def test_a_streamed_length_cut_ends_incomplete():
    events = stream(output(), [Delta("a", (1,)), Delta("b", (2,))], reason="length")
    names = [n for n, _ in events]
    assert names[-1] == "response.incomplete"
    item_done = events[-2][1]
    assert item_done["item"]["status"] == "incomplete"
    assert item_done["item"]["content"][0]["text"] == "ab"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_an_empty_stream_still_has_one_message():
    events = stream(output(), [Delta("", (1,))])
    assert [n for n, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == ""


def test_a_streamed_warm_up_is_created_then_completed():
    events = stream(output(warm_up=True), [Delta("x", (1,))], reason="length")
    assert [n for n, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.completed",
    ]
    assert events[-1][1]["response"]["output"] == []


def test_text_after_a_call_opens_a_new_message():
    deltas = [Delta("a", (1,)), Delta("", (2,), tool_calls=(CALL,)), Delta("b", (3,))]
    body = whole(output(), deltas)
    assert [i["type"] for i in body["output"]] == ["message", "function_call", "message"]
    assert body["output"][2]["content"][0]["text"] == "b"


def test_a_failure_mid_stream():
    out = output()
    chunks = out.stream_start() + out.stream_delta(Delta("par", (1,)))
    chunks += out.stream_error(Failed("generation_error", "the batch broke", 500))
    events = named_events(chunks)
    name, data = events[-1]
    assert name == "response.failed" and data["sequence_number"] == len(events) - 1
    failed = data["response"]
    assert failed["status"] == "failed" and failed["usage"] is None
    assert failed["error"] == {"code": "generation_error", "message": "the batch broke"}
    assert [(i["type"], i["status"]) for i in failed["output"]] == [("message", "incomplete")]
