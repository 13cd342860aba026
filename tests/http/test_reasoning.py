"""Reasoning models through the real daemon: a tiny model whose template opens ``<think>``.

The thinking goes to ``reasoning_content`` (or the configured field), never
into ``content``; ``chat_template_kwargs`` reaches the template; a grammar
starts only after ``</think>``. This daemon runs constrained rows serially
(``[lanes] constrained = "serial"``), so that policy is covered too.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.support.daemon import Daemon, toml_config
from tests.support.tinymodels import tiny_model_dir

MODEL = "tiny-think"
BUDGET = 16


def config(**server: Any) -> str:
    return toml_config(
        model={"path": str(tiny_model_dir("llama", template="hermes_think")), "name": MODEL},
        batch={"size": 4, "kv_budget": "64MiB"},
        lanes={"constrained": "serial"},
        reasoning={"effort_budgets": {"low": BUDGET}},
        server=server,
    )


@pytest.fixture(scope="module")
def daemon(apps):
    # Its own: a test reloads it with other reasoning fields.
    return apps.get(config(), name="think")


def chat(d: Daemon, **body: Any) -> httpx.Response:
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "think about the river"}],
        "temperature": 0,
        "max_tokens": 24,
        **body,
    }
    return httpx.post(f"{d.url}/v1/chat/completions", json=payload, timeout=60)


def think_end_id(d: Daemon) -> int:
    from mlx_lm.tokenizer_utils import load

    return load(tiny_model_dir("llama", template="hermes_think")).think_end_id


def test_models_says_reasoning(daemon: Daemon):
    (entry,) = httpx.get(f"{daemon.url}/v1/models").json()["data"]
    assert entry["capabilities"]["reasoning"] is True


def test_thinking_goes_to_reasoning_content_and_streams_the_same(daemon: Daemon):
    message = chat(daemon).json()["choices"][0]["message"]
    assert message["reasoning_content"]
    assert "<think>" not in (message["content"] or "")
    reasoning, content = [], []
    with httpx.stream(
        "POST",
        f"{daemon.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "think about the river"}],
            "temperature": 0,
            "max_tokens": 24,
            "stream": True,
        },
        timeout=60,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning.append(delta.get("reasoning_content") or "")
                content.append(delta.get("content") or "")
    assert "".join(reasoning) == message["reasoning_content"]
    assert "".join(content) == (message["content"] or "")


def test_chat_template_kwargs_turn_thinking_off(daemon: Daemon):
    r = chat(daemon, chat_template_kwargs={"enable_thinking": False})
    message = r.json()["choices"][0]["message"]
    assert "reasoning_content" not in message
    assert message["content"]


def test_the_grammar_starts_after_think_ends(daemon: Daemon):
    # A strong bias makes </think> the first token; from then on the grammar
    # masks it (and everything else that is not the schema).
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}
    end = think_end_id(daemon)
    r = chat(daemon, response_format=fmt, logit_bias={str(end): 100}, max_tokens=40)
    assert r.headers["x-mlxd-lane"] == "serial; reason=constrained"
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert json.loads(choice["message"]["content"])["color"] in ("red", "green")
    # Without the bias the model stays in its think block: no grammar applies yet.
    free = chat(daemon, response_format=fmt, max_tokens=12).json()["choices"][0]
    assert free["message"]["reasoning_content"]


def test_reasoning_field_is_a_live_setting(daemon: Daemon):
    daemon.write_config(config(reasoning_field="reasoning"))
    assert daemon.reload().status_code == 200
    try:
        message = chat(daemon).json()["choices"][0]["message"]
        assert message["reasoning"] and "reasoning_content" not in message
        daemon.write_config(config(reasoning_field="both"))
        assert daemon.reload().status_code == 200
        message = chat(daemon).json()["choices"][0]["message"]
        assert message["reasoning"] == message["reasoning_content"] != ""
    finally:
        daemon.write_config(config())
        daemon.reload()


def test_effort_low_caps_the_thinking_and_leaves_an_answer(daemon: Daemon):
    free = chat(daemon, max_tokens=48).json()
    # Unbudgeted, the random model thinks through all of max_tokens.
    assert free["usage"]["completion_tokens_details"]["reasoning_tokens"] == 48
    body = chat(daemon, max_tokens=48, reasoning_effort="low").json()
    used = body["usage"]["completion_tokens_details"]["reasoning_tokens"]
    # The budget, then the forced </think> (one token in this tokenizer).
    assert BUDGET <= used <= BUDGET + 1, body["usage"]
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"], message
    r = httpx.post(
        f"{daemon.url}/v1/responses",
        json={
            "model": MODEL,
            "input": "think",
            "max_output_tokens": 48,
            "reasoning": {"effort": "low"},
        },
        timeout=60,
    ).json()
    assert [i["type"] for i in r["output"]] == ["reasoning", "message"], r["output"]
    assert BUDGET <= r["usage"]["output_tokens_details"]["reasoning_tokens"] <= BUDGET + 1
    # A grammar starts once the forced </think> is out: the answer is the schema's.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}}
    both = chat(daemon, max_tokens=48, reasoning_effort="low", response_format=fmt).json()
    choice = both["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert json.loads(choice["message"]["content"])["ok"] in (True, False)


def test_anthropic_budget_tokens_gives_thinking_then_text(daemon: Daemon):
    body = {
        "model": MODEL,
        "max_tokens": 40,
        "messages": [{"role": "user", "content": "think"}],
        "thinking": {"type": "enabled", "budget_tokens": 8},
    }
    r = httpx.post(f"{daemon.url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text
    blocks = r.json()["content"]
    assert [b["type"] for b in blocks] == ["thinking", "text"], blocks
    assert blocks[0]["thinking"] and blocks[1]["text"]
    bad = httpx.post(
        f"{daemon.url}/v1/messages",
        json={**body, "thinking": {"type": "enabled", "budget_tokens": 0}},
        timeout=60,
    )
    assert bad.status_code == 400 and "budget_tokens" in bad.text
    bad = httpx.post(
        f"{daemon.url}/v1/chat/completions",
        json={"model": MODEL, "messages": body["messages"], "reasoning_effort": "lots"},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
