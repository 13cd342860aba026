"""Tool calls and structured output through the real daemon on tiny random-weight models.

A random model never chooses to call a tool or to write JSON, so what is
checked here is what mlxd enforces: forced calls (tool_choice "required" or a
named function) in the model's native format, JSON schemas, and that a free
row in the same batch is untouched. Outputs validate with ``jsonschema``.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import httpx
import jsonschema
import pytest

from tests.support.daemon import Daemon
from tests.support.daemons import tools_config
from tests.support.schemas import JSON_SCHEMAS

MODEL = "tiny-tools"


@pytest.fixture(scope="module")
def hermes(apps) -> Daemon:
    return apps.get(tools_config("hermes"))


def chat(d: Daemon, content: str = "hello", **body: Any) -> httpx.Response:
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        **body,
    }
    return httpx.post(f"{d.url}/v1/chat/completions", json=payload, timeout=120)


def stream_chat(d: Daemon, content: str = "hello", **body: Any) -> dict[str, Any]:
    """A streamed answer reassembled by the openai SDK's own helper."""
    client = d.openai()
    messages = [{"role": "user", "content": content}]
    with client.chat.completions.stream(
        model=MODEL, messages=messages, temperature=0, **body
    ) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    return {
        "content": choice.message.content,
        "finish_reason": choice.finish_reason,
        "calls": [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []],
    }


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
        },
        "strict": True,
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_call(call: dict[str, Any]) -> tuple[str, dict]:
    assert call["type"] == "function" and call["id"]
    name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
    jsonschema.validate(args, SCHEMAS[name])
    return name, args


# ---------------------------------------------------------------- tools


def test_models_lists_tool_support(hermes: Daemon):
    (entry,) = httpx.get(f"{hermes.url}/v1/models").json()["data"]
    caps = entry["capabilities"]
    assert caps["tools"] is True and caps["tool_format"] == "json_tools"
    assert caps["tool_choice_required"] is True and caps["structured_output"] is True


def test_required_returns_one_valid_call(hermes: Daemon):
    r = chat(hermes, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    (call,) = message["tool_calls"]
    check_call(call)


def test_named_function_is_the_one_called(hermes: Daemon):
    for name in ("add", "get_weather"):
        choice = {"type": "function", "function": {"name": name}}
        r = chat(hermes, "call it", tools=TOOLS, tool_choice=choice, max_tokens=80)
        body = r.json()["choices"][0]
        assert body["finish_reason"] == "tool_calls", body
        (call,) = body["message"]["tool_calls"]
        assert check_call(call)[0] == name


def test_streamed_calls_reassembled_by_the_sdk_equal_the_whole_answer(hermes: Daemon):
    kw = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 120}
    whole = chat(hermes, "plan a trip", **kw).json()["choices"][0]
    streamed = stream_chat(hermes, "plan a trip", **kw)
    expected = [
        (c["function"]["name"], c["function"]["arguments"])
        for c in whole["message"].get("tool_calls") or []
    ]
    assert expected, whole
    assert streamed["calls"] == expected
    assert streamed["finish_reason"] == whole["finish_reason"]
    for name, args in expected:
        jsonschema.validate(json.loads(args), SCHEMAS[name])


def test_history_with_tool_results_renders_and_answers(hermes: Daemon):
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    body = {"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 8}
    r = httpx.post(f"{hermes.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 100  # the tools and the history are in it


def test_tool_choice_none_renders_without_tools(hermes: Daemon):
    with_tools = chat(hermes, tools=TOOLS, max_tokens=1).json()["usage"]["prompt_tokens"]
    without = chat(hermes, tools=TOOLS, tool_choice="none", max_tokens=1).json()
    assert without["usage"]["prompt_tokens"] < with_tools


# ---------------------------------------------------------------- structured output


def schema_format(name: str, strict: bool = True) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": JSON_SCHEMAS[name], "strict": strict},
    }


@pytest.mark.parametrize("name", sorted(JSON_SCHEMAS))
def test_json_schema_output_validates_and_streams_the_same(hermes: Daemon, name: str):
    kw = {"response_format": schema_format(name), "max_tokens": 96}
    r = chat(hermes, f"give me {name}", **kw)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), JSON_SCHEMAS[name])
    streamed = stream_chat(hermes, f"give me {name}", **kw)
    assert streamed["content"] == choice["message"]["content"]


def test_json_object_mode_gives_an_object_or_is_cut_by_length(hermes: Daemon):
    r = chat(hermes, response_format={"type": "json_object"}, max_tokens=40)
    choice = r.json()["choices"][0]
    text = choice["message"]["content"]
    assert text.startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert choice["finish_reason"] == "length"


def test_truncated_json_ends_with_length(hermes: Daemon):
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "long", "schema": schema}}
    choice = chat(hermes, response_format=fmt, max_tokens=6).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["message"]["content"])


def test_completions_take_response_format_too(hermes: Daemon):
    body = {
        "model": MODEL,
        "prompt": "json:",
        "max_tokens": 64,
        "temperature": 0,
        "response_format": schema_format("enum"),
    }
    r = httpx.post(f"{hermes.url}/v1/completions", json=body, timeout=60)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), JSON_SCHEMAS["enum"])


def test_free_rows_in_a_mixed_batch_equal_their_solo_runs(hermes: Daemon):
    free = [f"free row {i} about the river" for i in range(4)]
    solo = [chat(hermes, p, max_tokens=24).json()["choices"][0]["message"]["content"] for p in free]
    results: dict[int, httpx.Response] = {}

    def send(i: int) -> None:
        if i < 4:
            results[i] = chat(hermes, free[i], max_tokens=24)
        else:
            name = sorted(JSON_SCHEMAS)[i]
            results[i] = chat(hermes, f"c{i}", response_format=schema_format(name), max_tokens=64)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[i].headers["x-mlxd-lane"] == "batch" for i in range(8))
    for i in range(4):
        assert results[i].json()["choices"][0]["message"]["content"] == solo[i]
    for i in range(4, 8):
        content = results[i].json()["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(content), JSON_SCHEMAS[sorted(JSON_SCHEMAS)[i]])
    stats = hermes.stats()
    assert stats["counters"]["constrained_rows"] >= 4


# ---------------------------------------------------------------- bad input


def bad(r: httpx.Response, code: str, param: str | None = None) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


def test_bad_tool_and_schema_requests_get_400s_and_the_daemon_serves_on(hermes: Daemon):
    strict = {
        "type": "json_schema",
        "json_schema": {
            "name": "u",
            "schema": {"type": "array", "uniqueItems": True},
            "strict": True,
        },
    }
    assert "uniqueItems" in bad(chat(hermes, response_format=strict), "invalid_schema")
    # Without strict the keyword is ignored, not refused.
    lenient = {**strict, "json_schema": {**strict["json_schema"], "strict": False}}
    assert chat(hermes, response_format=lenient, max_tokens=4).status_code == 200
    unknown = {"type": "function", "function": {"name": "nope"}}
    assert "nope" in bad(chat(hermes, tools=TOOLS, tool_choice=unknown), "invalid_value")
    no_name = [{"type": "function", "function": {"parameters": {"type": "object"}}}]
    bad(chat(hermes, tools=no_name), "invalid_value", "tools[0].function.name")
    not_object = [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]
    bad(chat(hermes, tools=not_object), "invalid_value", "tools[0].function.parameters")
    bad(chat(hermes, response_format={"type": "yaml"}), "invalid_value", "response_format.type")
    many = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
        for i in range(129)
    ]
    bad(chat(hermes, tools=many), "invalid_value", "tools")
    bad(chat(hermes, tool_choice="required"), "invalid_value", "tool_choice")
    both = {"response_format": {"type": "json_object"}, "tool_choice": "required"}
    bad(chat(hermes, tools=TOOLS, **both), "invalid_value", "response_format")
    bad(chat(hermes, chat_template_kwargs={"tools": []}), "invalid_value")
    evil = {"chat_template": "{{ 7 * 7 }}"}
    assert "chat_template" in bad(chat(hermes, chat_template_kwargs=evil), "invalid_value")
    assert chat(hermes, max_tokens=2).status_code == 200


# ---------------------------------------------------------------- a second format


def test_mistral_format_forced_call(apps):
    d = apps.get(tools_config("mistral"))
    (entry,) = httpx.get(f"{d.url}/v1/models").json()["data"]
    assert entry["capabilities"]["tool_format"] == "mistral"
    r = chat(d, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    check_call(call)
    assert not choice["message"]["content"]
    streamed = stream_chat(
        d, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=80
    )
    assert streamed["calls"] == [(call["function"]["name"], call["function"]["arguments"])]


def test_stats_and_dashboard_mark_constrained_rows(hermes: Daemon):
    before = hermes.stats()["counters"]["tool_calls"]
    forced = chat(hermes, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert forced.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert hermes.stats()["counters"]["tool_calls"] == before + 1
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "slow", "schema": schema}}
    done = threading.Event()

    def run() -> None:
        chat(hermes, "a long one", response_format=fmt, max_tokens=1500)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    seen_stats = seen_html = False
    while not done.is_set() and not (seen_stats and seen_html):
        rows = hermes.stats()["rows"]
        seen_stats |= any(r["constraint"] == "json" and r["output"] == "answer" for r in rows)
        html = httpx.get(f"{hermes.url}/dashboard/active-rows", timeout=10).text
        seen_html |= re.search(r'data-field="constraint"[^>]*>json<', html) is not None
    assert seen_stats and seen_html
    done.wait(120)
    metrics = httpx.get(f"{hermes.url}/metrics", timeout=10).text
    assert re.search(r'^mlxd_constrained_rows_total\{kind="json",model="[^"]+"\}', metrics, re.M)
    assert 'mlxd_grammar_compile_seconds_count{cache="cold"}' in metrics
    assert re.search(r'^mlxd_tool_calls_total\{model="[^"]+"\} [1-9]', metrics, re.M)
