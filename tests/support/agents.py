"""Real coding agents from npm, pinned and cached: Claude Code and the Codex CLI.

:func:`agent_command` installs a pinned package once into
``<MLXD_CACHE_DIR or ~/.cache/mlxd>/agents/<name>@<version>`` (``npm install
--prefix``, into a temporary sibling renamed into place, so racing runs and a
half-finished install never leave a broken copy) and returns the command that
runs it with node. Both packages ship a native binary per platform as an
optional dependency; their node launchers (``cli-wrapper.cjs``, ``codex.js``)
find it, so no install script has to run (``--ignore-scripts``).

Without node or npm the tests skip, unless ``MLXD_REQUIRE_AGENTS=1`` (CI) makes
that a failure; so does an install that fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = [
    "AGENTS",
    "CLAUDE_ENV",
    "Agent",
    "agent_command",
    "agents_root",
    "codex_config",
    "require_node",
]


@dataclass(frozen=True)
class Agent:
    package: str
    version: str
    launcher: str  # inside node_modules/<package>/, run with node

    @property
    def slug(self) -> str:
        return f"{self.package.rsplit('/', 1)[-1]}@{self.version}"


# The versions the tests and docs/agents.md were written against (`npm view <pkg> version`).
AGENTS = {
    "claude": Agent("@anthropic-ai/claude-code", "2.1.197", "cli-wrapper.cjs"),
    "codex": Agent("@openai/codex", "0.171.0", "bin/codex.js"),
}


def _unavailable(message: str) -> None:
    if os.environ.get("MLXD_REQUIRE_AGENTS") == "1":
        pytest.fail(message)
    pytest.skip(message)


def require_node() -> tuple[str, str]:
    """node and npm, or skip (fail under CI, where MLXD_REQUIRE_AGENTS=1)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        _unavailable("node and npm are needed for the real-agent tests (Debian: nodejs, npm)")
    assert node is not None and npm is not None
    return node, npm


def agents_root() -> Path:
    base = os.environ.get("MLXD_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "mlxd") / "agents"


def agent_command(name: str) -> list[str]:
    """``[node, <launcher>]`` for the pinned agent ``name``, installed on first use."""
    node, npm = require_node()
    agent = AGENTS[name]
    root = agents_root()
    final = root / agent.slug
    launcher = final / "node_modules" / agent.package / agent.launcher
    if not launcher.is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{agent.slug}.", dir=root))
        try:
            done = subprocess.run(
                [
                    npm,
                    "install",
                    "--prefix",
                    str(tmp),
                    "--no-audit",
                    "--no-fund",
                    "--ignore-scripts",
                    "--loglevel=error",
                    f"{agent.package}@{agent.version}",
                ],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            if done.returncode != 0:
                _unavailable(f"npm install {agent.package}@{agent.version} failed:\n{done.stderr}")
            with contextlib.suppress(OSError):  # lost a race: the other copy is complete
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return [node, str(launcher)]


# What the tests set for Claude Code besides its base URL, key and model
# (docs/agents.md's block sets the same; tests/unit/test_agents_doc.py checks).
CLAUDE_ENV = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
}


def codex_config(model: str, base_url: str, instructions: Path) -> str:
    """docs/agents.md's Codex config, plus the switches it lists to keep a turn short."""
    return f"""\
model = "{model}"
model_provider = "mlxd"
model_context_window = 131072
model_instructions_file = "{instructions}"
include_permissions_instructions = false
web_search = "disabled"
approval_policy = "never"
sandbox_mode = "danger-full-access"

[model_providers.mlxd]
name = "mlxd"
base_url = "{base_url}/v1"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false
"""
