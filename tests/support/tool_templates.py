"""Minimal chat templates that speak each tool-call format, for the tiny random-weight llama.

One ChatML-shaped template per format: the tools listed as JSON in a system
turn, and an assistant's earlier calls written in the format's own syntax
(what the model's real template does), so a round trip renders them as the
model would have written them. Served with ``[models.<id>] chat_template``
(this text, written to a file) and ``tool_parser`` (the format's mlx-lm
parser name), over one tiny model directory: no extra model builds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["CALLS", "format_models", "tool_template"]

_VALUE = "{{ v if v is string else v | tojson }}"
_ARGS = "{%- for k, v in tc.arguments.items() %}"

# format -> the Jinja that renders one call ``tc`` ({name, arguments as a mapping})
CALLS: dict[str, str] = {
    "json_tools": '<tool_call>\n{"name": "{{ tc.name }}", "arguments": {{ tc.arguments | tojson }}}'
    "\n</tool_call>",
    "mistral": "[TOOL_CALLS]{{ tc.name }}[ARGS]{{ tc.arguments | tojson }}",
    "qwen3_coder": "<tool_call>\n<function={{ tc.name }}>\n"
    + _ARGS
    + "<parameter={{ k }}>\n"
    + _VALUE
    + "\n</parameter>\n{%- endfor %}</function>\n</tool_call>",
    "glm47": "<tool_call>{{ tc.name }}"
    + _ARGS
    + "<arg_key>{{ k }}</arg_key><arg_value>"
    + _VALUE
    + "</arg_value>{%- endfor %}</tool_call>",
    "longcat": "<longcat_tool_call>{{ tc.name }}"
    + _ARGS
    + "<longcat_arg_key>{{ k }}</longcat_arg_key><longcat_arg_value>"
    + _VALUE
    + "</longcat_arg_value>{%- endfor %}</longcat_tool_call>",
    "minimax_m2": '<minimax:tool_call>\n<invoke name="{{ tc.name }}">\n'
    + _ARGS
    + '<parameter name="{{ k }}">'
    + _VALUE
    + "</parameter>\n{%- endfor %}</invoke>\n</minimax:tool_call>",
    "minicpm5": '<function name="{{ tc.name }}">'
    + _ARGS
    + '<param name="{{ k }}">'
    + _VALUE
    + "</param>{%- endfor %}</function>",
    "muse_spark": '<atem:function_calls><atem:invoke name="{{ tc.name }}">'
    + _ARGS
    + '<atem:parameter name="{{ k }}">{{ v | tojson }}</atem:parameter>{%- endfor %}'
    "</atem:invoke></atem:function_calls>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.{{ tc.name }}:0"
    "<|tool_call_argument_begin|>{{ tc.arguments | tojson }}<|tool_call_end|>"
    "<|tool_calls_section_end|>",
    "kimi_k3": '<|open|>tools<|sep|><|open|>call tool="{{ tc.name }}" index="1"<|sep|>'
    '<|open|>json type="object"<|sep|>{{ tc.arguments | tojson }}<|close|>json<|sep|>'
    "<|close|>call<|sep|><|close|>tools<|sep|>",
    "gemma4": "<|tool_call>call:{{ tc.name }}{{ '{' }}"
    + _ARGS
    + '{{ k }}:{% if v is string %}<|"|>{{ v }}<|"|>{% else %}{{ v | tojson }}{% endif %}'
    "{{ ',' if not loop.last }}{%- endfor %}{{ '}' }}<tool_call|>",
    "function_gemma": "<start_function_call>call:{{ tc.name }}{{ '{' }}"
    + _ARGS
    + "{{ k }}:{% if v is string %}<escape>{{ v }}<escape>{% else %}{{ v | tojson }}{% endif %}"
    "{{ ',' if not loop.last }}{%- endfor %}{{ '}' }}<end_function_call>",
    "pythonic": "<|tool_call_start|>[{{ tc.name }}("
    + _ARGS
    + "{{ k }}={{ v | tojson }}{{ ', ' if not loop.last }}{%- endfor %})]<|tool_call_end|>",
}
CALLS["laguna"] = CALLS["glm47"]
# gpt-oss: one message per call on the commentary channel (mlxd reads it; mlx-lm has no parser).
CALLS["harmony"] = (
    "<|start|>assistant<|channel|>commentary to=functions.{{ tc.name }} <|constrain|>json"
    "<|message|>{{ tc.arguments | tojson }}<|call|>"
)

# A minimal Harmony template: every turn a message, the answer opened by <|start|>assistant.
_HARMONY = (
    "{%- if tools %}<|start|>developer<|message|># Tools\n{%- for tool in tools %}\n"
    "{{ tool | tojson }}{%- endfor %}<|end|>{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- set tc = tool_call.function if tool_call.function is defined else tool_call %}"
    + CALLS["harmony"]
    + "{%- endfor %}"
    "{%- elif message.role == 'tool' %}"
    "<|start|>functions.tool to=assistant<|channel|>commentary<|message|>"
    "{{ message.content }}<|end|>"
    "{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content or '' }}<|end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)


def tool_template(fmt: str) -> str:
    """A ChatML template whose tools and earlier calls are in ``fmt`` (Harmony's own for it)."""
    if fmt == "harmony":
        return _HARMONY
    return (
        "{%- if tools %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n"
        "{{ tool | tojson }}{%- endfor %}<|im_end|>\n{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message.role == 'assistant' and message.tool_calls %}"
        "{{- '<|im_start|>assistant\n' }}{%- for tool_call in message.tool_calls %}"
        "{%- set tc = tool_call.function if tool_call.function is defined else tool_call %}"
        + CALLS[fmt]
        + "{%- endfor %}<|im_end|>\n"
        "{%- elif message.role == 'tool' %}"
        "{{- '<|im_start|>user\n<tool_response>' + message.content }}"
        "{{- '</tool_response><|im_end|>\n' }}"
        "{%- else %}"
        "{{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
    )


def format_models(model_dir: Path, folder: Path, formats: list[str]) -> dict[str, Any]:
    """A ``[models]`` registry: one entry per format, named after it, over ``model_dir``."""
    folder.mkdir(parents=True, exist_ok=True)
    models: dict[str, Any] = {}
    for fmt in formats:
        template = folder / f"{fmt}.jinja"
        template.write_text(tool_template(fmt), encoding="utf-8")
        models[fmt] = {"path": str(model_dir), "chat_template": str(template), "tool_parser": fmt}
    return models
