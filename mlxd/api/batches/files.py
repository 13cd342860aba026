"""``/v1/files``: upload, list, retrieve, read and delete the Batch API's files.

Uploads (``purpose = "batch"``) are checked line by line before they are kept
(:mod:`mlxd.api.batches.jsonl`): a bad file is a 400 naming its first bad
line and nothing is stored. Results (``batch_output``) are written by the
runner. Each file belongs to the API key that created it: another key gets
404, as for a file that does not exist.
"""

from __future__ import annotations

import asyncio
import time
from typing import IO, Any

from litestar import Controller, Request, Response, delete, get, post
from litestar.params import FromPath, FromQuery
from litestar.response import File as FileResponse

from mlxd.api.batches.jsonl import BadLine, check_lines
from mlxd.api.batches.service import BatchService, owner, service
from mlxd.api.batches.store import FileRow, new_id
from mlxd.api.batches.upload import read_upload
from mlxd.api.http.errors import OpenAIError
from mlxd.api.lease import check_accepting
from mlxd.api.state import Mlxd

PURPOSES = ("batch",)
RESULT_PURPOSES = ("batch_output",)


def file_json(row: FileRow) -> dict[str, Any]:
    """A file as OpenAI's File object."""
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": row.created_at,
        "expires_at": None,
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "status_details": None,
    }


def not_found(file_id: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"No file with id '{file_id[:80]}' for this API key.",
        code="file_not_found",
        param="file_id",
    )


async def find_file(batches: BatchService, request: Request, file_id: str) -> FileRow:
    row = await batches.store.call(batches.store.get_file, file_id)
    if row is None or row.owner != owner(request):
        raise not_found(file_id)
    return row


def page_limit(value: int | None, default: int, top: int) -> int:
    """A list route's ``limit``: ``default`` when absent, else 1 to ``top`` (else 400)."""
    if value is None:
        return default
    if not 1 <= value <= top:
        raise OpenAIError(
            400, f"'limit' must be between 1 and {top}.", code="invalid_value", param="limit"
        )
    return value


def list_page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """One page of a list route, as OpenAI's SDK pages it (``after`` = ``last_id``)."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


class FilesController(Controller):
    """``/v1/files``."""

    path = "/files"

    @post("/", status_code=200)
    async def create(self, request: Request, mlxd: Mlxd) -> dict[str, Any]:
        check_accepting(mlxd)
        batches = service(mlxd)
        limits = mlxd.settings.batches
        upload = await read_upload(
            request, batches.store.files_dir, limits.max_file_bytes, limits.upload_timeout
        )
        try:
            purpose = upload.fields.get("purpose")
            if purpose not in PURPOSES:
                raise OpenAIError(
                    400,
                    f"'purpose' must be one of {', '.join(PURPOSES)} (got {str(purpose)[:40]!r}).",
                    code="invalid_value",
                    param="purpose",
                )
            if upload.file is None:
                raise OpenAIError(
                    400, "The form has no 'file' part.", code="missing_required", param="file"
                )
            if await batches.store.call(batches.store.file_count) >= limits.max_files:
                raise OpenAIError(
                    400,
                    f"This server keeps at most {limits.max_files} files (batches.max_files); "
                    "delete some first.",
                    code="too_many_files",
                )
            file_id = new_id("file-")
            lines = await asyncio.to_thread(
                _keep, batches, file_id, upload.file, mlxd.settings.limits.max_body_bytes, limits
            )
        finally:
            if upload.file is not None:
                upload.file.close()
        size, digest, count = lines
        row = FileRow(
            id=file_id,
            owner=owner(request),
            purpose="batch",
            filename=upload.filename,
            bytes=size,
            lines=count,
            sha256=digest,
            created_at=int(time.time()),
        )
        await batches.store.call(batches.store.add_file, row)
        return file_json(row)

    @get("/")
    async def list_files(
        self,
        request: Request,
        mlxd: Mlxd,
        purpose: FromQuery[str | None] = None,
        limit: FromQuery[int | None] = None,
        after: FromQuery[str | None] = None,
        order: FromQuery[str] = "desc",
    ) -> dict[str, Any]:
        batches = service(mlxd)
        if order not in ("asc", "desc"):
            raise OpenAIError(
                400, "'order' must be 'asc' or 'desc'.", code="invalid_value", param="order"
            )
        count = page_limit(limit, 10_000, 10_000)
        rows = await batches.store.call(
            batches.store.list_files, owner(request), purpose, after, count + 1, order
        )
        return list_page([file_json(r) for r in rows[:count]], len(rows) > count)

    @get("/{file_id:str}")
    async def retrieve(self, request: Request, mlxd: Mlxd, file_id: FromPath[str]) -> dict:
        return file_json(await find_file(service(mlxd), request, file_id))

    @get("/{file_id:str}/content")
    async def content(self, request: Request, mlxd: Mlxd, file_id: FromPath[str]) -> Response:
        batches = service(mlxd)
        row = await find_file(batches, request, file_id)
        path = batches.store.file_path(row.id)
        if not batches.store.has_file(row.id):
            raise OpenAIError(
                500,
                f"The body of file '{row.id}' is missing from the server's state directory.",
                code="file_missing",
            )
        return FileResponse(
            path=path,
            filename=row.filename,
            media_type="application/jsonl",
            content_disposition_type="attachment",
        )

    @delete("/{file_id:str}", status_code=200)
    async def remove(self, request: Request, mlxd: Mlxd, file_id: FromPath[str]) -> dict:
        batches = service(mlxd)
        row = await find_file(batches, request, file_id)
        if batches.runner.uses_file(row.id):
            raise OpenAIError(
                409,
                f"File '{row.id}' is the input of a batch that has not finished; cancel it first.",
                code="file_in_use",
                param="file_id",
            )
        await batches.store.call(batches.store.delete_file, row.id)
        return {"id": row.id, "object": "file", "deleted": True}


def _keep(
    batches: BatchService, file_id: str, spooled: IO[bytes], max_line_bytes: int, limits: Any
) -> tuple[int, str, int]:
    """Check the spooled upload line by line and keep it (on a worker thread): size, sha, lines."""
    spooled.seek(0)
    count = 0

    def checked() -> Any:
        nonlocal count
        for raw, url in check_lines(
            spooled, max_lines=limits.max_lines, max_line_bytes=max_line_bytes
        ):
            count += bool(url)
            yield raw

    try:
        size, digest = batches.store.write_file(file_id, checked())
    except BadLine as exc:
        batches.store.file_path(file_id).unlink(missing_ok=True)
        raise OpenAIError(400, str(exc), code="invalid_file", param="file") from None
    if count == 0:
        batches.store.file_path(file_id).unlink(missing_ok=True)
        raise OpenAIError(400, "The file has no request lines.", code="invalid_file", param="file")
    return size, digest, count
