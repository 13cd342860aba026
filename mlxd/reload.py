"""One reload path for SIGHUP, ``POST /admin/reload`` and the dashboard editor.

read → parse → validate (a new frozen :class:`Settings`; the running one is
never mutated) → diff against the running config (``model_dump()`` to
``model_dump()``) → apply. Invalid input changes nothing. Live keys are applied
on the engine thread between two steps; a changed model drains both lanes and
swaps; keys that need a restart (host, port, BLAS) are reported, not applied.
Every attempt is recorded in the snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr

from mlxd.config import SECTIONS, ConfigError, ConfigIssue, Settings, load_settings, reload_class
from mlxd.engine.snapshot import ConfigView, ReloadEvent
from mlxd.modelcheck import model_problems

if TYPE_CHECKING:
    from mlxd.api.state import AppState
    from mlxd.engine.core import EngineCore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Change:
    key: str  # "batch.size"
    old: Any
    new: Any
    reload: str  # live | swap | restart


@dataclass
class ReloadResult:
    """What a reload found and did; ``as_dict`` is the /admin/reload answer."""

    trigger: str
    ok: bool
    changes: list[Change] = field(default_factory=list)
    applied: list[str] = field(default_factory=list)
    restart_required: list[str] = field(default_factory=list)
    issues: list[ConfigIssue] = field(default_factory=list)
    error: str | None = None
    version: int = 0
    dry_run: bool = False

    @property
    def outcome(self) -> str:
        if self.issues:
            return "rejected"
        if self.error:
            return "partial" if self.applied else "failed"
        if not self.changes:
            return "unchanged"
        return "applied" if self.applied else "restart_required"

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["outcome"] = self.outcome
        out["issues"] = [
            {"key": i.key, "reason": i.reason, "line": i.line, "message": str(i)}
            for i in self.issues
        ]
        return out


def _display(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return "**********"
    if isinstance(value, list) and any(isinstance(v, SecretStr) for v in value):
        return [f"<{len(value)} keys>"]
    return value


def diff(old: Settings, new: Settings) -> list[Change]:
    """Every key whose value differs, with how it takes effect (secrets masked)."""
    changes = []
    before, after = old.model_dump(), new.model_dump()
    for section in SECTIONS:
        for key in SECTIONS[section].model_fields:
            a, b = before[section][key], after[section][key]
            if a != b:
                changes.append(
                    Change(f"{section}.{key}", _display(a), _display(b), reload_class(section, key))
                )
    return changes


def _effective(old: Settings, new: Settings, changes: list[Change], *, swap_ok: bool) -> Settings:
    """``new``, except for what cannot take effect now (restart keys, a failed swap)."""
    keep: dict[str, dict[str, Any]] = {}
    for change in changes:
        if change.reload == "restart" or (change.reload == "swap" and not swap_ok):
            section, key = change.key.split(".", 1)
            keep.setdefault(section, {})[key] = getattr(getattr(old, section), key)
    if not keep:
        return new
    return new.model_copy(
        update={
            section: getattr(new, section).model_copy(update=kv) for section, kv in keep.items()
        }
    )


def check(
    state: AppState, *, text: str | None = None, trigger: str = "validate"
) -> tuple[Settings | None, ReloadResult]:
    """Validate the file (or ``text`` meant for it) and diff it; apply nothing."""
    result = ReloadResult(trigger=trigger, ok=False, dry_run=True)
    if state.config_path is None:
        result.issues = [
            ConfigIssue("", "mlxd was started without a config file (--config); nothing to reload")
        ]
        return None, result
    try:
        new = load_settings(state.config_path, text=text, overrides=state.overrides)
    except ConfigError as exc:
        result.issues = exc.issues
        return None, result
    if new.model != state.settings.model:
        # Checked before anything drains: a typo must not pause admission.
        problems = model_problems(new.model)
        if problems:
            result.issues = [ConfigIssue(key, reason) for key, reason in problems]
            return None, result
    result.ok = True
    result.changes = diff(state.settings, new)
    result.restart_required = [c.key for c in result.changes if c.reload == "restart"]
    return new, result


async def reload_from_file(
    state: AppState, *, trigger: str, text: str | None = None
) -> ReloadResult:
    """Reload the config file (or apply ``text`` already validated for it).

    Never raises for bad input: the result says what was wrong, and the
    daemon keeps its running config.
    """
    async with state.reload_lock:
        new, result = check(state, text=text, trigger=trigger)
        result.dry_run = False
        engine = state.engine
        if new is None:
            logger.warning("reload (%s) rejected: %s", trigger, "; ".join(map(str, result.issues)))
            await _record(engine, result)
            return result
        old = state.settings
        swaps = [c for c in result.changes if c.reload == "swap"]
        swap_ok = True
        if swaps:
            try:
                info = await asyncio.wrap_future(engine.swap_model(new.model))
                logger.info("model swapped to %s", info.id)
            except Exception as exc:
                swap_ok = False
                result.ok = False
                result.error = f"model swap failed, the previous model keeps serving: {exc}"
                logger.error("%s", result.error)
        effective = _effective(old, new, result.changes, swap_ok=swap_ok)
        result.applied = [
            c.key for c in result.changes if c.reload == "live" or (c.reload == "swap" and swap_ok)
        ]
        if result.applied:
            await asyncio.wrap_future(engine.call(lambda core: core.apply(effective)))
            state.settings = effective
            _apply_process_settings(effective)
        await _record(engine, result)
        if result.changes:
            logger.info(
                "reload (%s): %s; applied %s; restart required for %s",
                trigger,
                result.outcome,
                ", ".join(result.applied) or "nothing",
                ", ".join(result.restart_required) or "nothing",
            )
        return result


def _apply_process_settings(settings: Settings) -> None:
    logging.getLogger().setLevel(settings.server.log_level.upper())


async def _record(engine: Any, result: ReloadResult) -> None:
    def record(core: EngineCore) -> int:
        version = core.config.version + (1 if result.applied else 0)
        if result.applied:
            core.config = ConfigView(
                version=version, applied_at=time.time(), source=core.config.source
            )
        core.reload_seq += 1
        core.reloads.append(
            ReloadEvent(
                id=core.reload_seq,
                trigger=result.trigger,
                at=time.time(),
                outcome=result.outcome,
                changed=tuple(c.key for c in result.changes),
                restart_required=tuple(result.restart_required),
                error=result.error or ("; ".join(map(str, result.issues)) or None),
                version=version,
            )
        )
        return version

    result.version = await asyncio.wrap_future(engine.call(record))
