"""The config editor at ``/dashboard/config``: quick controls, the raw TOML, history.

Validate shows what a submission would change (key, old → new, live/swap/
restart) or what is wrong with it, and writes nothing. Apply validates, writes
the file atomically (the replaced version goes to the history) and reloads
through :func:`mlxd.reload.reload_from_file`, the path SIGHUP and
``/admin/reload`` take. Rollback does the same with a kept version.

The page embeds the sha256 of the file as it was loaded; apply and rollback
refuse to write when the file on disk has changed since, and show both
versions. Everything here needs admin access (the raw editor shows the whole
file), and every form carries the CSRF token of Litestar's ``CSRFConfig``.
"""

from __future__ import annotations

import asyncio
import difflib
import hmac
import json
import logging
import re
import time
from typing import Any

import tomli_w
from litestar import Controller, MediaType, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie
from litestar.di import Provide
from litestar.exceptions import PermissionDeniedException
from litestar.handlers import BaseRouteHandler
from litestar.middleware.csrf import generate_csrf_hash, generate_csrf_token
from litestar.utils.scope.state import ScopeState

from mlxd.api.access import admin_refusal, can_admin
from mlxd.api.admin import same_origin
from mlxd.api.state import AppState, Mlxd, provide_app_state
from mlxd.api.stats import NO_STORE
from mlxd.config import (
    ConfigError,
    ConfigIssue,
    Settings,
    dump_toml,
    format_bytes,
    parse_toml,
)
from mlxd.dashboard import configfile, views
from mlxd.dashboard.configfile import Conflict, Current
from mlxd.dashboard.routes import environment
from mlxd.reload import Change, ReloadResult, check, reload_from_file

logger = logging.getLogger(__name__)

TEMPLATE = "config.html"
MAX_FORM_BYTES = 1024 * 1024
TRIGGER = "dashboard"
APPLIED_EVENT = "config-applied"  # HX-Trigger: the page refreshes its status bar
MASK = "********"

# (key, label, kind, hint); kind "int", "size" or a tuple of choices.
QUICK: tuple[tuple[str, str, Any, str], ...] = (
    ("batch.size", "Batch size", "int", "1 runs every request serially"),
    ("batch.kv_budget", "KV budget", "size", '"auto", or a size such as 512MiB'),
    ("batch.prompt_concurrency", "Prompt concurrency", "int", "prompts prefilled together"),
    ("lanes.logprobs", "logprobs", ("batch", "serial"), "lane for requests with logprobs"),
    ("lanes.penalties", "penalties", ("batch", "serial"), "lane for sampling penalties"),
    ("lanes.logit_bias", "logit_bias", ("batch", "serial"), "lane for requests with a logit_bias"),
)
_BYTE_KEYS = {"batch.kv_budget", "prompt_cache.max_bytes", "limits.max_body_bytes"}


class EditorRefused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def editor_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    settings = connection.app.state.mlxd.settings
    if not can_admin(connection, settings):
        status = 403 if settings.server.admin_token is None else 401
        raise EditorRefused(status, admin_refusal(settings))
    if connection.method not in ("GET", "HEAD") and not same_origin(connection):
        raise EditorRefused(403, "cross-site requests to the editor are refused")


# ---------------------------------------------------------------- views


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


def quick_values(settings: Settings) -> dict[str, str]:
    """What each quick control shows for these settings."""
    dumped = settings.model_dump(mode="json")
    out = {}
    for key, *_ in QUICK:
        section, name = key.split(".")
        out[key] = str(dumped[section][name])
    return out


def quick_controls(values: dict[str, str] | None) -> list[dict[str, Any]]:
    return [
        {
            "key": key,
            "id": "q-" + key.replace(".", "-"),
            "label": label,
            "hint": hint,
            "kind": kind if isinstance(kind, str) else "choice",
            "choices": kind if isinstance(kind, tuple) else (),
            "value": (values or {}).get(key, ""),
        }
        for key, label, kind, hint in QUICK
    ]


def _typed(kind: Any, raw: str) -> Any:
    """An integer where one is meant; anything else stays text for validation to judge."""
    raw = raw.strip()
    return int(raw) if kind in ("int", "size") and re.fullmatch(r"-?\d+", raw) else raw


def quick_edit(
    text: str, submitted: dict[str, str], shown: dict[str, str]
) -> tuple[str, list[str]]:
    """``text`` with the quick controls that differ from what was shown written in.

    Only those keys change in the parsed file; everything else is kept, but
    tomli-w drops comments and formatting. ``text`` must be a valid config.
    """
    data = parse_toml(text, "")
    changed = []
    for key, _, kind, _ in QUICK:
        raw = submitted.get(key)
        if raw is None or raw.strip() == shown.get(key):
            continue
        section, name = key.split(".")
        data.setdefault(section, {})[name] = _typed(kind, raw)
        changed.append(key)
    return (tomli_w.dumps(data) if changed else text), changed


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
                "replaced": views.clock(b.replaced_at),
                "replaced_iso": views.iso(b.replaced_at),
                "replaced_ago": views.ago(b.replaced_at, now),
                "written": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b.written_at)),
                "size": views.human_bytes(b.size),
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


def result_view(
    action: str,
    outcome: str,
    *,
    reload: ReloadResult | None = None,
    source: str = "",
    diff: list[dict[str, str]] | None = None,
    conflict: dict[str, Any] | None = None,
    message: str | None = None,
    note: str = "",
) -> dict[str, Any]:
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
        "conflict": conflict,
        "note": note,
    }


def conflict_view(yours: str, disk: Current, label: str = "Yours") -> dict[str, Any]:
    secrets = secrets_in(yours, disk.text)
    return {
        "label": label,
        "disk": masked(disk.text, secrets) if disk.exists else "(the file is gone)",
        "yours": masked(yours, secrets),
        "diff": file_diff(disk.text, yours, secrets),
        "sha256": disk.sha256,
    }


# ---------------------------------------------------------------- rendering


def _block(name: str, context: dict[str, Any]) -> str:
    """One ``{% block %}`` of the editor's template: the fragment htmx swaps in."""
    template = environment().get_template(TEMPLATE)
    return "".join(template.blocks[name](template.new_context(context)))


def _html(html: str, status: int = 200, headers: dict[str, str] | None = None) -> Response[str]:
    return Response(
        html, status_code=status, media_type=MediaType.HTML, headers={**NO_STORE, **(headers or {})}
    )


def _page(request: Request, context: dict[str, Any], status: int = 200, **kw: Any) -> Response[str]:
    token, cookie = csrf_token(request)
    html = environment().get_template(TEMPLATE).render(csrf=token, **context)
    response = _html(html, status, **kw)
    if cookie is not None:
        response.set_cookie(cookie)
    return response


def csrf_token(request: Request) -> tuple[str, Cookie | None]:
    """The CSRF token to embed, and a cookie to set when the browser's one is stale.

    Litestar's middleware keeps whatever cookie the browser sends; one signed
    by a previous process (the secret is per process) would fail every form
    after a restart, so the page replaces it.
    """
    config = request.app.csrf_config
    if config is None:
        return "", None
    token = ScopeState.from_scope(request.scope).csrf_token
    if isinstance(token, str) and len(token) > 64:
        expected = generate_csrf_hash(token[:64], config.secret)
        if hmac.compare_digest(token[64:], expected):
            return token, None
    token = generate_csrf_token(config.secret)
    if request.method != "GET":
        return token, None  # a refusal: no form on it, and the browser's cookie stays
    cookie = Cookie(
        key=config.cookie_name,
        value=token,
        path=config.cookie_path,
        secure=config.cookie_secure,
        httponly=config.cookie_httponly,
        samesite=config.cookie_samesite,
        domain=config.cookie_domain,
    )
    return token, cookie


def _refusal(request: Request, status: int, message: str) -> Response[str]:
    result = result_view("", "refused", message=message)
    if request.headers.get("hx-request"):
        return _html(_block("config_result", {"result": result}), status)
    login = status == 401
    return _page(request, {"refused": message, "login": login, "result": result}, status)


def _on_refused(request: Request, exc: EditorRefused) -> Response[str]:
    return _refusal(request, exc.status, exc.message)


def _on_csrf(request: Request, _: PermissionDeniedException) -> Response[str]:
    message = "the form's CSRF token is missing or stale: reload the page and try again"
    return _refusal(request, 403, message)


def editor_context(
    mlxd: AppState,
    *,
    result: dict[str, Any] | None = None,
    quick: dict[str, str] | None = None,
    raw: str | None = None,
    base: str | None = None,
) -> dict[str, Any]:
    """Everything the editor shows: the file, the quick controls, the history, a result."""
    now = time.time()
    snapshot = mlxd.engine.snapshot().as_dict(now)
    context: dict[str, Any] = {
        "status": views.region_view("status-bar", snapshot, now),
        "result": result,
    }
    path = mlxd.config_path
    if path is None:
        context["effective"] = dump_toml(mlxd.settings)
        return context
    try:
        current = configfile.read_current(path)
    except (OSError, UnicodeDecodeError) as exc:
        context["unreadable"] = f"cannot read {path}: {exc}"
        return context
    settings, check_result = check(mlxd, text=current.text, trigger=TRIGGER)
    context["ed"] = {
        "path": str(path),
        "exists": current.exists,
        "sha256": base or current.sha256,
        "text": current.text if raw is None else raw,
        "quick": quick_controls(quick or (quick_values(settings) if settings else None)),
        "quick_error": None if settings else "; ".join(map(str, check_result.issues)),
        # Keys the file changes that the daemon does not run (yet).
        "pending": [c.key for c in check_result.changes if c.reload != "restart"],
        "restart": [c.key for c in check_result.changes if c.reload == "restart"],
        "history": history_rows(configfile.list_history(path), current.text, now),
        "keep": configfile.KEEP,
        "history_dir": configfile.history_dir(path).name,
    }
    return context


# ---------------------------------------------------------------- submissions


class _Stop(Exception):
    """Ends a submission early with a result; the forms stay as the user left them."""

    def __init__(self, action: str, outcome: str, **kw: Any):
        self.result = result_view(action, outcome, **kw)


def _wanted(action: str, form: dict[str, str], mlxd: AppState, current: Current) -> tuple[str, str]:
    """The file text a submission asks for, and a note about it."""
    if action == "rollback":
        try:
            return configfile.read_backup(mlxd.config_path, form.get("version", "")), ""
        except (KeyError, OSError, UnicodeDecodeError):
            raise _Stop(action, "error", message="no such version in the history") from None
    if form.get("source") == "raw":
        # Browsers may send a textarea's line breaks as CRLF.
        return form.get("text", "").replace("\r\n", "\n"), ""
    settings, result = check(mlxd, text=current.text, trigger=TRIGGER)
    if settings is None:
        issues = "; ".join(map(str, result.issues))
        message = f"the file on disk is invalid, fix it in the raw editor: {issues}"
        raise _Stop(action, "error", message=message)
    text, changed = quick_edit(current.text, form, quick_values(settings))
    if not changed:
        return text, "No quick control was changed."
    return text, (
        f"Quick controls changed {', '.join(changed)}; the file is rewritten by tomli-w, "
        "so its comments and formatting are lost (the raw editor keeps them)."
    )


def _conflict(action: str, form: dict[str, str], mlxd: AppState, disk: Current) -> _Stop:
    labels = {
        "rollback": "The version you chose",
        "quick": "Yours: your quick-control values applied to the file now on disk",
    }
    label = labels.get(action, labels.get(form.get("source", ""), "Yours"))
    try:
        yours = _wanted(action, form, mlxd, disk)[0]
    except _Stop:
        yours = form.get("text", "")
    return _Stop(action, "conflict", conflict=conflict_view(yours, disk, label))


async def _process(action: str, form: dict[str, str], mlxd: AppState) -> dict[str, Any]:
    """Validate, write and reload; raises :class:`_Stop` whenever nothing is written."""
    path = mlxd.config_path
    assert path is not None
    base = form.get("base_sha256", "")
    try:
        current = configfile.read_current(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise _Stop(action, "error", message=f"cannot read {path}: {exc}") from None
    if current.sha256 != base:
        raise _conflict(action, form, mlxd, current)
    text, note = _wanted(action, form, mlxd, current)
    diff = file_diff(current.text, text, secrets_in(current.text, text))
    settings, checked = check(mlxd, text=text, trigger=TRIGGER)
    if settings is None and action != "validate":
        # Not written; the reload path records the rejected attempt in the event log.
        checked = await reload_from_file(mlxd, trigger=TRIGGER, text=text)
    if checked.issues:
        raise _Stop(action, "rejected", reload=checked, source=str(path), diff=diff)
    if action == "validate":
        outcome = "valid" if checked.changes else "unchanged"
        raise _Stop(action, outcome, reload=checked, diff=diff, note=note)
    try:
        # fsync can take a while: off the event loop, which streams tokens meanwhile.
        await asyncio.to_thread(configfile.save, path, text, expected_sha256=base)
    except Conflict as exc:
        raise _conflict(action, form, mlxd, exc.disk) from None
    except OSError as exc:
        raise _Stop(action, "error", message=f"cannot write {path}: {exc}") from None
    logger.info("%s: wrote %s", "rollback" if action == "rollback" else "editor", path)
    reloaded = await reload_from_file(mlxd, trigger=TRIGGER, text=text)
    return result_view(action, reloaded.outcome, reload=reloaded, diff=diff, note=note)


async def _submit(action: str, request: Request, mlxd: AppState) -> Response[str]:
    form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
    if mlxd.config_path is None:
        return _refusal(request, 409, "mlxd was started without --config: there is no file to edit")
    # One submission at a time: the hash check and the write must not interleave.
    lock = request.app.state.setdefault("config_editor_lock", asyncio.Lock())
    async with lock:
        try:
            result = await _process(action, form, mlxd)
        except _Stop as stop:
            return _in_place(request, mlxd, form, stop.result)
    context = editor_context(mlxd, result=result)
    headers = {"X-Mlxd-Outcome": result["outcome"], "HX-Trigger": APPLIED_EVENT}
    if not request.headers.get("hx-request"):
        return _page(request, context, headers=headers)
    # The file changed: the whole editor (hash, text, history) is rendered anew.
    headers |= {"HX-Retarget": "#config-editor", "HX-Reswap": "outerHTML show:#config-result:top"}
    token, _ = csrf_token(request)
    return _html(_block("config_editor", {**context, "csrf": token}), headers=headers)


def _in_place(
    request: Request, mlxd: AppState, form: dict[str, str], result: dict[str, Any]
) -> Response[str]:
    """A result that leaves the forms as they are (validate, or nothing written)."""
    headers = {"X-Mlxd-Outcome": result["outcome"]}
    if request.headers.get("hx-request"):
        return _html(_block("config_result", {"result": result}), headers=headers)
    raw = form.get("text") if form.get("source") == "raw" else None
    quick = form if form.get("source") == "quick" else None
    context = editor_context(
        mlxd, result=result, quick=quick, raw=raw, base=form.get("base_sha256")
    )
    return _page(request, context, headers=headers)


class EditorController(Controller):
    path = "/dashboard/config"
    guards = [editor_guard]
    dependencies = {"mlxd": Provide(provide_app_state, sync_to_thread=False)}
    exception_handlers = {EditorRefused: _on_refused, PermissionDeniedException: _on_csrf}
    request_max_body_size = MAX_FORM_BYTES

    @get("/")
    async def page(self, request: Request, mlxd: Mlxd) -> Response[str]:
        """The editor: quick controls, the raw file, the kept versions."""
        return _page(request, editor_context(mlxd))

    @post("/validate", status_code=200)
    async def validate(self, request: Request, mlxd: Mlxd) -> Response[str]:
        """What the submitted quick controls or text would change; writes nothing."""
        return await _submit("validate", request, mlxd)

    @post("/apply", status_code=200)
    async def apply(self, request: Request, mlxd: Mlxd) -> Response[str]:
        """Validate, write the file atomically, reload; refused if the file changed on disk."""
        return await _submit("apply", request, mlxd)

    @post("/rollback", status_code=200)
    async def rollback(self, request: Request, mlxd: Mlxd) -> Response[str]:
        """Make a kept version current again (validated, written, reloaded)."""
        return await _submit("rollback", request, mlxd)
