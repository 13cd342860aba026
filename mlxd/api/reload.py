"""One reload path for SIGHUP, ``POST /admin/reload`` and the dashboard editor.

read → parse → validate (a new frozen :class:`Settings`; the running one is
never mutated) → diff against the running config (``model_dump()`` to
``model_dump()``) → apply. Invalid input changes nothing. Live keys are applied
on the engine thread between two steps; a changed model drains both lanes and
swaps; keys that need a restart (host, port, BLAS) are reported, not applied.
Every attempt is recorded in the daemon's reload log (``AppState.reload_log``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr

from mlxd.api.reload_log import ReloadEvent
from mlxd.config import (
    SECTIONS,
    ConfigError,
    ConfigIssue,
    ModelEntry,
    Settings,
    load_settings,
    reload_class,
    shown_value,
)
from mlxd.config.registry import registry_notes
from mlxd.modelcheck import registry_problems

if TYPE_CHECKING:
    from mlxd.api.state import AppState

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
    # Idle unpinned models unloaded to fit a lowered [memory] budget.
    evicted: list[str] = field(default_factory=list)
    # What took effect but leaves the daemon unable to serve (an over-committed budget).
    warnings: list[str] = field(default_factory=list)
    # What the model changes mean for clients: an id removed or renamed, a pin lost.
    notes: list[str] = field(default_factory=list)

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
            # An optional section ([cluster]) may be absent on either side.
            a = (before[section] or {}).get(key)
            b = (after[section] or {}).get(key)
            if a != b:
                changes.append(
                    Change(f"{section}.{key}", _display(a), _display(b), reload_class(section, key))
                )
    changes += _registry_diff(before["models"], after["models"])
    return changes + _keys_diff(before["keys"], after["keys"])


def _keys_diff(before: dict[str, Any], after: dict[str, Any]) -> list[Change]:
    """``[keys.<name>]`` changes, all live: a key added or removed, or one setting of it."""
    changes = []
    for name in [*before, *(n for n in after if n not in before)]:
        a, b = before.get(name), after.get(name)
        if a is None or b is None:
            was, now = ("configured" if a else None), ("configured" if b else None)
            changes.append(Change(f"keys.{name}", was, now, "live"))
            continue
        changes += [
            Change(f"keys.{name}.{k}", _display(a.get(k)), _display(b.get(k)), "live")
            for k in a
            if a.get(k) != b.get(k)
        ]
    return changes


def _registry_diff(before: dict[str, Any], after: dict[str, Any]) -> list[Change]:
    """``[models.<id>]`` changes: an entry added or removed, or one key of it."""
    changes = []
    for model_id in [*before, *(i for i in after if i not in before)]:
        a, b = before.get(model_id), after.get(model_id)
        if a is None or b is None:
            changes.append(
                Change(
                    f"models.{model_id}",
                    "configured" if a else None,
                    "configured" if b else None,
                    "live",
                )
            )
            continue
        for key in ModelEntry.model_fields:
            if a.get(key) != b.get(key):
                changes.append(
                    Change(f"models.{model_id}.{key}", a.get(key), b.get(key), _entry_reload(key))
                )
    return changes


def _entry_reload(key: str) -> str:
    """How a change to a ``[models.<id>]`` key takes effect: live or swap."""
    extra = ModelEntry.model_fields[key].json_schema_extra
    assert isinstance(extra, dict)
    return str(extra["reload"])


def _effective(old: Settings, new: Settings, changes: list[Change], *, swap_ok: bool) -> Settings:
    """``new``, except for what cannot take effect now (restart keys, a failed swap)."""
    keep: dict[str, dict[str, Any]] = {}
    for change in changes:
        if change.reload == "restart" or (change.reload == "swap" and not swap_ok):
            section, key = change.key.split(".", 1)
            keep.setdefault(section, {})[key] = getattr(getattr(old, section), key, None)
    if not keep:
        return new
    update: dict[str, Any] = {}
    for section, kv in keep.items():
        if section == "cluster":  # every cluster key needs a restart: keep the old table
            update[section] = old.cluster
        else:
            update[section] = getattr(new, section).model_copy(update=kv)
    return new.model_copy(update=update)


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
    old = state.settings
    changed = {i for i, e in new.models.items() if old.models.get(i) != e}
    if new.model != old.model or changed:
        # Checked before anything drains: a typo must not pause admission.
        problems = registry_problems(new, only=changed)
        if problems:
            result.issues = [ConfigIssue(key, reason) for key, reason in problems]
            return None, result
    result.ok = True
    result.changes = diff(state.settings, new)
    result.notes = registry_notes(old, new)
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
        if new is None:
            logger.warning("reload (%s) rejected: %s", trigger, "; ".join(map(str, result.issues)))
            await _record(state, result)
            return result
        old = state.settings
        effective = _effective(old, new, result.changes, swap_ok=True)
        done = await state.fleet.apply(effective)
        failed = done.failed
        if failed:
            result.ok = False
            result.error = "; ".join(failed.values())
            logger.error("%s", result.error)
            effective = _revert(effective, old, set(failed))
            await state.fleet.apply(effective)
        if done.kept:  # live changes a model could not take (a prompt cache that does not fit)
            kept = "; ".join(done.kept.values())
            result.error = f"{result.error}; {kept}" if result.error else kept
            logger.warning("reload (%s): %s", trigger, kept)
        if done.evicted:
            result.evicted = list(done.evicted)
            logger.info(
                "reload (%s): unloaded %s to fit [memory] budget", trigger, ", ".join(done.evicted)
            )
        for note in result.notes:
            logger.warning("reload (%s): %s", trigger, note)
        if done.over_budget:
            result.warnings.append(done.over_budget)
            logger.warning("reload (%s): %s", trigger, done.over_budget)
        result.applied = [
            c.key
            for c in result.changes
            if c.reload == "live" or (c.reload == "swap" and not _failed(c.key, failed, new))
        ]
        if result.applied:
            state.settings = effective
            _apply_process_settings(effective)
            if state.downloads is not None:  # [server] downloads is live: pull what it adds
                state.downloads.reloaded(old)
        await _record(state, result)
        if result.changes:
            restart = ", ".join(result.restart_required)
            applied = set(result.applied)
            changes = ", ".join(
                f"{c.key} {shown_value(c.key, c.old)} → {shown_value(c.key, c.new)}"
                for c in result.changes
                if c.key in applied
            )
            logger.info(
                "reload (%s): %s; %s%s",
                trigger,
                result.outcome,
                f"applied {changes}" if changes else "nothing applied",
                f"; restart required for {restart}" if restart else "",
            )
        return result


def _failed(key: str, failed: dict[str, str], new: Settings) -> bool:
    """Whether the change of ``key`` belongs to a model whose swap failed."""
    if key.startswith("model."):
        return bool(failed) and not new.models
    parts = key.split(".")
    return len(parts) > 1 and parts[0] == "models" and parts[1] in failed


def _revert(settings: Settings, old: Settings, failed: set[str]) -> Settings:
    """``settings`` with the entries of models whose swap failed as they were."""
    if not settings.models:
        return settings.model_copy(update={"model": old.model})
    models = {i: (old.models.get(i, e) if i in failed else e) for i, e in settings.models.items()}
    return settings.model_copy(update={"models": models})


def _apply_process_settings(settings: Settings) -> None:
    logging.getLogger().setLevel(settings.server.log_level.upper())


async def _record(state: AppState, result: ReloadResult) -> None:
    """Log the attempt on the daemon; a good one also clears the default engine's last error."""
    log = state.reload_log
    version = log.next_version(bool(result.applied))
    event = ReloadEvent(
        id=log.attempts + 1,
        trigger=result.trigger,
        at=time.time(),
        outcome=result.outcome,
        changed=tuple(c.key for c in result.changes),
        restart_required=tuple(result.restart_required),
        error=result.error
        or "; ".join(map(str, result.issues))
        or "; ".join(result.warnings)
        or None,
        version=version,
        values=tuple(
            (c.key, shown_value(c.key, c.old), shown_value(c.key, c.new)) for c in result.changes
        ),
    )
    state.reload_log = log.record(event, applied=bool(result.applied))
    result.version = version
    if result.outcome in ("applied", "unchanged", "restart_required"):
        await asyncio.wrap_future(state.engine.clear_error())  # a later good reload clears it
