"""API keys as identities (``[keys.<name>]``) and the scheduler's rules (``[scheduling]``).

A key table names one client: its secret (``key``, or ``key_env`` naming an
environment variable), its priority class, the models it may use and its
quotas. ``[server] api_keys`` entries keep working as keys of normal
priority with no limits, named ``api_keys[0]``, ``api_keys[1]``, ...
"""

from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import SecretStr, model_validator

from mlxd.config.sections import Section, _field

KeyPriority = Literal["high", "normal", "low"]
# What a [keys.<name>] table's name may be: it shows in logs, /stats and metric labels.
KEY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class KeyEntry(Section):
    """One ``[keys.<name>]`` table."""

    key: SecretStr | None = _field(
        None, "live", "The secret clients send (Bearer or x-api-key); or use key_env."
    )
    key_env: str | None = _field(
        None, "live", "The environment variable that holds the secret (instead of key)."
    )
    priority: KeyPriority = _field(
        "normal",
        "live",
        'Priority class of this key\'s requests ("high", "normal", "low"); a request may '
        "lower its own, never raise it.",
    )
    models: list[str] = _field(
        [],
        "live",
        'Model ids or fnmatch patterns ("qwen*") this key may use; empty: every model.',
    )
    requests_per_minute: int = _field(
        0, "live", "Requests per rolling minute; 0 = unlimited.", ge=0
    )
    tokens_per_minute: int = _field(
        0,
        "live",
        "Prompt + generated tokens per rolling minute (counted when a request ends); "
        "0 = unlimited.",
        ge=0,
    )
    max_concurrent: int = _field(
        0, "live", "Requests in flight at once (queued or running); 0 = unlimited.", ge=0
    )

    @model_validator(mode="after")
    def _one_secret(self) -> KeyEntry:
        if (self.key is None) == (self.key_env is None):
            raise ValueError("set exactly one of key and key_env")
        if self.key is not None and not self.key.get_secret_value().strip():
            raise ValueError("key is empty")
        return self

    def secret(self, env: dict[str, str] | None = None) -> str | None:
        """The secret, from ``key`` or the environment; None when ``key_env`` is unset."""
        if self.key is not None:
            return self.key.get_secret_value()
        value = (os.environ if env is None else env).get(self.key_env or "", "").strip()
        return value or None


class SchedulingSettings(Section):
    fair_share: bool = _field(
        True,
        "live",
        "Within a priority class, keys take turns (round-robin); false: arrival order.",
    )
    preempt: bool = _field(
        False,
        "live",
        "A more urgent request that cannot start makes the least urgent, most recently "
        "started row yield; it resumes from its kept cache with the same text.",
    )
    aging: float = _field(
        60.0,
        "live",
        "Seconds of waiting that lift a request one priority class (0: no aging), so low "
        "priority never starves.",
        ge=0,
    )
