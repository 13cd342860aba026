"""Custom (freeform) tools on chat completions and Responses: Codex's ``apply_patch``.

A tiny random-weight model with a tools-capable template. A forced custom call
is generated under the tool's own grammar (Codex's real Lark grammar for
``apply_patch``), so its input parses; the model sees each custom tool as a
function taking one string; calls and their outputs go back into the prompt.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.engine import CustomTool, custom_grammar
from mlxd.engine.custom_tools import input_matches
from tests.support.daemon import Daemon
from tests.support.daemons import tools_config

MODEL = "tiny-tools"
LARK = (Path(__file__).parent.parent / "support" / "apply_patch.lark").read_text()
APPLY_PATCH = CustomTool("apply_patch", custom_grammar("lark", LARK, param="format"))
# As Codex sends it on /v1/responses, and as chat completions nest it.
RESPONSES_TOOL = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": LARK},
}
CHAT_TOOL = {
    "type": "custom",
    "custom": {
        "name": "apply_patch",
        "description": "Edit files with a patch.",
        "format": {"type": "grammar", "grammar": {"syntax": "lark", "definition": LARK}},
    },
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
WORD = {
    "type": "custom",
    "name": "word",
    "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]{1,6}"},
}
TOKENS = 160


def patch_bias() -> dict[str, int]:
    """A random model writes endless lines; biasing newline, then ``*``, then ``E``
    (each wherever the grammar allows it) makes any patch end in a few lines:
    ``*** Begin Patch``, one hunk whose lines are short, ``*** End Patch``."""
    from mlx_lm.tokenizer_utils import load

    from tests.support.tinymodels import tiny_model_dir

    tok = load(tiny_model_dir("llama", template="hermes"))
    ids = {s: tok.encode(s, add_special_tokens=False) for s in ("\n", "*", "E")}
    assert all(len(i) == 1 for i in ids.values()), ids
    return {str(ids["\n"][0]): 30, str(ids["*"][0]): 25, str(ids["E"][0]): 20}


@pytest.fixture(scope="module")
def hermes(apps) -> Daemon:
    return apps.get(tools_config("hermes"))


def _post(d: Daemon, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{d.url}{path}", json={"model": MODEL, **body}, timeout=120)


def test_codex_grammar_accepts_a_patch_and_refuses_prose():
    patch = "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch\n"
    assert input_matches(APPLY_PATCH, patch)
    assert not input_matches(APPLY_PATCH, "I would add a file.")
    assert input_matches(CustomTool("note"), "any text at all")


def test_forced_custom_call_on_responses(hermes: Daemon):
    body = {
        "input": "say a word",
        "tools": [WORD, RESPONSES_TOOL, WEATHER],
        "tool_choice": {"type": "custom", "name": "word"},
        "max_output_tokens": 16,
    }
    r = _post(hermes, "/v1/responses", body)
    assert r.status_code == 200, r.text
    out = r.json()
    (call,) = [i for i in out["output"] if i["type"] == "custom_tool_call"]
    assert out["status"] == "completed", call["input"]
    assert call["name"] == "word" and call["call_id"] and call["id"].startswith("ctc_")
    assert re.fullmatch("[a-z]{1,6}", call["input"]), call["input"]
    # Streamed: the same input in custom_tool_call_input events.
    events = []
    with httpx.stream(
        "POST", f"{hermes.url}/v1/responses", json={"model": MODEL, **body, "stream": True}
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    deltas = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    done = next(e for e in events if e["type"] == "response.custom_tool_call_input.done")
    assert "".join(deltas) == done["input"] == call["input"]
    # Fed back as Codex does: the call and its output reach the next prompt.
    again = _post(
        hermes,
        "/v1/responses",
        {
            "input": [
                {"role": "user", "content": "say a word"},
                {k: call[k] for k in ("type", "call_id", "name", "input")},
                {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "ok"},
            ],
            "tools": [WORD, RESPONSES_TOOL, WEATHER],
            "max_output_tokens": 1,
            "store": False,
        },
    )
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["input_tokens"] > out["usage"]["input_tokens"]


def test_forced_apply_patch_on_chat_completions_matches_codex_grammar(hermes: Daemon):
    r = _post(
        hermes,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "create hello.txt"}],
            "tools": [CHAT_TOOL],
            "tool_choice": "required",
            "max_tokens": TOKENS,
            "logit_bias": patch_bias(),
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "custom" and call["custom"]["name"] == "apply_patch"
    patch = call["custom"]["input"]
    assert patch.startswith("*** Begin Patch\n") and "*** End Patch" in patch, patch
    assert input_matches(APPLY_PATCH, patch), patch
    # Streamed: one tool_calls delta in the same custom shape.
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a word"}],
        "tools": [{"type": "custom", "custom": {k: v for k, v in WORD.items() if k != "type"}}],
        "tool_choice": {"type": "custom", "custom": {"name": "word"}},
        "max_tokens": 16,
        "stream": True,
    }
    chunks = []
    with httpx.stream("POST", f"{hermes.url}/v1/chat/completions", json=body) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    (streamed,) = [c for ch in chunks for c in ch["delta"].get("tool_calls") or []]
    assert streamed["type"] == "custom" and streamed["index"] == 0
    assert re.fullmatch("[a-z]{1,6}", streamed["custom"]["input"]), streamed
    assert chunks[-1]["finish_reason"] == "tool_calls"
    # The call in the history: the model sees it as a call with one string.
    back = _post(
        hermes,
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "user", "content": "create hello.txt"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "ok"},
            ],
            "tools": [CHAT_TOOL],
            "max_tokens": 1,
        },
    )
    assert back.status_code == 200, back.text


def test_a_custom_tool_reaches_the_prompt(hermes: Daemon):
    def tokens(tools: list[dict[str, Any]]) -> int:
        body = {"input": "hi", "tools": tools, "max_output_tokens": 1}
        return _post(hermes, "/v1/responses", body).json()["usage"]["input_tokens"]

    bare = tokens([WEATHER])
    # The description and the one string parameter are in the prompt (the grammar is not).
    assert tokens([WEATHER, RESPONSES_TOOL]) > bare + 10


def test_bad_custom_tools_are_400s(hermes: Daemon):
    bad_grammar = {**RESPONSES_TOOL, "format": {**RESPONSES_TOOL["format"], "definition": "x: ("}}
    r = _post(hermes, "/v1/responses", {"input": "hi", "tools": [bad_grammar]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].format.definition"
    r = _post(
        hermes,
        "/v1/responses",
        {"input": "hi", "tools": [RESPONSES_TOOL], "tool_choice": {"type": "custom", "name": "x"}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    syntax = {**RESPONSES_TOOL, "format": {"type": "grammar", "syntax": "ebnf", "definition": "a"}}
    r = _post(hermes, "/v1/responses", {"input": "hi", "tools": [syntax]})
    assert r.status_code == 400, r.text
