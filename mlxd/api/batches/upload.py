"""``POST /v1/files``'s body: a multipart upload streamed to disk under size and time limits.

The request guard lets this one route's multipart body through unread
(:mod:`mlxd.api.http.guard`); here it is read chunk by chunk under
``[batches] max_file_bytes`` (413 as soon as it is known) and
``upload_timeout`` (408), and fed to python-multipart's streaming parser.
The file part goes straight to an anonymous temporary file in the spool
folder (``tempfile.TemporaryFile``: on Linux it never has a name, elsewhere
it loses it at once), so nothing holds the whole upload in memory, and
nothing is left behind: closing it (on an error, a disconnect, a cancel, or
once the file is kept) frees it at once, and a process killed mid-upload
leaves no file either. A client that leaves mid-upload is logged 499. The
form must carry ``purpose`` and one ``file`` part.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from litestar import Request
from litestar.exceptions import InternalServerException
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.requestlog import note_of

if TYPE_CHECKING:  # python-multipart defines it for type checkers only
    from python_multipart.multipart import MultipartCallbacks

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


class _Form:
    """python-multipart's part callbacks: text fields kept, the ``file`` part spooled."""

    def __init__(self, upload: Upload, spool: Path):
        self.upload = upload
        self.spool = spool
        self.oversized: list[str] = []
        self._header = [b"", b""]
        self._headers: dict[bytes, bytes] = {}
        self._kind = "skip"
        self._name = ""
        self._value = bytearray()

    def callbacks(self) -> MultipartCallbacks:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda d, a, b: self._add_header(0, d[a:b]),
            "on_header_value": lambda d, a, b: self._add_header(1, d[a:b]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._data,
            "on_part_end": self._end,
        }

    def _begin(self) -> None:
        self._headers = {}
        self._header = [b"", b""]

    def _add_header(self, which: int, data: bytes) -> None:
        if len(self._header[which]) + len(data) > _MAX_FIELD_BYTES:
            raise FormParserError("a part header is too long")
        self._header[which] += data

    def _header_end(self) -> None:
        self._headers[self._header[0].lower()] = self._header[1]
        self._header = [b"", b""]

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        filename = options.get(b"filename")
        self._value = bytearray()
        if filename is None:
            self._kind = "field"
            return
        upload = self.upload
        upload.files += 1
        if self._name != "file" or upload.file is not None:
            self._kind = "skip"
            return
        upload.filename = filename.decode("utf-8", "replace")[:255] or upload.filename
        # Closed by read_upload on an error, else by its caller once the file is kept.
        upload.file = tempfile.TemporaryFile(dir=self.spool)  # noqa: SIM115
        self._kind = "file"

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._kind == "file":
            assert self.upload.file is not None
            self.upload.file.write(data[start:end])
        elif self._kind == "field" and len(self._value) <= _MAX_FIELD_BYTES:
            self._value += data[start:end]

    def _end(self) -> None:
        if self._kind != "field":
            return
        if len(self._value) > _MAX_FIELD_BYTES:
            self.oversized.append(self._name)
        else:
            self.upload.fields[self._name] = self._value.decode("utf-8", "replace")


async def read_upload(request: Request, spool: Path, limit: int, timeout: float) -> Upload:
    """Stream ``request``'s multipart body into an :class:`Upload` (400, 408, 413, 499).

    The caller closes ``Upload.file`` (which frees it); on any error here it
    is closed before this raises.
    """
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
    form = _Form(upload, spool)
    parser = MultipartParser(params[b"boundary"], form.callbacks(), max_size=limit)
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
            except InternalServerException:  # Litestar's word for http.disconnect
                note = note_of(request.scope)
                note.status, note.error = 499, "cancelled"
                raise OpenAIError(
                    499,
                    f"The client closed the connection during the upload ({size} bytes received).",
                    code="cancelled",
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
    if form.oversized:
        _discard(upload)
        name = form.oversized[0][:40]
        raise _bad(f"The form field {name!r} is too long.", param=name)
    if upload.file is not None:
        upload.file.flush()
    return upload


def _discard(upload: Upload) -> None:
    if upload.file is not None:
        upload.file.close()
        upload.file = None
