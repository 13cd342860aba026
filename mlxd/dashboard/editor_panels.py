"""The config editor's panels: value changes, issues, file diffs with secrets masked, history."""

from __future__ import annotations

import difflib
import json
import time
from typing import Any

from mlxd.api.reload import Change, ReloadResult
from mlxd.config import ConfigError, ConfigIssue, format_bytes, parse_toml
from mlxd.dashboard import configfile
from mlxd.dashboard.configfile import Current
from mlxd.dashboard.formatting import Formatted, ago, clock, human_bytes, iso

MASK = "********"
_BYTE_KEYS = {"batch.kv_budget", "prompt_cache.max_bytes", "limits.max_body_bytes"}


def show(key: str, value: Any) -> str:
    """A value as the diff shows it (secrets are already masked by the reload diff)."""
    if value is None:
        return "unset"
    if key in _BYTE_KEYS and isinstance(value, int) and not isinstance(value, bool):
        return _size(value)
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str)


def _size(n: int) -> str:
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return f"{n} B ({format_bytes(n)})" if n >= 1024 else f"{n} B"


def change_rows(changes: list[Change]) -> list[dict[str, str]]:
    return [
        {"key": c.key, "old": show(c.key, c.old), "new": show(c.key, c.new), "reload": c.reload}
        for c in changes
    ]


def issue_rows(issues: list[ConfigIssue], source: str) -> list[dict[str, Any]]:
    return [
        {"file": source, "line": i.line or "", "key": i.key or "—", "reason": i.reason}
        for i in issues
    ]


def secrets_in(*texts: str) -> list[str]:
    """The API keys and admin tokens written in these TOML texts, longest first."""
    found: set[str] = set()
    for text in texts:
        try:
            server = parse_toml(text, "").get("server", {})
        except ConfigError:
            continue
        keys = server.get("api_keys", [])
        values = [*keys] if isinstance(keys, list) else []
        values.append(server.get("admin_token"))
        found.update(v for v in values if isinstance(v, str) and v)
    return sorted(found, key=len, reverse=True)


def masked(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, MASK)
    return text


def file_diff(old: str, new: str, secrets: list[str]) -> list[dict[str, str]]:
    """A unified diff of two versions of the file, one row per line, secrets masked."""
    lines = difflib.unified_diff(
        old.splitlines(), new.splitlines(), "on disk", "yours", n=2, lineterm=""
    )
    rows = []
    for line in list(lines)[2:]:
        kind = {"+": "add", "-": "del", "@": "hunk"}.get(line[:1], "same")
        rows.append({"kind": kind, "text": masked(line, secrets)})
    return rows


def history_rows(
    backups: list[configfile.Backup], current: str, now: float
) -> list[dict[str, Any]]:
    rows = []
    for b in backups:
        try:
            text = b.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        secrets = secrets_in(text, current)
        rows.append(
            {
                "name": b.name,
                "replaced": clock(b.replaced_at),
                "replaced_iso": iso(b.replaced_at),
                "replaced_ago": ago(b.replaced_at, now),
                "written": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b.written_at)),
                "size": human_bytes(b.size),
                "same": text == current,
                "diff": file_diff(current, text, secrets),
            }
        )
    return rows


TITLES = {
    "valid": "Valid: Apply would make these changes",
    "unchanged": "Nothing to change",
    "applied": "Applied",
    "restart_required": "Written; the changes need a restart",
    "rejected": "Invalid: nothing was written",
    "failed": "Written, but the reload failed",
    "partial": "Written; applied in part",
    "conflict": "The file changed on disk since you loaded it: nothing was written",
    "error": "Nothing was written",
}


WRITTEN = {"applied", "restart_required", "failed", "partial"}


def diff_label(action: str, outcome: str) -> str:
    """What the file diff of a result compares, said for what happened to the file."""
    if outcome in WRITTEN:
        return "previous file → written"
    if action == "validate" and outcome in ("valid", "unchanged"):
        return "on disk → yours (Validate writes nothing)"
    return "on disk → yours, not written"


def result_panel(
    action: str,
    outcome: str,
    *,
    reload: ReloadResult | None = None,
    source: str = "",
    diff: list[dict[str, str]] | None = None,
    conflict: dict[str, Any] | None = None,
    message: str | None = None,
    note: str = "",
) -> Formatted:
    r = reload
    return {
        "action": action,
        "outcome": outcome,
        "title": TITLES.get(outcome, outcome),
        "changes": change_rows(r.changes) if r else [],
        "issues": issue_rows(r.issues, source) if r else [],
        "restart_required": r.restart_required if r else [],
        "error": message or (r.error if r else None),
        "version": r.version if r and r.applied else None,
        "diff": diff or [],
        "diff_label": diff_label(action, outcome),
        "conflict": conflict,
        "note": note,
    }


def conflict_panel(yours: str, disk: Current, label: str = "Yours") -> Formatted:
    secrets = secrets_in(yours, disk.text)
    return {
        "label": label,
        "disk": masked(disk.text, secrets) if disk.exists else "(the file is gone)",
        "yours": masked(yours, secrets),
        "diff": file_diff(disk.text, yours, secrets),
        "sha256": disk.sha256,
    }
