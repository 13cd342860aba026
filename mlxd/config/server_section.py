"""The ``[server]`` section, and where state lives by default."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Literal

from pydantic import SecretStr, field_validator

from mlxd.config.section_base import Section, _field


def default_state_dir(platform: str = sys.platform, env: dict[str, str] | None = None) -> Path:
    """Where mlxd keeps state by default: the platform's per-user state directory."""
    env = dict(os.environ) if env is None else env
    home = Path(env.get("HOME") or Path.home())
    if platform == "darwin":
        return home / "Library" / "Application Support" / "mlxd"
    xdg = env.get("XDG_STATE_HOME")
    # The XDG spec ignores a relative path.
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "mlxd"
    return home / ".local" / "state" / "mlxd"


_HOST_NAME = re.compile(r"^(\*|(\*\.)?[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?)$")


def _check_allowed_hosts(value: list[str]) -> list[str]:
    out = []
    for raw in value:
        host = raw.strip().lower().rstrip(".")
        if not _HOST_NAME.match(host):
            raise ValueError(
                f"{raw!r} is not a host name: list bare names such as 'box.lan' or "
                "'*.example.com' (no scheme, port or path)"
            )
        out.append(host)
    return out


class ServerSettings(Section):
    host: str = _field(
        "127.0.0.1",
        "restart",
        "Address to bind; off loopback the admin token guards the dashboard.",
    )
    port: int = _field(8080, "restart", "TCP port.", ge=1, le=65535)
    api_keys: list[SecretStr] = _field(
        [], "live", "Bearer keys accepted on /v1 routes; empty means /v1 is open."
    )
    admin_token: SecretStr | None = _field(
        None, "live", "Token for the dashboard, /stats and /admin when bound off loopback."
    )
    allow_anonymous_read: bool = _field(
        False, "live", "Off loopback, let anyone read the dashboard, /stats and /metrics."
    )
    allowed_hosts: list[str] = _field(
        [],
        "live",
        "Extra Host names accepted besides loopback, IP literals, this machine's name and "
        '`host` ("box.lan", "*.example.com"; "*" turns the check off).',
    )
    shutdown_timeout: float = _field(
        30.0, "live", "Seconds in-flight requests may take to finish after SIGTERM.", ge=0
    )
    engine_start_timeout: float = _field(
        600.0,
        "live",
        "Seconds a chat engine may take to start (load its model, open its prompt cache) "
        "before it shows failed: /ready says why, requests get 503 until it finishes; 0: no limit.",
        ge=0,
    )
    log_level: Literal["debug", "info", "warning", "error"] = _field(
        "info", "live", "Log level of the daemon (the --log-level flag wins)."
    )
    stream_keepalive: float = _field(
        15.0,
        "live",
        "Seconds a stream may go without an event (a long prefill) before mlxd sends a "
        "keep-alive: an Anthropic ping, a Responses response.in_progress, a chat SSE comment; "
        "0 turns them off.",
        ge=0,
    )
    log_requests: bool = _field(
        True, "live", "One info log line per /v1 request: route, status, lane, tokens, timings."
    )
    unknown_parameters: Literal["reject", "ignore"] = _field(
        "reject",
        "live",
        "Unknown top-level request parameters: 400 (reject), or dropped and listed in the "
        "X-Mlxd-Ignored-Parameters header (ignore).",
    )
    reasoning_field: Literal["reasoning_content", "reasoning", "both"] = _field(
        "reasoning_content",
        "live",
        "Chat field that carries a reasoning model's thinking (message and delta).",
    )
    fetch_images: bool = _field(
        False,
        "live",
        "Fetch http(s) image URLs named in requests (off: images come inline as base64). "
        "A server-side request forgery risk: see docs/api.md#images.",
    )
    downloads: bool = _field(
        False,
        "live",
        "Pull configured repos missing from the Hugging Face cache at start, and at a reload "
        "that turns it on or adds a model.",
    )
    state_dir: str | None = _field(
        None,
        "restart",
        "Directory for state that outlives the process (the prompt cache's disk tier); "
        "default: $XDG_STATE_HOME/mlxd or ~/.local/state/mlxd on Linux, "
        "~/Library/Application Support/mlxd on macOS.",
    )

    @property
    def state_path(self) -> Path:
        """``state_dir``, or the platform's default when it is unset (never created here)."""
        if self.state_dir:
            return Path(self.state_dir).expanduser()
        return default_state_dir()

    @field_validator("allowed_hosts")
    @classmethod
    def _check_hosts(cls, value: list[str]) -> list[str]:
        return _check_allowed_hosts(value)
