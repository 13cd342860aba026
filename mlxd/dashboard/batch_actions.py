"""The batches panel's cancel button: ``POST /dashboard/batches/cancel`` (form field ``batch``).

The models panel's rules (:mod:`mlxd.dashboard.model_actions`): admin access,
a same-origin browser, the double-submit CSRF token. An admin may cancel
any key's batch. An htmx request gets the result line (``#batches-result``)
and the panel, fresh, as an out-of-band swap; a plain form post a small page.
"""

from __future__ import annotations

import time
from typing import Any

from litestar import Controller, MediaType, Request, Response, post
from litestar.connection import ASGIConnection
from litestar.exceptions import PermissionDeniedException
from litestar.handlers import BaseRouteHandler

from mlxd.api.http.access import can_admin, can_read
from mlxd.api.ops.stats import NO_STORE
from mlxd.api.state import AppState, Mlxd
from mlxd.dashboard.csrf import csrf_token
from mlxd.dashboard.refused import DashboardRefused, require_admin
from mlxd.dashboard.regions import format_region
from mlxd.dashboard.templating import environment

MAX_FORM_BYTES = 16 * 1024
MAX_ID_CHARS = 128


def batches_state(request: Request, mlxd: AppState, admin: bool) -> dict[str, Any]:
    """What the batches region reads: the Batch API's view, the CSRF token for an admin."""
    batches = mlxd.batches.dashboard() if mlxd.batches is not None else None
    token = csrf_token(request)[0] if admin else ""
    return {"batches": batches, "batches_csrf": token or None}


def _guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    require_admin(connection, "dashboard")


def _answer(request: Request, status: int, outcome: str, message: str) -> Response[str]:
    mlxd: AppState = request.app.state.mlxd
    result = {"outcome": outcome, "message": message}
    panel = None
    if can_read(request, mlxd.settings):
        state = batches_state(request, mlxd, can_admin(request, mlxd.settings))
        panel = format_region("batches", state, time.time())
    env = environment()
    if request.headers.get("hx-request"):
        html = env.get_template("batches_result.html").render(result=result)
        if panel is not None:
            html += env.get_template("partials/batches.html").render(v=panel, oob=True)
    else:
        html = env.get_template("batches_action.html").render(result=result, v=panel)
    headers = {**NO_STORE, "X-Mlxd-Outcome": outcome}
    return Response(html, status_code=status, media_type=MediaType.HTML, headers=headers)


def _on_refused(request: Request, exc: DashboardRefused) -> Response[str]:
    return _answer(request, exc.status, "refused", exc.message)


def _on_csrf(request: Request, _: PermissionDeniedException) -> Response[str]:
    message = "the form's CSRF token is missing or stale: reload the page and try again"
    return _answer(request, 403, "refused", message)


class BatchActionsController(Controller):
    path = "/dashboard/batches"
    guards = [_guard]
    exception_handlers = {DashboardRefused: _on_refused, PermissionDeniedException: _on_csrf}
    request_max_body_size = MAX_FORM_BYTES

    @post("/cancel", status_code=200)
    async def cancel(self, request: Request, mlxd: Mlxd) -> Response[str]:
        """Cancel a batch: no more lines start, those running stop at their next token."""
        form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
        batch_id = form.get("batch", "").strip()
        if not batch_id or len(batch_id) > MAX_ID_CHARS:
            raise DashboardRefused(400, "the form names no batch (field 'batch')")
        batches = mlxd.batches
        if batches is None or batches.error is not None:
            raise DashboardRefused(503, "the Batch API is off")
        job = batches.runner.get(batch_id)
        if job is None:
            raise DashboardRefused(404, f"no open batch {batch_id!r}")
        if job.status not in ("validating", "in_progress"):
            return _answer(request, 200, "done", f"{batch_id} is {job.status} already")
        await batches.runner.cancel(batch_id)
        return _answer(request, 200, "done", f"{batch_id} is cancelling")
