"""What the daemon runs that the config file does not say: command-line flags and MLXD_* variables.

``mlxd serve --config mlxd.toml --port 18100`` runs on 18100 while the file
says 8080; the config page lists such values next to the file, so the file
is never mistaken for the whole story. Secrets are masked.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr

from mlxd.config import SECTIONS, Settings

_ENV_PREFIX = "MLXD_"
_FLAGS = {("server", "host"): "--host", ("server", "port"): "--port"}
_FLAGS |= {("server", "log_level"): "--log-level", ("model", "path"): "--model"}


@dataclass(frozen=True)
class Override:
    """One running value that does not come from the file."""

    key: str  # "[server] port"
    value: str  # what runs, as text (secrets masked)
    source: str  # "--port" or "MLXD_SERVER__PORT"


def running_overrides(
    settings: Settings,
    flags: Mapping[str, Mapping[str, Any]],
    environ: Mapping[str, str] | None = None,
) -> list[Override]:
    """The running values set by ``flags`` ({"server": {"port": ...}}) or MLXD_* variables."""
    env = os.environ if environ is None else environ
    found: dict[tuple[str, str], str] = {}
    for name in sorted(env):
        if not name.startswith(_ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(_ENV_PREFIX) :].lower().partition("__")
        if section in SECTIONS and key in SECTIONS[section].model_fields:
            found[(section, key)] = name
    for section, values in flags.items():
        for key in values:
            found[(section, key)] = _FLAGS.get((section, key), f"--{key.replace('_', '-')}")
    out = []
    for (section, key), source in found.items():
        table = getattr(settings, section, None)
        value = getattr(table, key, None) if table is not None else None
        out.append(Override(f"[{section}] {key}", _shown(value), source))
    return out


def _shown(value: Any) -> str:
    if isinstance(value, SecretStr):
        return "**********"
    if isinstance(value, list) and any(isinstance(v, SecretStr) for v in value):
        return f"<{len(value)} keys>"
    return "unset" if value is None else str(value)
