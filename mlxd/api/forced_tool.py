"""A test-only fault: make the model call one fixed, harmless tool (``MLXD_FORCE_TOOL_CALL``).

Real agents (Claude Code, Codex) are tested end to end on tiny random-weight
models, which never call a tool on their own. With fault injection on
(``MLXD_FAULT_INJECTION=1``) and ``MLXD_FORCE_TOOL_CALL`` set to a JSON list
of calls (``[{"name": "Bash", "arguments": {"command": "pwd"}, "when": "pwd"}]``),
a request whose tools include one of those names and whose prompt ends with
a user message (containing the text ``when``, if given) is generated under a
grammar that allows exactly that call with exactly those arguments: the
grammar of a named ``tool_choice``, each argument a JSON Schema ``const``.
The agent runs the call and sends the result back; that request (its prompt
ends with the tool result) is served as usual. An entry with ``input`` (a
string) instead of ``arguments`` names a custom tool (Codex's
``apply_patch``): the forced custom call's grammar is exactly that text.

Random weights also never end a turn: with ``MLXD_FORCE_ANSWER`` set to a
text, every other request of a tools-capable model answers exactly that text
as a JSON string (``"done"``) and stops, so an agent's turn ends as it would
with a real model. Both are off unless ``MLXD_FAULT_INJECTION=1`` is set too
(docs/testing.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

from mlxd.engine import (
    ChatPrompt,
    Constraint,
    CustomTool,
    GenerationRequest,
    ModelInfo,
    StructureError,
    custom_constraint,
    custom_grammar,
    json_constraint,
    tool_constraint,
)

FORCE_TOOL_CALL_ENV = "MLXD_FORCE_TOOL_CALL"
FORCE_ANSWER_ENV = "MLXD_FORCE_ANSWER"


def forced_calls() -> list[dict[str, Any]]:
    """The configured calls, or none (unset or not a JSON list of {name, arguments})."""
    raw = os.environ.get(FORCE_TOOL_CALL_ENV)
    if not raw:
        return []
    try:
        calls = json.loads(raw)
    except json.JSONDecodeError:
        return []
    if not isinstance(calls, list):
        return []
    return [
        c
        for c in calls
        if isinstance(c, dict)
        and isinstance(c.get("name"), str)
        and (isinstance(c.get("arguments"), dict) or isinstance(c.get("input"), str))
    ]


def _const_schema(arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {k: {"const": v} for k, v in arguments.items()},
        "required": sorted(arguments),
        "additionalProperties": False,
    }


def _call_constraint(gen: GenerationRequest, tool_format: str) -> Constraint | None:
    prompt = gen.prompt
    if not isinstance(prompt, ChatPrompt) or not prompt.tools or not prompt.messages:
        return None
    if prompt.messages[-1].get("role") != "user":
        return None  # the answer to a tool result: the round trip is done
    names = {t.get("function", {}).get("name") for t in prompt.tools}
    text = prompt.messages[-1].get("content")
    text = text if isinstance(text, str) else ""
    call = next(
        (c for c in forced_calls() if c["name"] in names and str(c.get("when", "")) in text),
        None,
    )
    if call is None:
        return None
    if isinstance(call.get("input"), str):
        if call["name"] not in {t.name for t in gen.custom_tools}:
            return None
        literal = custom_grammar("lark", f"start: {json.dumps(call['input'])}", param="input")
        return custom_constraint(CustomTool(call["name"], literal))
    tool = {"name": call["name"], "parameters": _const_schema(call["arguments"]), "strict": True}
    return tool_constraint([tool], tool_format=tool_format, parallel=False, param="tool_choice")


def force_tool_call(
    gen: GenerationRequest, info: ModelInfo | None, *, enabled: bool
) -> GenerationRequest:
    """``gen`` constrained to the configured call or answer when one applies; else ``gen``."""
    if not enabled or info is None or info.tool_format is None or gen.constraint is not None:
        return gen
    try:
        constraint = _call_constraint(gen, info.tool_format)
        if constraint is not None:
            return replace(gen, constraint=constraint, parse_tools=True)
        answer = os.environ.get(FORCE_ANSWER_ENV)
        if answer:
            constraint = json_constraint({"const": answer}, strict=True, param="response_format")
            return replace(gen, constraint=constraint)
    except StructureError:
        pass
    return gen
