"""Downloads from the hub on an admin's word: ``/admin/models/{id}/pull`` and ``/admin/downloads``.

A ``repo =`` model that is not in the Hugging Face cache is downloaded only
when an admin asks (these routes, the dashboard's Download button) or, with
``[server] downloads = true``, at start. A job checks the fit first, against
``[memory] budget`` and what is loaded now, and refuses a model that does not
fit before any weight byte moves (``force`` downloads it anyway); when it is
done the model loads as configured (a pinned model at once, another on its
next request). The jobs live in :class:`mlxd.hub.jobs.Downloads`; this module
wires them to the fleet and serves them. Same guard as ``/admin/reload``:
admin access and same-origin.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath, FromQuery

from mlxd.api.http.errors import OpenAIError
from mlxd.api.ops.admin import admin_guard
from mlxd.api.state import AppState, Mlxd
from mlxd.config import Settings, format_bytes
from mlxd.config.registry import for_model, registry
from mlxd.engine import Failed
from mlxd.hub import FitVerdict, HubPlace, Listing, fit_verdict, kv_bytes_per_token, repo_dir
from mlxd.hub.fit import context_length
from mlxd.hub.jobs import Downloads, Job

logger = logging.getLogger(__name__)

# How long "is this repo in the cache" is remembered for /stats and the dashboard.
PULLED_TTL_S = 2.0
MAX_BODY_BYTES = 4096


class DownloadService:
    """The daemon's download jobs, tied to its fleet and event loop."""

    def __init__(self, state: AppState, place: HubPlace | None = None):
        self._state = state
        self._place = place  # None: huggingface_hub's own (the HF_* variables)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pulled: dict[tuple[str, str], tuple[float, bool]] = {}
        self.jobs = Downloads(state.settings.server.state_path, place=place, on_done=self._done)

    # ------------------------------------------------------------ what the views read

    def pulled(self, repo: str, revision: str) -> bool:
        """Whether ``repo`` at ``revision`` is complete in the cache (remembered briefly)."""
        key, now = (repo, revision), time.monotonic()
        known = self._pulled.get(key)
        if known is None or now - known[0] > PULLED_TTL_S:
            known = (now, repo_dir(repo, revision, self._place) is not None)
            self._pulled[key] = known
        return known[1]

    def annotate(self, models: list[dict[str, Any]]) -> None:
        """Add ``pulled`` to each model of ``/stats`` ``fleet``, and its latest job if any."""
        for model in models:
            repo = model.get("repo")
            model["pulled"] = self.pulled(repo, model.get("revision") or "main") if repo else None
            job = self.jobs.latest(model["id"]) if repo else None
            if job is not None:
                model["download"] = job

    # ------------------------------------------------------------ commands

    def start(self, model_id: str, *, force: bool) -> tuple[dict[str, Any], bool]:
        """Start pulling ``model_id``'s repo; raises OpenAIError for a model with none."""
        settings = self._state.settings
        entry = registry(settings).get(model_id)
        if entry is None:
            known = ", ".join(registry(settings)) or "none"
            raise OpenAIError(
                404,
                f"no model {model_id[:80]!r} is configured (configured: {known})",
                code="not_found",
            )
        if entry.repo is None:
            where = "a local directory (path)" if entry.path else "the built-in demo model"
            raise OpenAIError(
                400,
                f"'{model_id}' is {where}, not a hub repo: nothing to download",
                code="not_a_repo",
            )
        self._loop = asyncio.get_running_loop()
        self._pulled.pop((entry.repo, entry.repo_revision), None)
        return self.jobs.start(
            model_id, entry.repo, entry.repo_revision, fit=self._fit_check(model_id), force=force
        )

    def autostart(self, only: set[str] | None = None) -> None:
        """``[server] downloads = true``: pull every configured repo the cache lacks
        (of the ids in ``only``, when given)."""
        settings = self._state.settings
        if not settings.server.downloads:
            return
        for model_id, entry in registry(settings).items():
            if only is not None and model_id not in only:
                continue
            if entry.repo is not None and not self.pulled(entry.repo, entry.repo_revision):
                logger.info("[server] downloads: pulling %s for %s", entry.repo, model_id)
                self.start(model_id, force=False)

    def reloaded(self, old: Settings) -> None:
        """A reload applied (``old``: the settings before it): ``[server] downloads``
        turned on pulls what the cache lacks, as at start; left on, the models the
        reload added or pointed at another repo (a job cancelled or refused before is
        not started again)."""
        if old.server.downloads:
            before = registry(old)
            fresh = {
                i
                for i, e in registry(self._state.settings).items()
                if i not in before
                or (e.repo, e.repo_revision) != (before[i].repo, before[i].repo_revision)
            }
            self.autostart(fresh)
        else:
            self.autostart()

    def on_load_failed(self, model_id: str | None, failed: Failed) -> Failed:
        """A request's model failed to load: with ``[server] downloads = true`` and its repo
        not in the cache, pull it (one job) and say so; otherwise ``failed`` as it is."""
        settings = self._state.settings
        entry = registry(settings).get(model_id or "")
        if not settings.server.downloads or entry is None or entry.repo is None:
            return failed
        if self.pulled(entry.repo, entry.repo_revision):
            return failed
        job, _ = self.start(model_id or "", force=False)
        if job["state"] != "running":
            return failed
        total = job["bytes_total"]
        done = f" ({100 * job['bytes_done'] // total}% of {format_bytes(total)})" if total else ""
        return Failed(
            "model_load_failed",
            f"The model '{model_id}' is being downloaded from the hub ({entry.repo}){done}; "
            "retry when it is done ([server] downloads = true).",
            503,
            retry_after=10,
        )

    def _fit_check(self, model_id: str) -> Any:
        """The fit check a job runs on the listing: numbers read now, on the event loop."""
        view = self._state.fleet.status()
        others = sum(
            m.reserved_bytes + m.kv_bytes
            for m in view.models
            if m.id != model_id and m.state in ("loaded", "loading")
        )
        own = for_model(self._state.settings, model_id)
        kind = registry(self._state.settings)[model_id].kind
        reserve = own.prompt_cache.max_bytes if kind == "chat" else 0
        budget, max_context = view.budget_bytes, own.model.max_context
        kv_bits, kv_group = own.batch.kv_bits, own.batch.kv_group_size  # the KV as it will load

        def check(listing: Listing) -> FitVerdict:
            return fit_verdict(
                weights=listing.weights_bytes,
                kv_per_token=kv_bytes_per_token(listing.config, kv_bits, kv_group),
                budget=budget,
                others=others,
                reserve=reserve,
                max_context=max_context or context_length(listing.config),
            )

        return check

    def _done(self, job: Job) -> None:
        """On the job's thread: a finished download loads as configured (on the loop)."""
        if job.state != "done" or self._loop is None:
            return
        self._pulled.clear()
        with contextlib.suppress(RuntimeError):  # the loop closed: the daemon stopped
            self._loop.call_soon_threadsafe(self._state.fleet.downloaded, job.model)


def service(mlxd: AppState) -> DownloadService:
    found = getattr(mlxd, "downloads", None)
    if not isinstance(found, DownloadService):
        raise OpenAIError(503, "downloads are not available in this server", code="unavailable")
    return found


class PullBody(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    force: bool = False


def _force(value: str | None) -> bool:
    if value is None:
        return False
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise OpenAIError(400, f"force must be true or false, not {value[:20]!r}", param="force")


def _accepted(job: dict[str, Any], new: bool) -> Response[dict[str, Any]]:
    return Response({**job, "new": new}, status_code=202)


class DownloadsController(Controller):
    path = "/admin"
    guards = [admin_guard]
    request_max_body_size = MAX_BODY_BYTES

    @post("/models/{model_id:str}/pull", status_code=202)
    async def pull_model(
        self, model_id: FromPath[str], mlxd: Mlxd, force: FromQuery[str | None] = None
    ) -> Response[dict[str, Any]]:
        """Start downloading a configured repo model (``?force=true`` past the fit check)."""
        return _accepted(*service(mlxd).start(model_id, force=_force(force)))

    @post("/downloads", status_code=202)
    async def pull_body(self, request: Request, mlxd: Mlxd) -> Response[dict[str, Any]]:
        """The same, the model named in a JSON body (ids that hold a ``/``)."""
        try:
            body = msgspec.json.decode(await request.body(), type=PullBody)
        except msgspec.ValidationError as exc:
            raise OpenAIError(400, f"invalid body: {exc}", code="invalid_request") from None
        except msgspec.DecodeError:
            raise OpenAIError(
                400, 'the body must be JSON: {"model": "<id>"}', code="invalid_request"
            ) from None
        return _accepted(*service(mlxd).start(body.model, force=body.force))

    @get("/downloads")
    async def list_jobs(self, mlxd: Mlxd) -> dict[str, Any]:
        """Every download job, newest first."""
        return {"object": "list", "data": service(mlxd).jobs.jobs()}

    @get("/downloads/{job_id:str}")
    async def one_job(self, job_id: FromPath[str], mlxd: Mlxd) -> dict[str, Any]:
        job = service(mlxd).jobs.get(job_id)
        if job is None:
            raise OpenAIError(404, f"no download job {job_id[:40]!r}", code="not_found")
        return job

    @post("/downloads/{job_id:str}/cancel", status_code=200)
    async def cancel_job(self, job_id: FromPath[str], mlxd: Mlxd) -> dict[str, Any]:
        """Stop a running job; what it fetched stays, and pulling again resumes."""
        job = service(mlxd).jobs.cancel(job_id)
        if job is None:
            raise OpenAIError(404, f"no download job {job_id[:40]!r}", code="not_found")
        return job
