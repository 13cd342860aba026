"""Download jobs: pulls an admin started, each on its own thread, kept across restarts.

:class:`Downloads` holds the jobs of one daemon. A job checks the fit first
(the caller's check, against the budget and what is loaded, from the hub's
listing), then pulls (:func:`mlxd.hub.pull`), reporting bytes, speed and
ETA as it goes; it can be cancelled, and what it fetched stays in the cache
for the next pull. The jobs are written to ``downloads.json`` under the
state directory (atomically: a temporary file renamed over it), so a
restarted daemon lists a job that was running as ``interrupted`` and
resumable: pulling that model again resumes it.

Thread-safe: routes call it on the event loop, jobs update it from their
threads, under one lock.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mlxd.hub.cache import HubPlace
from mlxd.hub.download import Cancelled, Progress, pull
from mlxd.hub.fit import FitVerdict
from mlxd.hub.listing import HubError, Listing, fetch_listing

logger = logging.getLogger(__name__)

STATES = ("running", "done", "failed", "cancelled", "interrupted")
# Jobs kept (the newest); finished ones beyond this are forgotten.
KEEP = 50
# Progress is written to disk at most this often (every state change is written at once).
SAVE_EVERY_S = 2.0

FitCheck = Callable[[Listing], FitVerdict]


@dataclass
class Job:
    """One download, as ``GET /admin/downloads`` lists it."""

    id: str
    model: str
    repo: str
    revision: str
    state: str = "running"
    phase: str = "checking"  # checking (the listing and the fit) | downloading | finished
    bytes_done: int = 0
    bytes_total: int = 0
    files_done: int = 0
    files_total: int = 0
    speed: float = 0.0
    eta: float | None = None
    fit: str | None = None
    fits: bool | None = None
    error: str | None = None
    path: str | None = None
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None

    @property
    def resumable(self) -> bool:
        return self.state in ("cancelled", "failed", "interrupted") and self.bytes_done > 0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "resumable": self.resumable}


class Downloads:
    """Every download job of this daemon; see the module docstring."""

    def __init__(
        self,
        state_dir: Path | None,
        *,
        place: HubPlace | None = None,
        on_done: Callable[[Job], None] | None = None,
    ):
        self._file = state_dir / "downloads.json" if state_dir is not None else None
        self._place = place or HubPlace()
        self.on_done = on_done
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}
        self._cancels: dict[str, threading.Event] = {}
        self._saved_at = 0.0
        self._load()

    # ------------------------------------------------------------ reading

    def jobs(self) -> list[dict[str, Any]]:
        """Every job, newest first."""
        with self._lock:
            return [j.as_dict() for j in sorted(self._jobs.values(), key=lambda j: -j.started_at)]

    def get(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            job = self._jobs.get(job_id)
            return job.as_dict() if job else None

    def latest(self, model_id: str) -> dict[str, Any] | None:
        """The newest job of ``model_id``, if any."""
        return next((j for j in self.jobs() if j["model"] == model_id), None)

    # ------------------------------------------------------------ commands

    def start(
        self, model_id: str, repo: str, revision: str, *, fit: FitCheck | None, force: bool
    ) -> tuple[dict[str, Any], bool]:
        """Start pulling ``repo`` for ``model_id``; (the job, whether it is new).

        A job already running for the same repo and revision is returned as it is.
        """
        with self._lock:
            for job in self._jobs.values():
                if job.state == "running" and (job.repo, job.revision) == (repo, revision):
                    return job.as_dict(), False
            job = Job(uuid.uuid4().hex[:12], model_id, repo, revision)
            self._jobs[job.id] = job
            cancel = self._cancels[job.id] = threading.Event()
            self._trim()
        self._save(force=True)
        thread = threading.Thread(
            target=self._run, args=(job, cancel, fit, force), name=f"mlxd-pull-{job.id}"
        )
        thread.daemon = True
        thread.start()
        return job.as_dict(), True

    def cancel(self, job_id: str) -> dict[str, Any] | None:
        """Ask a running job to stop (it ends as ``cancelled``); None for an unknown id."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            event = self._cancels.get(job_id)
            if job.state == "running" and event is not None:
                event.set()
            return job.as_dict()

    def stop(self) -> None:
        """Cancel every running job (the daemon stops); they are resumable after a restart."""
        with self._lock:
            events = list(self._cancels.values())
        for event in events:
            event.set()

    # ------------------------------------------------------------ the job's thread

    def _run(self, job: Job, cancel: threading.Event, fit: FitCheck | None, force: bool) -> None:
        try:
            listing = fetch_listing(job.repo, job.revision, self._place)
            verdict = fit(listing) if fit is not None else None
            with self._lock:
                job.bytes_total, job.files_total = listing.total_bytes, len(listing.sizes)
                if verdict is not None:
                    job.fit, job.fits = verdict.message, verdict.fits
            if verdict is not None and not verdict.fits and not force:
                raise HubError(f"{job.repo}: {verdict.message} (download anyway: force)")
            with self._lock:
                job.phase = "downloading"
            self._save(force=True)
            path = pull(
                job.repo,
                job.revision,
                place=self._place,
                listing=listing,
                on_progress=lambda p: self._progress(job, p),
                cancel=cancel,
            )
        except Cancelled:
            self._finish(job, "cancelled", None)
        except HubError as exc:
            self._finish(job, "failed", str(exc))
        except Exception as exc:  # a bug, reported on the job rather than lost on a thread
            logger.exception("download of %s failed", job.repo)
            self._finish(job, "failed", f"{job.repo}: {type(exc).__name__}: {exc}")
        else:
            with self._lock:
                job.path = str(path)
            self._finish(job, "done", None)

    def _progress(self, job: Job, p: Progress) -> None:
        with self._lock:
            job.bytes_done, job.bytes_total = p.bytes_done, p.bytes_total
            job.files_done, job.files_total = p.files_done, p.files_total
            job.speed, job.eta = p.speed, p.eta
        self._save()

    def _finish(self, job: Job, state: str, error: str | None) -> None:
        with self._lock:
            job.state, job.error, job.phase = state, error, "finished"
            job.speed, job.eta = 0.0, None
            job.finished_at = time.time()
            self._cancels.pop(job.id, None)
        self._save(force=True)
        logger.info(
            "download of %s (%s) %s%s", job.repo, job.model, state, f": {error}" if error else ""
        )
        if self.on_done is not None:
            self.on_done(job)

    # ------------------------------------------------------------ the file

    def _trim(self) -> None:
        done = sorted(
            (j for j in self._jobs.values() if j.state != "running"), key=lambda j: j.started_at
        )
        for job in done[: max(0, len(self._jobs) - KEEP)]:
            del self._jobs[job.id]

    def _load(self) -> None:
        if self._file is None or not self._file.is_file():
            return
        try:
            rows = json.loads(self._file.read_text(encoding="utf-8"))["jobs"]
            jobs = [Job(**{k: v for k, v in r.items() if k != "resumable"}) for r in rows]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring unreadable %s: %s", self._file, exc)
            return
        for job in jobs:
            if job.state == "running":  # the process that ran it stopped
                job.state, job.phase, job.speed, job.eta = "interrupted", "finished", 0.0, None
                job.error = "the daemon stopped during the download; pull again to resume"
            self._jobs[job.id] = job

    def _save(self, *, force: bool = False) -> None:
        if self._file is None:
            return
        now = time.monotonic()
        with self._lock:
            if not force and now - self._saved_at < SAVE_EVERY_S:
                return
            self._saved_at = now
            text = json.dumps({"jobs": [j.as_dict() for j in self._jobs.values()]}, indent=1)
            # Under the lock: an older snapshot never lands over a newer one.
            try:
                self._file.parent.mkdir(parents=True, exist_ok=True)
                tmp = self._file.with_name(f".{self._file.name}.{os.getpid()}.tmp")
                tmp.write_text(text, encoding="utf-8")
                os.replace(tmp, self._file)
            except OSError as exc:
                logger.warning("cannot write %s: %s", self._file, exc)
