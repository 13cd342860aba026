"""The models panel's download buttons: Download (after the fit check) and Cancel.

``POST /dashboard/downloads/start`` takes the form field ``model`` (and
``force=true`` to download what the fit check refused); ``POST
/dashboard/downloads/cancel`` the field ``job``. The rules are the model
buttons' (:mod:`mlxd.dashboard.model_actions`): admin access, a same-origin
browser, the CSRF token. The work is ``/admin``'s
(:mod:`mlxd.api.ops.downloads`); an htmx request gets the result line and
the panel, fresh, as an out-of-band swap, where the job's progress bar then
moves with the panel's poll.
"""

from __future__ import annotations

from litestar import Controller, Request, Response, post
from litestar.exceptions import PermissionDeniedException

from mlxd.api.http.errors import OpenAIError
from mlxd.api.ops.downloads import service
from mlxd.api.state import AppState, Mlxd
from mlxd.dashboard.model_actions import (
    MAX_FORM_BYTES,
    MAX_ID_CHARS,
    TRUE,
    _answer,
    _on_csrf,
    _on_refused,
    actions_guard,
)
from mlxd.dashboard.refused import DashboardRefused


async def _form(request: Request, field: str) -> tuple[str, dict[str, str]]:
    form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
    value = form.get(field, "").strip()
    if not value:
        raise DashboardRefused(400, f"the form names no {field} (field {field!r})")
    if len(value) > MAX_ID_CHARS:
        raise DashboardRefused(400, f"a {field} is at most {MAX_ID_CHARS} characters")
    return value, form


def _refused(exc: OpenAIError) -> DashboardRefused:
    return DashboardRefused(exc.status, exc.message)


class DownloadActionsController(Controller):
    path = "/dashboard/downloads"
    guards = [actions_guard]
    exception_handlers = {DashboardRefused: _on_refused, PermissionDeniedException: _on_csrf}
    request_max_body_size = MAX_FORM_BYTES

    @post("/start", status_code=200)
    async def start(self, request: Request, mlxd: Mlxd) -> Response[str]:
        """Start downloading a repo model: the fit check first, then its files."""
        model_id, form = await _form(request, "model")
        force = form.get("force", "").strip().lower() in TRUE
        try:
            job, new = service(mlxd).start(model_id, force=force)
        except OpenAIError as exc:
            raise _refused(exc) from None
        what = "started" if new else "already running"
        return _answer(request, 200, "done", f"download of {job['repo']} {what}")

    @post("/cancel", status_code=200)
    async def cancel(self, request: Request, mlxd: Mlxd) -> Response[str]:
        """Cancel a running download (what it fetched stays; Download resumes it)."""
        job_id, _ = await _form(request, "job")
        state: AppState = mlxd
        try:
            job = service(state).jobs.cancel(job_id)
        except OpenAIError as exc:
            raise _refused(exc) from None
        if job is None:
            raise DashboardRefused(404, f"no download job {job_id[:40]!r}")
        return _answer(request, 200, "done", f"download of {job['repo']} cancelled")
