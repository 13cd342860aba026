"""docs/agents.md is tested: its mlxd settings load, its Codex provider block is the
Responses wire API against mlxd's /v1, its Claude Code variables and opencode provider
point at mlxd, and the volatile-prompt rules it describes are the ones mlxd has."""

from __future__ import annotations

import json
import re
import sys

from mlxd.api.prompt_rules import RULES
from mlxd.config import PromptCacheSettings, load_settings
from tests.support import ROOT

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
