"""docs/agents.md is tested: its mlxd settings load, its Codex provider block is the
Responses wire API against mlxd's /v1, its Claude Code variables and opencode provider
point at mlxd, and the volatile-prompt rules it describes are the ones mlxd has."""

from __future__ import annotations

import json
import re
import sys

from mlxd.api.generate import TOOLS_IGNORED_HEADER
from mlxd.api.prompt_rules import RULES
from mlxd.config import PromptCacheSettings, load_settings
from mlxd.engine.chat.loading import BUILTIN_TEMPLATES
from tests.support import ROOT
from tests.support.agents import AGENTS, CLAUDE_ENV, codex_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DOC = (ROOT / "docs" / "agents.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC, re.S)


def test_the_mlxd_settings_block_loads(tmp_path):
    (mlxd_block,) = [b for b in blocks("toml") if "[limits]" in b]
    settings = load_settings(tmp_path / "mlxd.toml", text=mlxd_block)
    assert settings.model.aliases == ["claude-*", "gpt-5*"]
    assert settings.limits.max_tokens >= 32000


def test_the_codex_block_is_a_responses_provider_for_v1():
    (codex,) = [tomllib.loads(b) for b in blocks("toml") if "model_providers" in b]
    provider = codex["model_providers"][codex["model_provider"]]
    assert provider["wire_api"] == "responses"
    # Codex posts to {base_url}/responses: base_url must end in /v1.
    assert provider["base_url"].endswith("/v1")
    assert isinstance(codex["model_context_window"], int)


def test_the_claude_code_variables_point_at_the_server_root():
    (env,) = [b for b in blocks("sh") if "ANTHROPIC_BASE_URL" in b]
    values = dict(re.findall(r"^export (\w+)=(\S+)", env, re.M))
    # The anthropic client appends /v1/messages itself.
    assert values["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8080"
    for name in ("ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL"):
        assert name in values


def test_the_opencode_block_is_an_openai_compatible_provider_for_v1():
    (config,) = [json.loads(b) for b in blocks("json") if '"provider"' in b]
    provider_id, model_id = config["model"].split("/", 1)
    provider = config["provider"][provider_id]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"]["baseURL"] == "http://127.0.0.1:8080/v1"
    assert model_id in provider["models"]


def test_every_volatile_rule_is_explained_and_on_by_default():
    for rule in RULES:
        assert f"`{rule}`" in DOC, f"docs/agents.md does not explain the {rule} rule"
    assert PromptCacheSettings().volatile_rules == sorted(RULES)
    assert "volatile_rules = []" in DOC  # how to turn them off


def test_the_versions_named_are_the_ones_the_tests_run():
    for agent in AGENTS.values():
        assert f"{agent.version}" in DOC and f"`{agent.package}`" in DOC, agent
    assert "tests/agents/test_agents.py" in DOC


def test_the_claude_code_block_sets_what_the_tests_set():
    (env,) = [b for b in blocks("sh") if "ANTHROPIC_BASE_URL" in b]
    values = dict(re.findall(r"^export (\w+)=(\S+)", env, re.M))
    for name, value in CLAUDE_ENV.items():
        assert values.get(name) == value, name


def test_the_stream_idle_timeout_is_documented_above_claude_codes_floor():
    # In the main setup block (issue 33 item 13), not in a footnote.
    (env,) = [b for b in blocks("sh") if "CLAUDE_STREAM_IDLE_TIMEOUT_MS" in b]
    assert "ANTHROPIC_BASE_URL" in env
    (value,) = re.findall(r"CLAUDE_STREAM_IDLE_TIMEOUT_MS=(\d+)", env)
    assert int(value) > 300000  # Claude Code ignores values below its 5-minute floor
    assert "stream_keepalive" in DOC


def test_the_tests_codex_config_is_the_documented_one_plus_the_listed_switches(tmp_path):
    (doc,) = [tomllib.loads(b) for b in blocks("toml") if "model_providers" in b]
    tested = tomllib.loads(codex_config("m", "http://127.0.0.1:8080", tmp_path / "i.md"))
    assert tested["model_provider"] == doc["model_provider"]
    doc_provider = doc["model_providers"][doc["model_provider"]]
    provider = tested["model_providers"][tested["model_provider"]]
    assert provider["wire_api"] == doc_provider["wire_api"]
    assert provider["base_url"] == doc_provider["base_url"]
    # Every key the tests add is named in the doc's list of optional keys.
    for key in set(tested) - set(doc) - {"model_providers"}:
        assert f"`{key}" in DOC or f"`[{key}]" in DOC, key


def test_the_tools_header_and_the_shipped_template_are_named():
    assert f"`{TOOLS_IGNORED_HEADER}" in DOC
    for name in BUILTIN_TEMPLATES:
        assert f'chat_template = "{name}"' in DOC
    assert "prompt is too long: N tokens > M maximum" in DOC


def test_what_starts_cold_and_what_fills_the_demo_context_is_said():
    """Issue 33 item 13: another project folder starts cold; Open WebUI's tools fill
    the demo model's context, and how to keep them out."""
    assert "A new session in another project directory starts cold" in DOC
    assert "1,336 of 49,808" in DOC
    assert "7,004 prompt tokens" in DOC and "8,192-token context" in DOC
    assert "set **Function Calling** to `Default`" in DOC
