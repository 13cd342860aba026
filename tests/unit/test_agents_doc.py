"""docs/agents.md is tested: its mlxd settings load, its Codex provider block is the
Responses wire API against mlxd's /v1, and its Claude Code variables point at mlxd."""

from __future__ import annotations

import re
import sys

from mlxd.config import load_settings
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
