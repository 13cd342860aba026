"""The idle-time lane: one task on the event loop that feeds batch lines to the engines.

Open batches run in creation order: a batch's lines are all handed out
before the next batch's first. Each tick the runner asks the lane rules
(:mod:`mlxd.api.batches.lane`) how much room the next line's model has and
hands out that many lines, each run through the app itself
(:mod:`mlxd.api.batches.dispatch`). A line's answer is committed to SQLite
before it counts; an answer that says "later" (429, 503) puts the line back,
and one cut short by a shutdown is not kept, so the line runs again at the
next start. A cancelled or expired batch stops handing out lines and
disconnects those in flight; when none is left, its results are written
(:mod:`mlxd.api.batches.finish`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import json
import logging
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlxd.api.batches import finish as finishing
from mlxd.api.batches.dispatch import LineAnswer, run_line
from mlxd.api.batches.jsonl import BadLine, RequestLine, request_lines
from mlxd.api.batches.lane import in_hours
from mlxd.api.batches.models import Room, room_for
from mlxd.api.batches.store import BatchRow, Store, new_id
from mlxd.api.http.caller import BatchLine, Caller
from mlxd.api.http.keys import who_by_digest

if TYPE_CHECKING:
    from mlxd.api.state import AppState

logger = logging.getLogger(__name__)

TICK_S = 0.05
# A line answered 429 or 503 this many times is kept as failed with that answer.
MAX_ATTEMPTS = 5
RETRY_AFTER_S = 1.0
FINAL = ("completed", "failed", "expired", "cancelled")


@dataclass
class Job:
    """An open batch as the runner holds it."""

    row: BatchRow
    done: set[int] = field(default_factory=set)
    completed: int = 0
    failed: int = 0
    lines: Generator[RequestLine] | None = None
    retry: collections.deque[RequestLine] = field(default_factory=collections.deque)
    next_line: RequestLine | None = None
    exhausted: bool = False
    inflight: dict[int, tuple[str, asyncio.Event]] = field(default_factory=dict)
    attempts: dict[int, int] = field(default_factory=dict)
    not_before: float = 0.0
    waiting_for: str | None = None
    last_wait: str | None = None  # the last reason logged (a reason is logged once)
    # Past its expires_at: no more lines; finished as expired once none is in flight.
    expiring: bool = False
    # Its input file became unreadable mid-run: no more lines; failed once none is in flight.
    broken: str | None = None
    # Lines finished since this process took the batch up, and since when (rate, ETA).
    session_done: int = 0
    session_start: float = field(default_factory=time.monotonic)

    @property
    def status(self) -> str:
        return self.row.status


class Runner:
    """Owns the open batches; the routes tell it of new and cancelled ones."""

    def __init__(self, state: AppState, store: Store, app: Any):
        self.state = state
        self.store = store
        self.app = app
        self.jobs: dict[str, Job] = {}
        self.wake = asyncio.Event()
        self.lines_done = 0
        self.lines_failed = 0
        self._task: asyncio.Task[None] | None = None
        self._lines: set[asyncio.Task[None]] = set()
        self._stopping = False
        # The last batches to finish (the dashboard shows them), newest last.
        self.recent: collections.deque[BatchRow] = collections.deque(maxlen=8)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Take up every batch the last process left open, then run."""
        for row in await self.store.call(self.store.open_batches):
            job = Job(row)
            if row.status in ("in_progress", "finalizing", "cancelling"):
                await self._resume(job)
            self.jobs[row.id] = job
            logger.info("batch %s: resumed %s (%d lines done)", row.id, row.status, len(job.done))
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop handing out lines; let the lines in flight keep their answers (or not)."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._lines:
            await asyncio.wait(self._lines, timeout=5)

    async def _resume(self, job: Job) -> None:
        job.done = await self.store.call(self.store.done_lines, job.row.id)
        counts = await self.store.call(self.store.counts, job.row.id)
        job.completed, job.failed = counts.completed, counts.failed

    # ------------------------------------------------------------ the routes' side

    def add(self, row: BatchRow) -> None:
        self.jobs[row.id] = Job(row)
        logger.info(
            "batch %s: created (validating) for %s, input %s",
            row.id,
            row.endpoint,
            row.input_file_id,
        )
        self.wake.set()

    def get(self, batch_id: str) -> Job | None:
        return self.jobs.get(batch_id)

    def uses_file(self, file_id: str) -> bool:
        return any(j.row.input_file_id == file_id for j in self.jobs.values())

    async def cancel(self, batch_id: str) -> None:
        job = self.jobs.get(batch_id)
        if job is None or job.status not in ("validating", "in_progress"):
            return
        await self._move(job, "cancelling", cancelling_at=int(time.time()))
        self.wake.set()

    def queued_lines(self) -> int:
        """Lines of open batches not yet answered (waiting or running)."""
        return sum(
            max(j.row.total - j.completed - j.failed, 0)
            for j in self.jobs.values()
            if j.status in ("validating", "in_progress")
        )

    def running_lines(self) -> int:
        return sum(len(j.inflight) for j in self.jobs.values())

    # ------------------------------------------------------------ the loop

    async def _run(self) -> None:
        while True:
            try:
                await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("the batch runner failed a tick; it carries on")
                await asyncio.sleep(1.0)  # a lasting fault logs once a second, not 20 times
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), TICK_S)

    async def _tick(self) -> None:
        feeding = True  # only the oldest batch with lines left is fed
        for job in list(self.jobs.values()):
            if job.status == "validating":
                await self._validate(job)
            if job.status == "in_progress" and self._expired(job) and not job.expiring:
                job.expiring = True
                logger.info("batch %s: its completion window passed; it expires", job.row.id)
            if job.status == "cancelling" or job.expiring or job.broken:
                self._disconnect(job)
                if not job.inflight:
                    await self._finish(job)
                continue
            if job.status == "finalizing":
                await self._finish(job)
                continue
            if job.status != "in_progress":
                continue
            if feeding:
                self._feed(job)
                feeding = job.exhausted
            if job.exhausted and not job.inflight and not job.retry and job.next_line is None:
                await self._move(job, "finalizing", finalizing_at=int(time.time()))
                await self._finish(job)

    def _expired(self, job: Job) -> bool:
        return job.row.expires_at is not None and time.time() >= job.row.expires_at

    def _next(self, job: Job) -> RequestLine | None:
        if job.next_line is not None:
            return job.next_line
        if job.retry and time.monotonic() >= job.not_before:
            job.next_line = job.retry.popleft()
            return job.next_line
        if job.exhausted:
            return None
        if job.lines is None:
            job.lines = self._read(job)
        try:
            for line in job.lines:
                if line.index not in job.done and line.index not in job.inflight:
                    job.next_line = line
                    return line
        except (BadLine, OSError) as exc:
            job.broken = f"The input file became unreadable while the batch ran: {exc}"
            logger.warning("batch %s: %s", job.row.id, job.broken)
        job.exhausted = True
        return None

    def _read(self, job: Job) -> Generator[RequestLine]:
        with self.store.open_file(job.row.input_file_id) as f:
            yield from request_lines(f)

    def _feed(self, job: Job) -> None:
        settings = self.state.settings
        if self.state.shutting_down or self._stopping:
            job.waiting_for = "the server is shutting down"
            return
        now = dt.datetime.now().time()
        if not in_hours(settings.batches.hours, now):
            job.waiting_for = f"outside [batches] hours ({settings.batches.hours})"
            return
        job.waiting_for = None
        mine = self._mine()
        while True:
            line = self._next(job)
            if line is None:
                return
            room: Room = room_for(self.state.fleet, line, mine, settings.batches.max_rows)
            if room.lines <= 0:
                if room.logged and room.reason != job.last_wait:
                    logger.info("batch %s waits: %s", job.row.id, room.reason)
                job.waiting_for = job.last_wait = room.reason
                return
            job.next_line = None
            mine[room.key] = mine.get(room.key, 0) + 1
            self._start_line(job, line, room.key)

    def _mine(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for job in self.jobs.values():
            for key, _ in job.inflight.values():
                counts[key] = counts.get(key, 0) + 1
        return counts

    def _start_line(self, job: Job, line: RequestLine, key: str) -> None:
        cancel = asyncio.Event()
        job.inflight[line.index] = (key, cancel)
        task = asyncio.create_task(self._line(job, line, cancel))
        self._lines.add(task)
        task.add_done_callback(self._lines.discard)

    def _disconnect(self, job: Job) -> None:
        for _, cancel in job.inflight.values():
            cancel.set()

    # ------------------------------------------------------------ one line

    async def _line(self, job: Job, line: RequestLine, cancel: asyncio.Event) -> None:
        # The line runs as the key that created the batch, as it is configured now
        # (a key removed since: no identity, and the line gets the guard's 401).
        who = who_by_digest(job.row.owner, self.state.settings)
        caller = Caller(who, BatchLine(job.row.id, line.custom_id))
        try:
            try:
                answer = await run_line(self.app, line.url, line.body, caller, cancel)
            except Exception as exc:  # the app answers errors itself; this is a bug
                logger.exception("batch %s line %d: the app raised", job.row.id, line.index + 1)
                answer = LineAnswer(
                    500,
                    {"error": {"message": str(exc)[:200], "type": "server_error", "code": None}},
                    None,
                )
            if cancel.is_set():
                return  # cancelled or expired: the line is not answered
            if not 200 <= answer.status < 300 and (self.state.shutting_down or self._stopping):
                return  # cut short by the shutdown: it runs again at the next start
            if answer.status in (429, 503):
                tries = job.attempts.get(line.index, 0) + 1
                job.attempts[line.index] = tries
                if tries < MAX_ATTEMPTS:
                    job.retry.append(line)
                    job.not_before = time.monotonic() + RETRY_AFTER_S
                    return
            await self._keep(job, line, answer)
        finally:
            job.inflight.pop(line.index, None)
            self.wake.set()

    async def _keep(self, job: Job, line: RequestLine, answer: LineAnswer) -> None:
        ok = 200 <= answer.status < 300
        record = {
            "id": new_id("batch_req_"),
            "custom_id": line.custom_id,
            "response": {
                "status_code": answer.status,
                "request_id": answer.request_id,
                "body": answer.body,
            },
            "error": None,
        }
        body = json.dumps(record, ensure_ascii=False)
        added = await self.store.call(self.store.add_result, job.row.id, line.index, ok, body)
        if not added:
            return
        job.done.add(line.index)
        job.session_done += 1
        if ok:
            job.completed += 1
            self.lines_done += 1
        else:
            job.failed += 1
            self.lines_failed += 1

    # ------------------------------------------------------------ states

    async def _validate(self, job: Job) -> None:
        result = await self.store.call(finishing.validate, self.store, job.row)
        if result.errors is not None:
            errors = {"object": "list", "data": result.errors}
            await self._move(job, "failed", failed_at=int(time.time()), errors=errors)
            self.jobs.pop(job.row.id, None)
            self.recent.append(job.row)
            return
        await self.store.call(self.store.update_batch, job.row.id, total=result.total)
        await self._move(job, "in_progress", in_progress_at=int(time.time()))
        job.session_start = time.monotonic()

    async def _move(self, job: Job, status: str, **stamps: Any) -> None:
        await self.store.call(self.store.update_batch, job.row.id, status=status, **stamps)
        previous = job.row.status
        job.row = await self.store.call(self.store.get_batch, job.row.id) or job.row
        logger.info(
            "batch %s: %s -> %s (%d of %d lines done, %d failed)",
            job.row.id,
            previous,
            status,
            job.completed + job.failed,
            job.row.total,
            job.failed,
        )

    async def _finish(self, job: Job) -> None:
        final = "cancelled" if job.status == "cancelling" else "completed"
        if job.expiring:
            final = "expired"
        if job.broken:
            final = "failed"
            errors = {"object": "list", "data": [_broken(job.broken)]}
            await self.store.call(self.store.update_batch, job.row.id, errors=errors)
        stamp = f"{final}_at"
        reason = "The batch expired before this line ran (completion_window)."
        previous = job.row.status
        if job.lines is not None:
            job.lines.close()  # its input file
        await self.store.call(finishing.finish, self.store, job.row, final, stamp, reason)
        job.row = await self.store.call(self.store.get_batch, job.row.id) or job.row
        self.jobs.pop(job.row.id, None)
        self.recent.append(job.row)
        logger.info(
            "batch %s: %s -> %s (%d completed, %d failed; output %s, errors %s)",
            job.row.id,
            previous,
            final,
            job.row.completed,
            job.row.failed,
            job.row.output_file_id,
            job.row.error_file_id,
        )


def _broken(message: str) -> dict[str, Any]:
    return {"code": "file_corrupt", "message": message, "param": None, "line": None}
