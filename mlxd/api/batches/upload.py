"""``POST /v1/files``'s body: a multipart upload streamed to disk under size and time limits.

The request guard lets this one route's multipart body through unread
(:mod:`mlxd.api.http.guard`); here it is read chunk by chunk under
``[batches] max_file_bytes`` (413 as soon as it is known) and
``upload_timeout`` (408), and fed to python-multipart's streaming parser,
which spools the file part to a temporary file: nothing holds the whole
upload in memory. The form must carry ``purpose`` and one ``file`` part.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from litestar import Request
from python_multipart import FormParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header

from mlxd.api.http.errors import OpenAIError

# Form fields other than the file are small (purpose, expires_after[...]).
_MAX_FIELD_BYTES = 4096


@dataclass
class Upload:
    """What the form carried: its text fields, and the file spooled to disk."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str = "upload.jsonl"
    file: IO[bytes] | None = None
    files: int = 0


def _bad(message: str, param: str | None = None, code: str = "invalid_request") -> OpenAIError:
    return OpenAIError(400, message, code=code, param=param)


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"The upload is {size} bytes or more; this server accepts files of at most {limit} "
        "bytes (batches.max_file_bytes).",
        code="file_too_large",
        headers={"Connection": "close"},
    )


async def read_upload(request: Request, spool: Path, limit: int, timeout: float) -> Upload:
    """Stream ``request``'s multipart body into an :class:`Upload` (400, 408, 413)."""
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or b"boundary" not in params:
        raise _bad(
            "Upload a file as multipart/form-data with the fields 'file' and 'purpose'.",
            code="unsupported_media_type",
        )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    upload = Upload()
    oversized: list[str] = []

    def on_field(f: Any) -> None:
        name = (f.field_name or b"").decode("utf-8", "replace")
        value = f.value or b""
        if len(value) > _MAX_FIELD_BYTES:
            oversized.append(name)
            return
        upload.fields[name] = value.decode("utf-8", "replace")

    def on_file(f: Any) -> None:
        upload.files += 1
        if (f.field_name or b"") != b"file" or upload.file is not None:
            f.close()
            return
        if f.file_name:
            upload.filename = f.file_name.decode("utf-8", "replace")[:255]
        f.flush_to_disk()
        upload.file = f.file_object

    parser = FormParser(
        "multipart/form-data",
        on_field,
        on_file,
        boundary=params[b"boundary"],
        config={
            "UPLOAD_DIR": str(spool),
            "MAX_MEMORY_FILE_SIZE": 1 << 16,
            "MAX_BODY_SIZE": limit,
        },
    )
    size = 0
    deadline = time.monotonic() + timeout
    stream = request.stream().__aiter__()
    try:
        while True:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                chunk = await asyncio.wait_for(stream.__anext__(), left)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise OpenAIError(
                    408,
                    f"The upload did not arrive within {timeout:g} s ({size} bytes received; "
                    "batches.upload_timeout).",
                    code="request_timeout",
                    headers={"Connection": "close"},
                ) from None
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            parser.write(chunk)
        parser.finalize()
    except (FormParserError, ValueError) as exc:
        _discard(upload)
        raise _bad(f"The multipart body is malformed: {str(exc)[:200]}") from None
    except BaseException:
        _discard(upload)
        raise
    if oversized:
        _discard(upload)
        raise _bad(f"The form field {oversized[0][:40]!r} is too long.", param=oversized[0][:40])
    return upload


def _discard(upload: Upload) -> None:
    if upload.file is not None:
        upload.file.close()
        upload.file = None
