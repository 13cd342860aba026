"""The models panel's buttons: load, unload, pin and unpin a model.

``POST /dashboard/models/{load,unload,pin}`` take the model id as the form
field ``model`` (ids may contain ``/``, so never a path segment) and, for
``pin``, ``on=true|false``. The rules are the config editor's: admin access
(:func:`mlxd.api.http.access.can_admin`), a same-origin browser, and the
double-submit CSRF token of Litestar's ``CSRFConfig`` (the form field
``_csrf_token`` or the ``X-CSRF-Token`` header).

An htmx request gets the result line (``#models-result``) plus the panel,
fresh, as an out-of-band swap; a plain form post gets a small page. A
refusal (by the fleet: a model that cannot fit, a failed load; or here: no
such model, no token) keeps its status and shows its message; it is never a 500.
"""

from __future__ import annotations

import time
from typing import Any

from litestar import Controller, MediaType, Request, Response, post
from litestar.connection import ASGIConnection
from litestar.exceptions import PermissionDeniedException
from litestar.handlers import BaseRouteHandler

from mlxd.api.http.access import can_admin, can_read
from mlxd.api.ops.stats import NO_STORE, fleet_stats
from mlxd.api.state import AppState, Mlxd
from mlxd.dashboard.csrf import csrf_token
from mlxd.dashboard.refused import DashboardRefused, require_admin
from mlxd.dashboard.regions import format_region
from mlxd.dashboard.templating import environment
from mlxd.engine import FleetRefusal

MAX_FORM_BYTES = 16 * 1024
MAX_ID_CHARS = 256
TRUE = ("true", "1", "on", "yes")
FALSE = ("false", "0", "off", "no")


def actions_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    require_admin(connection, "dashboard")


def panel_state(request: Request, mlxd: AppState, admin: bool) -> dict[str, Any]:
    """What the models region reads: the fleet's view, and the CSRF token for an admin's buttons.

    The token is what the browser's cookie holds (Litestar's middleware sets
    one on any GET without it); a cookie signed by an earlier process is
    replaced on the page's next full load (:func:`csrf_token`).
    """
    token = csrf_token(request)[0] if admin else ""
    return {"fleet": fleet_stats(mlxd, admin=admin), "actions": token or None}


def _html(html: str, status: int, outcome: str) -> Response[str]:
    headers = {**NO_STORE, "X-Mlxd-Outcome": outcome}
    return Response(html, status_code=status, media_type=MediaType.HTML, headers=headers)


def _answer(request: Request, status: int, outcome: str, message: str) -> Response[str]:
    """The result line, and the panel as it is now (for an htmx swap, or a whole page)."""
    mlxd: AppState = request.app.state.mlxd
    now = time.time()
    result = {"outcome": outcome, "message": message}
    # After a refusal for want of admin access: the panel without buttons, or
    # none for a client that may not even read the dashboard.
    panel = None
    if can_read(request, mlxd.settings):
        admin = can_admin(request, mlxd.settings)
        panel = format_region("models", panel_state(request, mlxd, admin), now)
    env = environment()
    if request.headers.get("hx-request"):
        html = env.get_template("models_result.html").render(result=result)
        if panel is not None:
            html += env.get_template("partials/models.html").render(v=panel, oob=True)
    else:
        html = env.get_template("models_action.html").render(result=result, v=panel)
    return _html(html, status, outcome)


def _on_refused(request: Request, exc: DashboardRefused) -> Response[str]:
    return _answer(request, exc.status, "refused", exc.message)


def _on_csrf(request: Request, _: PermissionDeniedException) -> Response[str]:
    message = "the form's CSRF token is missing or stale: reload the page and try again"
    return _answer(request, 403, "refused", message)


async def _model_id(request: Request, mlxd: AppState) -> tuple[str, dict[str, str]]:
    """The form's ``model``, checked against the configured ids."""
    form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
    model_id = form.get("model", "").strip()
    if not model_id:
        raise DashboardRefused(400, "the form names no model (field 'model')")
    if len(model_id) > MAX_ID_CHARS:
        raise DashboardRefused(400, f"a model id is at most {MAX_ID_CHARS} characters")
    view = mlxd.fleet.status()
    if view.get(model_id) is None:
        known = ", ".join(m.id for m in view.models) or "none"
        raise DashboardRefused(404, f"no model {model_id!r} is configured (configured: {known})")
    return model_id, form


async def _act(request: Request, mlxd: AppState, action: str) -> Response[str]:
    model_id, form = await _model_id(request, mlxd)
    fleet = mlxd.fleet
    try:
        if action == "load":
            await fleet.load(model_id)
            done = f"{model_id} is loaded"
        elif action == "unload":
            await fleet.unload(model_id)
            done = f"{model_id} is unloaded"
        else:
            raw = form.get("on", "true").strip().lower()
            if raw not in TRUE + FALSE:
                raise DashboardRefused(400, f"'on' must be true or false, not {raw[:20]!r}")
            on = raw in TRUE
            await fleet.pin(model_id, on)
            done = f"{model_id} is {'pinned' if on else 'no longer pinned'}"
    except FleetRefusal as refusal:
        failed = refusal.failed
        return _answer(request, failed.status, "refused", f"{action} {model_id}: {failed.message}")
    return _answer(request, 200, "done", done)


class ModelActionsController(Controller):
    path = "/dashboard/models"
    guards = [actions_guard]
    exception_handlers = {DashboardRefused: _on_refused, PermissionDeniedException: _on_csrf}
    request_max_body_size = MAX_FORM_BYTES

    @post("/load", status_code=200)
    async def load(self, request: Request, mlxd: Mlxd) -> Response[str]:
        """Load a model (waits for memory and for the load; a failure is its refusal)."""
        return await _act(request, mlxd, "load")

    @post("/unload", status_code=200)
    async def unload(self, request: Request, mlxd: Mlxd) -> Response[str]:
        """Unload a model once its requests finish."""
        return await _act(request, mlxd, "unload")

    @post("/pin", status_code=200)
    async def pin(self, request: Request, mlxd: Mlxd) -> Response[str]:
        """Pin (``on=true``) or unpin (``on=false``) a model."""
        return await _act(request, mlxd, "pin")
