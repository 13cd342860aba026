"""Claude Code and the Codex CLI, the real ones from npm, against a real daemon.

Each agent runs non-interactively (``claude -p``, ``codex exec``) with the
configuration docs/agents.md gives, on a tiny random-weight llama with a long
context and the Hermes tools template. Random weights neither call tools nor
end a turn, so the daemon runs with the test-only faults of
:mod:`mlxd.api.forced_tool`: a prompt that asks to run ``pwd`` gets exactly
that tool call (Claude Code's ``Bash``, Codex's ``exec_command``), and every
other answer is ``"done"``. What is real: the agents' requests (their system
prompts, tools, streaming, resumed sessions, Claude Code's billing block and
mid-conversation system messages), mlxd's answers, and the agents running the
tool and sending its output back. Whether each request was served from the
prompt cache is read from ``/stats`` ``prompt_cache.lookups``.

Kept cheap with the agents' own switches: one tool each, a one-line system
prompt (Claude Code) or instructions file (Codex), no telemetry, no update
checks; base URLs point at the daemon, so nothing leaves the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.agents import CLAUDE_ENV, agent_command, codex_config
from tests.support.daemon import Daemon
from tests.support.tinymodels import LONG_CONTEXT_FAMILY, tiny_model_dir

MODEL = "tiny-agent"
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello from mlxd\n*** End Patch\n"
FORCED = [
    {"name": "Bash", "arguments": {"command": "pwd"}, "when": "pwd"},
    {"name": "exec_command", "arguments": {"cmd": "pwd"}, "when": "pwd"},
    # Codex's freeform apply_patch (a custom tool): the forced input is this patch.
    {"name": "apply_patch", "input": PATCH, "when": "hello.txt"},
]
# With the Skill tool, Claude Code sends the list of skills as a role "system"
# message after the user's (its mid-conversation-system beta, for any model id that
# is not an older Claude id): what made its first request a 400 before issue 21.
PLAIN_TOOLS = "Read,Skill"
# A new session or a resumed one reuses at least this share of its first prompt.
HIT = 0.9


@pytest.fixture(scope="module")
def daemon(daemons) -> Daemon:
    path = tiny_model_dir(LONG_CONTEXT_FAMILY, template="hermes")
    config = {
        "model": {"path": str(path), "name": MODEL, "aliases": ["claude-*", "gpt-*"]},
        # Claude Code asks for max_tokens 32000: clamped to this, not refused.
        "limits": {"max_tokens": 128},
        "sampling": {"max_tokens": 128},
    }
    env = {
        "MLXD_FAULT_INJECTION": "1",
        "MLXD_FORCE_TOOL_CALL": json.dumps(FORCED),
        "MLXD_FORCE_ANSWER": "done",
    }
    return daemons.get(config, env=env, name="agents")


def lookups(daemon: Daemon) -> dict[str, dict[str, Any]]:
    """``/stats`` prompt-cache lookups by request id (the newest few hundred)."""
    found = daemon.stats()["prompt_cache"]["lookups"]
    return {x["request_id"]: x for x in found}


class Agents:
    """Runs the agents against ``daemon`` in their own homes; records each run's requests."""

    def __init__(self, daemon: Daemon, root: Path):
        self.daemon = daemon
        self.home = root / "home"
        self.codex_home = root / "codex"
        self.home.mkdir()
        self.codex_home.mkdir()
        (self.codex_home / "instructions.md").write_text("You are a coding agent. Be terse.\n")
        instructions = self.codex_home / "instructions.md"
        config = codex_config(MODEL, daemon.url, instructions)
        (self.codex_home / "config.toml").write_text(config)

    def _run(self, cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[str, list[dict]]:
        before = lookups(self.daemon)
        base = {"PATH": os.environ["PATH"], "HOME": str(self.home), "LANG": "C.UTF-8"}
        done = subprocess.run(
            cmd,
            cwd=cwd,
            env={**base, **env},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert done.returncode == 0, f"{cmd[2:]} exited {done.returncode}:\n{done.stderr[-3000:]}"
        new = [x for rid, x in lookups(self.daemon).items() if rid not in before]
        return done.stdout, sorted(new, key=lambda x: x["at"])

    def claude(self, cwd: Path, *args: str) -> tuple[list[dict], list[dict]]:
        """``claude -p ... --output-format stream-json``: its messages and the requests."""
        env = {
            "ANTHROPIC_BASE_URL": self.daemon.url,
            "ANTHROPIC_AUTH_TOKEN": "mlxd",
            "ANTHROPIC_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
            **CLAUDE_ENV,
        }
        cmd = [*agent_command("claude"), "-p", *args, "--output-format", "stream-json"]
        cmd += ["--verbose", "--system-prompt", "You are terse."]
        out, requests = self._run(cmd, cwd, env)
        return [json.loads(line) for line in out.splitlines() if line.strip()], requests

    def codex(self, cwd: Path, *args: str) -> tuple[list[dict], list[dict]]:
        """``codex exec --json ...``: its events and the requests."""
        cmd = [*agent_command("codex"), "exec", "--skip-git-repo-check", "--json", *args]
        out, requests = self._run(cmd, cwd, {"CODEX_HOME": str(self.codex_home)})
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")], requests


@pytest.fixture(scope="module")
def agents(daemon: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Agents:
    return Agents(daemon, tmp_path_factory.mktemp("agents"))


def project(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    return tmp_path_factory.mktemp(name)


def hit_share(request: dict) -> float:
    return request["cached_tokens"] / request["prompt_tokens"]


# ---------------------------------------------------------------- Claude Code


def _result(messages: list[dict]) -> dict:
    result = messages[-1]
    assert result["type"] == "result", messages[-3:]
    return result


@pytest.fixture(scope="module")
def claude_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return project(tmp_path_factory, "claude")


@pytest.fixture(scope="module")
def claude_first(agents: Agents, claude_project: Path) -> tuple[list[dict], list[dict]]:
    return agents.claude(claude_project, "say hi", "--tools", PLAIN_TOOLS)


def test_claude_code_plain_turn(claude_first):
    """The documented recipe (ANTHROPIC_MODEL = the served id) works on its first request,
    which carries a role "system" message (the skills list)."""
    messages, requests = claude_first
    result = _result(messages)
    assert result["is_error"] is False and result["result"] == '"done"', result
    assert result["stop_reason"] == "end_turn"
    assert [r["api"] for r in requests] == ["messages"]
    # Claude Code's per-session billing line was taken out before the prompt was cached.
    assert requests[0]["rules"] == ["claude_billing_header"]


def test_claude_code_tool_round_trip(agents: Agents, tmp_path_factory):
    cwd = project(tmp_path_factory, "claude-tool")
    messages, requests = agents.claude(
        cwd, "run pwd", "--tools", "Bash", "--allowedTools", "Bash(pwd)"
    )
    blocks = [
        b for m in messages if m["type"] in ("assistant", "user") for b in m["message"]["content"]
    ]
    calls = [b for b in blocks if b["type"] == "tool_use"]
    results = [b for b in blocks if b["type"] == "tool_result"]
    assert [(c["name"], c["input"]) for c in calls] == [("Bash", {"command": "pwd"})]
    assert results and results[0]["is_error"] is False
    assert Path(str(results[0]["content"]).strip()).resolve() == cwd.resolve()
    assert _result(messages)["is_error"] is False
    # The call, then the answer to its result: the second prompt extends the first.
    assert len(requests) == 2 and hit_share(requests[1]) >= HIT, requests


def test_claude_code_continue_hits_the_cache(agents: Agents, claude_project, claude_first):
    messages, requests = agents.claude(
        claude_project, "--continue", "again", "--tools", PLAIN_TOOLS
    )
    assert _result(messages)["is_error"] is False
    assert requests and hit_share(requests[0]) >= HIT, requests


def test_claude_code_new_session_hits_the_cache(agents: Agents, claude_project, claude_first):
    """A new session's billing line differs; the claude_billing_header rule keeps the hit.

    Same first words as the first session: Claude Code puts the skills list after the
    user's text, so other words would leave the cache there (about half of this small
    prompt; the system prompt and tools before it are still reused)."""
    messages, requests = agents.claude(claude_project, "say hi", "--tools", PLAIN_TOOLS)
    assert _result(messages)["is_error"] is False
    first = requests[0]
    assert first["rules"] == ["claude_billing_header"]
    assert hit_share(first) >= HIT, requests


# ---------------------------------------------------------------- Codex CLI


@pytest.fixture(scope="module")
def codex_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return project(tmp_path_factory, "codex")


@pytest.fixture(scope="module")
def codex_first(agents: Agents, codex_project: Path) -> tuple[list[dict], list[dict]]:
    return agents.codex(codex_project, "say hi")


def _items(events: list[dict], kind: str) -> list[dict]:
    return [
        e["item"]
        for e in events
        if e.get("type") == "item.completed" and e["item"].get("type") == kind
    ]


def test_codex_plain_turn(codex_first):
    events, requests = codex_first
    assert [i["text"] for i in _items(events, "agent_message")] == ['"done"'], events
    assert [r["api"] for r in requests] == ["responses"]


def test_codex_tool_round_trip(agents: Agents, tmp_path_factory):
    cwd = project(tmp_path_factory, "codex-tool")
    events, requests = agents.codex(cwd, "run pwd")
    runs = _items(events, "command_execution")
    assert len(runs) == 1 and "pwd" in runs[0]["command"], events
    assert runs[0]["exit_code"] == 0
    assert Path(runs[0]["aggregated_output"].strip()).resolve() == cwd.resolve()
    assert [i["text"] for i in _items(events, "agent_message")] == ['"done"']
    assert len(requests) == 2 and hit_share(requests[1]) >= HIT, requests


def test_codex_creates_a_file_with_apply_patch(agents: Agents, tmp_path_factory):
    # Codex sends apply_patch as a freeform custom tool (Lark grammar) for the
    # models its catalog knows; gpt-* is an alias of the tiny model here. Its
    # own feature switches drop the tools this test does not need.
    cwd = project(tmp_path_factory, "codex-patch")
    off = ("goals", "tool_search", "multi_agent")
    switches = [arg for name in off for arg in ("-c", f"features.{name}=false")]
    events, requests = agents.codex(cwd, "-m", "gpt-5.5", *switches, "create hello.txt")
    changes = _items(events, "file_change")
    assert len(changes) == 1 and changes[0]["status"] == "completed", events
    assert (cwd / "hello.txt").read_text() == "hello from mlxd\n"
    assert [i["text"] for i in _items(events, "agent_message")] == ['"done"']
    assert len(requests) == 2, requests


def test_codex_resume_hits_the_cache(agents: Agents, codex_project, codex_first):
    events, requests = agents.codex(codex_project, "resume", "--last", "again")
    assert _items(events, "agent_message"), events
    assert requests and hit_share(requests[0]) >= HIT, requests


def test_codex_new_session_hits_the_cache(agents: Agents, codex_project, codex_first):
    events, requests = agents.codex(codex_project, "hello again")
    assert _items(events, "agent_message"), events
    assert requests and hit_share(requests[0]) >= HIT, requests
