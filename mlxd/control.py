"""``mlxd reload`` and ``mlxd status``: talk to the daemon a config file names.

The daemon is found where it recorded its address at start (its state
directory, :mod:`mlxd.address`), else by the config's ``[server] host`` and
``port`` (flags and ``MLXD_*`` variables win, as for ``mlxd serve``), and asked through its admin
API with the config's admin token when one is set. Nothing is signalled, so
only that daemon is touched, never every mlxd on the machine.

Standard library only (``urllib``): this runs without the web stack loaded.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.address import read_record, url_for
from mlxd.config import ConfigError, load_settings, parse_toml, shown_value

TIMEOUT_S = 130.0  # a reload that swaps the model may take a while


@dataclass(frozen=True)
class Target:
    """Where the daemon listens, and how to authenticate to its admin API."""

    url: str
    token: str | None
    note: str = ""  # why the config could not be used as a whole, if it could not
    # Set when the daemon recorded another address than the config's (started with --port).
    recorded: str = ""


def find_target(path: Path | None, *, host: str | None = None, port: int | None = None) -> Target:
    """The daemon's URL and admin token, from the config at ``path`` and the flags.

    Without ``--host``/``--port``, the address the daemon of this config
    recorded at its start (:mod:`mlxd.address`) wins over the file's: it
    may run on a ``--port`` the file does not say. An invalid config
    (someone is editing it) still names its ``[server]`` host, port and
    token as long as it is valid TOML; the daemon then says what is wrong
    with the rest.
    """
    overrides = {"server": {k: v for k, v in (("host", host), ("port", port)) if v is not None}}
    note = ""
    try:
        server = load_settings(path, overrides=overrides).server
        h, p = server.host, server.port
        token = server.admin_token.get_secret_value() if server.admin_token else None
        state_dir = server.state_path
    except ConfigError as exc:
        note = f"the config is invalid ({'; '.join(map(str, exc.issues))})"
        raw: dict[str, Any] = {}
        if path is not None:
            try:
                raw = parse_toml(Path(path).read_text(encoding="utf-8"), str(path)).get(
                    "server", {}
                )
            except (ConfigError, OSError, UnicodeDecodeError):
                raw = {}
        defaults = load_settings(None, overrides=overrides).server
        h = host or str(raw.get("host") or defaults.host)
        p = port or int(raw.get("port") or defaults.port)
        token = raw.get("admin_token") if isinstance(raw.get("admin_token"), str) else None
        own = raw.get("state_dir")
        state_dir = Path(own).expanduser() if isinstance(own, str) and own else defaults.state_path
    url = url_for(h, p)
    if host is None and port is None:
        found = read_record(state_dir, path)
        if found is not None and found.url != url:
            recorded = (
                f"the daemon of this config listens at {found.url} (pid {found.pid}, recorded "
                f"in {found.path}), not at the config's {url}"
            )
            return Target(found.url, token or None, note, recorded)
    return Target(url, token or None, note)


class Unreachable(Exception):
    """No daemon answered at the target URL."""


def call(target: Target, method: str, route: str) -> tuple[int, dict[str, Any]]:
    """One admin request; returns (status, JSON body). Raises :class:`Unreachable`."""
    request = urllib.request.Request(
        target.url + route, method=method, data=b"" if method == "POST" else None
    )
    if target.token:
        request.add_header("X-Mlxd-Admin-Token", target.token)
    request.add_header("Accept", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {"error": {"message": f"HTTP {exc.code}"}}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise Unreachable(f"no mlxd answers at {target.url} ({reason})") from None


def unreachable_hint(path: Path | None, command: str) -> str:
    """What to try when no daemon answers: the pairing of ``serve`` and ``status``."""
    config = f" --config {path}" if path is not None else ""
    return (
        "is it running, with this config? A daemon started with --port is found through "
        "the address it records in [server] state_dir; with another state directory, pass "
        f"the same flag: `mlxd {command}{config} --port <its port>`"
    )


def message(body: dict[str, Any]) -> str:
    error = body.get("error")
    return error.get("message", str(error)) if isinstance(error, dict) else str(error or body)


# ---------------------------------------------------------------- reload


def reload_lines(status: int, body: dict[str, Any]) -> tuple[list[str], int]:
    """What ``mlxd reload`` prints for the daemon's answer, and its exit code."""
    result = body.get("reload", body) if status == 400 else body
    if status not in (200, 400) or "outcome" not in result:
        return [f"reload refused (HTTP {status}): {message(body)}"], 1
    outcome = result["outcome"]
    lines = [f"reload: {outcome} (config v{result.get('version', '?')})"]
    for change in result.get("changes", []):
        old, new = (shown_value(change["key"], change[k]) for k in ("old", "new"))
        lines.append(f"  {change['key']}: {old} -> {new} ({change['reload']})")
    for issue in result.get("issues", []):
        lines.append(f"  {issue['message']}")
    if result.get("restart_required"):
        lines.append(f"restart required for: {', '.join(result['restart_required'])}")
    if result.get("error"):
        lines.append(f"error: {result['error']}")
    if result.get("evicted"):
        lines.append(f"unloaded to fit [memory] budget: {', '.join(result['evicted'])}")
    for warning in result.get("warnings", []):
        lines.append(f"warning: {warning}")
    for note in result.get("notes", []):
        lines.append(f"note: {note}")
    if outcome == "unchanged":
        lines.append("  the file matches the running config")
    return lines, 0 if outcome in ("applied", "unchanged", "restart_required") else 1


# ---------------------------------------------------------------- status


def _bytes(n: float | None) -> str:
    from mlxd.config import format_bytes

    return "-" if n is None else format_bytes(n)


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} m" if h else f"{m} m {s:02d} s" if m else f"{s} s"


def key_lines(keys: list[dict[str, Any]]) -> list[str]:
    """A line per API key: its class, load, quota use and preemptions (``/stats`` ``keys``)."""
    lines = []
    for k in keys:
        tokens = f"{k['tokens_last_minute']}"
        if k["tokens_per_minute"]:
            tokens += f"/{k['tokens_per_minute']}"
        requests = f"{k['requests_last_minute']}"
        if k["requests_per_minute"]:
            requests += f"/{k['requests_per_minute']}"
        lines.append(
            f"  key {k['name']}: {k['priority']}; running {k['running']}, waiting {k['waiting']}; "
            f"last minute {requests} requests, {tokens} tokens; "
            f"{k['preemptions']} preempted, {k['refused']} rate-limited"
        )
    return lines


def status_lines(url: str, s: dict[str, Any]) -> tuple[list[str], int]:
    """What ``mlxd status`` prints for a ``/stats`` answer, and its exit code."""
    model, batch, config = s["model"], s["batch"], s["config"]
    pid = s.get("runtime", {}).get("pid")
    state = s["state"] + (", stalled" if s.get("stalled") else "")
    lines = [
        f"mlxd at {url}: {state} (pid {pid}, up {_duration(s['uptime_s'])})",
        f"  model: {model['name'] or '(none)'} ({model['status']})",
        f"  mode: {s['mode']}, batch size {batch['configured']}; "
        f"running {batch['active_rows']}, waiting {batch['pending_rows']}",
        f"  KV: {_bytes(batch['kv_bytes'])} of a {_bytes(batch['kv_budget_bytes'])} budget",
        f"  config: v{config['version']} from {config['source'] or 'defaults'}, applied "
        + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(config["applied_at"])),
    ]
    if model.get("error"):
        lines.append(f"  model error: {model['error']}")
    if s.get("last_error"):
        lines.append(f"  last error: {s['last_error']}")
    if s.get("stalled_reason"):
        lines.append(f"  stalled: {s['stalled_reason']}")
    fleet = s.get("fleet") or {}
    models = fleet.get("models", [])
    if len(models) > 1:
        lines.append(
            f"  models: {_bytes(fleet['used_bytes'])} of a {_bytes(fleet['budget_bytes'])} "
            "memory budget"
        )
        for m in models:
            flags = [m["state"], m["kind"]] + [f for f in ("default", "pinned") if m[f]]
            held = f", {_bytes(m['reserved_bytes'] + m['kv_bytes'])}" if m["reserved_bytes"] else ""
            line = f"    {m['id']}: {', '.join(flags)}{held}"
            if m.get("wait_reason") or m.get("error"):
                line += f" ({m.get('wait_reason') or m.get('error')})"
            lines.append(line)
    if fleet.get("over_budget"):
        lines.append(f"  cannot serve: {fleet['over_budget']}")
    lines += key_lines(s.get("keys") or [])
    # The default model may be unloaded (loaded on demand); pinned ones must be loaded.
    pinned_ok = all(m["state"] == "loaded" for m in models if m["pinned"])
    default_ok = model["status"] in ("ready", "unloaded")
    healthy = s["state"] in ("ready", "unloaded") and not s.get("stalled") and default_ok
    return lines, 0 if healthy and pinned_ok and not fleet.get("over_budget") else 1
