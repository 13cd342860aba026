"""The config editor at ``/dashboard/config``: quick controls, the raw TOML, history.

Validate shows what a submission would change (key, old → new, live/swap/
restart) or what is wrong with it, and writes nothing. Apply validates, writes
the file atomically (the replaced version goes to the history) and reloads
through :func:`mlxd.api.reload.reload_from_file`, the path SIGHUP and
``/admin/reload`` take. Rollback does the same with a kept version.

The page embeds the sha256 of the file as it was loaded; apply and rollback
refuse to write when the file on disk has changed since, and show both
versions. Everything here needs admin access (the raw editor shows the whole
file), and every form carries the CSRF token of Litestar's ``CSRFConfig``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from litestar import Controller, MediaType, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.exceptions import PermissionDeniedException
from litestar.handlers import BaseRouteHandler

from mlxd.api.ops.stats import NO_STORE, daemon_stats
from mlxd.api.reload import check, reload_from_file
from mlxd.api.state import AppState, Mlxd
from mlxd.config import dump_toml
from mlxd.dashboard import configfile
from mlxd.dashboard.configfile import Conflict, Current
from mlxd.dashboard.csrf import csrf_token
from mlxd.dashboard.editor_panels import (
    conflict_panel,
    file_diff,
    history_rows,
    result_panel,
    secrets_in,
)
from mlxd.dashboard.overrides import running_overrides
from mlxd.dashboard.quick import quick_controls, quick_edit, quick_values
from mlxd.dashboard.refused import DashboardRefused, require_admin
from mlxd.dashboard.regions import format_region
from mlxd.dashboard.templating import environment

logger = logging.getLogger(__name__)

TEMPLATE = "config.html"
MAX_FORM_BYTES = 1024 * 1024
TRIGGER = "dashboard"
APPLIED_EVENT = "config-applied"  # HX-Trigger: the page refreshes its status bar


def editor_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    require_admin(connection, "editor")


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


def _refusal(request: Request, status: int, message: str) -> Response[str]:
    result = result_panel("", "refused", message=message)
    if request.headers.get("hx-request"):
        return _html(_block("config_result", {"result": result}), status)
    login = status == 401
    return _page(request, {"refused": message, "login": login, "result": result}, status)


def _on_refused(request: Request, exc: DashboardRefused) -> Response[str]:
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
    context: dict[str, Any] = {
        "status": format_region("status-bar", daemon_stats(mlxd, now, admin=False), now),
        "result": result,
        # Running values the file does not say (flags, MLXD_* variables).
        "overrides": running_overrides(mlxd.settings, mlxd.overrides),
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
        self.result = result_panel(action, outcome, **kw)


def _wanted(
    action: str, form: dict[str, str], mlxd: AppState, path: Path, current: Current
) -> tuple[str, str]:
    """The file text a submission asks for, and a note about it."""
    if action == "rollback":
        try:
            return configfile.read_backup(path, form.get("version", "")), ""
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
        f"Quick controls changed {', '.join(changed)}; only their lines of the file change, "
        "its comments and formatting are kept."
    )


def _conflict(
    action: str, form: dict[str, str], mlxd: AppState, path: Path, disk: Current
) -> _Stop:
    labels = {
        "rollback": "The version you chose",
        "quick": "Yours: your quick-control values applied to the file now on disk",
    }
    label = labels.get(action, labels.get(form.get("source", ""), "Yours"))
    try:
        yours = _wanted(action, form, mlxd, path, disk)[0]
    except _Stop:
        yours = form.get("text", "")
    return _Stop(action, "conflict", conflict=conflict_panel(yours, disk, label))


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
        raise _conflict(action, form, mlxd, path, current)
    text, note = _wanted(action, form, mlxd, path, current)
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
        raise _conflict(action, form, mlxd, path, exc.disk) from None
    except OSError as exc:
        raise _Stop(action, "error", message=f"cannot write {path}: {exc}") from None
    logger.info("%s: wrote %s", "rollback" if action == "rollback" else "editor", path)
    reloaded = await reload_from_file(mlxd, trigger=TRIGGER, text=text)
    return result_panel(action, reloaded.outcome, reload=reloaded, diff=diff, note=note)


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
    exception_handlers = {DashboardRefused: _on_refused, PermissionDeniedException: _on_csrf}
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
