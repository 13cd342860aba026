"""``/v1/batches``: create, retrieve, list and cancel batches (OpenAI's Batch API).

A batch is created ``validating`` and moves, on the runner's loop, through
``in_progress`` and ``finalizing`` to ``completed`` (or ``failed``,
``cancelling``/``cancelled``, ``expired``), as OpenAI defines them. Each
batch belongs to the API key that created it; another key gets 404.
"""

from __future__ import annotations

import re
import time
from typing import Any

import msgspec
from litestar import Controller, Request, get, post
from litestar.params import FromPath, FromQuery

from mlxd.api import params
from mlxd.api.batches.files import find_file, list_page, page_limit
from mlxd.api.batches.jsonl import ENDPOINTS, FILE_ENDPOINTS, endpoint_refusal
from mlxd.api.batches.service import BatchService, owner, service
from mlxd.api.batches.store import BatchRow, new_id
from mlxd.api.http.body import read_body
from mlxd.api.http.decode import decode
from mlxd.api.http.errors import OpenAIError
from mlxd.api.lease import check_accepting
from mlxd.api.state import Mlxd

_WINDOW = re.compile(r"^([1-9]\d{0,3})h$")
MAX_WINDOW_H = 24 * 30


class BatchRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    # OpenAI's expiry of the result files: accepted; mlxd keeps them until deleted.
    output_expires_after: dict[str, Any] | None = None


def window_seconds(window: str) -> int:
    """``completion_window`` ("24h"; up to 720h) in seconds; 400 otherwise."""
    match = _WINDOW.match(window)
    if match is None or int(match.group(1)) > MAX_WINDOW_H:
        raise OpenAIError(
            400,
            f"'completion_window' must be a number of hours such as \"24h\" (at most "
            f"{MAX_WINDOW_H}h); got {window[:20]!r}.",
            code="invalid_value",
            param="completion_window",
        )
    return int(match.group(1)) * 3600


def batch_json(batches: BatchService, row: BatchRow) -> dict[str, Any]:
    """A batch as OpenAI's Batch object."""
    completed, failed = batches.counts(row)
    out: dict[str, Any] = {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "errors": row.errors,
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "created_at": row.created_at,
    }
    for key in (
        "in_progress_at",
        "expires_at",
        "finalizing_at",
        "completed_at",
        "failed_at",
        "expired_at",
        "cancelling_at",
        "cancelled_at",
    ):
        out[key] = getattr(row, key)
    out["request_counts"] = {"total": row.total, "completed": completed, "failed": failed}
    out["metadata"] = row.metadata
    return out


def _not_found(batch_id: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"No batch with id '{batch_id[:80]}' for this API key.",
        code="batch_not_found",
        param="batch_id",
    )


async def _find(batches: BatchService, request: Request, batch_id: str) -> BatchRow:
    job = batches.runner.get(batch_id)
    row = job.row if job is not None else None
    if row is None:
        row = await batches.store.call(batches.store.get_batch, batch_id)
    if row is None or row.owner != owner(request):
        raise _not_found(batch_id)
    return row


class BatchesController(Controller):
    """``/v1/batches``."""

    path = "/batches"

    @post("/", status_code=200)
    async def create(self, request: Request, mlxd: Mlxd) -> dict[str, Any]:
        check_accepting(mlxd)
        batches = service(mlxd)
        body = await read_body(request, mlxd.settings.limits.max_body_bytes)
        req = decode(body, BatchRequest)
        if req.endpoint not in ENDPOINTS:
            refused = endpoint_refusal(req.endpoint, "'endpoint'")
            if req.endpoint not in FILE_ENDPOINTS:
                refused = (
                    f"'endpoint' must be one of {', '.join(ENDPOINTS)}; got {req.endpoint[:60]!r}."
                )
            raise OpenAIError(400, str(refused), code="invalid_value", param="endpoint")
        window = window_seconds(req.completion_window)
        params.metadata(req.metadata)
        try:
            source = await find_file(batches, request, req.input_file_id)
        except OpenAIError as exc:
            exc.param = "input_file_id"
            raise
        if source.purpose != "batch":
            raise OpenAIError(
                400,
                f"File '{source.id}' has purpose '{source.purpose}'; a batch's input needs "
                "purpose 'batch'.",
                code="invalid_value",
                param="input_file_id",
            )
        now = int(time.time())
        row = BatchRow(
            id=new_id("batch_"),
            owner=owner(request),
            endpoint=req.endpoint,
            input_file_id=source.id,
            completion_window=req.completion_window,
            status="validating",
            metadata=req.metadata,
            errors=None,
            output_file_id=None,
            error_file_id=None,
            total=source.lines,
            completed=0,
            failed=0,
            created_at=now,
            expires_at=now + window,
            in_progress_at=None,
            finalizing_at=None,
            completed_at=None,
            failed_at=None,
            expired_at=None,
            cancelling_at=None,
            cancelled_at=None,
        )
        await batches.store.call(batches.store.add_batch, row)
        batches.runner.add(row)
        return batch_json(batches, row)

    @get("/")
    async def list_batches(
        self,
        request: Request,
        mlxd: Mlxd,
        after: FromQuery[str | None] = None,
        limit: FromQuery[int | None] = None,
    ) -> dict[str, Any]:
        batches = service(mlxd)
        count = page_limit(limit, 20, 100)
        rows = await batches.store.call(
            batches.store.list_batches, owner(request), after, count + 1
        )
        data = [batch_json(batches, _live(batches, r)) for r in rows[:count]]
        return list_page(data, len(rows) > count)

    @get("/{batch_id:str}")
    async def retrieve(self, request: Request, mlxd: Mlxd, batch_id: FromPath[str]) -> dict:
        batches = service(mlxd)
        return batch_json(batches, await _find(batches, request, batch_id))

    @post("/{batch_id:str}/cancel", status_code=200)
    async def cancel(self, request: Request, mlxd: Mlxd, batch_id: FromPath[str]) -> dict:
        batches = service(mlxd)
        row = await _find(batches, request, batch_id)
        if row.status not in _UNCANCELLABLE:
            await batches.runner.cancel(row.id)
            row = await _find(batches, request, batch_id)
        if row.status in _UNCANCELLABLE:  # also when it moved on before the cancel took
            raise OpenAIError(
                409,
                f"Cannot cancel a batch with status '{row.status}': "
                + (
                    "every line is answered and its result files are being written."
                    if row.status == "finalizing"
                    else "only a batch that has not finished can be cancelled."
                ),
                code="batch_not_cancellable",
            )
        return batch_json(batches, row)


# A finalizing batch has every line answered; it ends completed (OpenAI refuses its cancel too).
_UNCANCELLABLE = ("finalizing", "completed", "failed", "expired")


def _live(batches: BatchService, row: BatchRow) -> BatchRow:
    job = batches.runner.get(row.id)
    return job.row if job is not None else row
