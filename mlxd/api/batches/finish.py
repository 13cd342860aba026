"""A batch's first and last steps, on the store's thread: validating its input, writing its results.

Validation reads the input file again (it may have been damaged on disk since
the upload): its checksum, every line, and every line's ``url`` against the
batch's ``endpoint``. A failure is the batch's ``errors`` (OpenAI's list of
``{code, message, param, line}``), never an exception out of here.

Finishing writes the output file (2xx lines) and the error file (the rest,
plus, for an expired batch, each line never run), both in input order, from
the lines kept in SQLite; the files' ids derive from the batch's, so a
daemon killed while finishing writes the same files again at start.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from mlxd.api.batches.jsonl import BadLine, request_lines
from mlxd.api.batches.store import BatchRow, FileRow, Store, new_id


@dataclass(frozen=True)
class Validated:
    total: int
    errors: list[dict[str, Any]] | None  # None: the batch may run


def _error(code: str, message: str, line: int | None = None) -> list[dict[str, Any]]:
    return [{"code": code, "message": message, "param": None, "line": line}]


def validate(store: Store, batch: BatchRow) -> Validated:
    """Check ``batch``'s input file as it is on disk now."""
    row = store.get_file(batch.input_file_id)
    if row is None or not store.has_file(batch.input_file_id):
        return Validated(0, _error("file_missing", f"Input file {batch.input_file_id} is gone."))
    digest = hashlib.sha256()
    with store.open_file(batch.input_file_id) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != row.sha256:
        return Validated(
            0,
            _error(
                "file_corrupt",
                f"Input file {row.id} changed on disk since it was uploaded (its checksum "
                "differs); upload it again.",
            ),
        )
    total = 0
    try:
        with store.open_file(batch.input_file_id) as f:
            number = 0
            for line in request_lines(f):
                number = line.index + 1
                if line.url != batch.endpoint:
                    return Validated(
                        0,
                        _error(
                            "mismatched_endpoint",
                            f"Line {number} asks for {line.url}; this batch's endpoint is "
                            f"{batch.endpoint}.",
                            number,
                        ),
                    )
                total += 1
    except BadLine as exc:
        return Validated(0, _error("invalid_line", str(exc), exc.line))
    return Validated(total, None)


def result_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file: the same whenever finishing is redone."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


def finish(store: Store, batch: BatchRow, status: str, at_key: str, reason: str = "") -> None:
    """Write the result files and move ``batch`` to its final ``status`` in one transaction."""
    counts = store.counts(batch.id)
    now = int(time.time())
    files: list[FileRow] = []
    ids: dict[str, str | None] = {"output": None, "error": None}
    undone = _undone(store, batch, reason) if status == "expired" else iter(())
    failed = counts.failed
    for kind, lines in (
        ("output", store.result_bodies(batch.id, ok=True)),
        ("error", _chain(store.result_bodies(batch.id, ok=False), undone)),
    ):
        file_id = result_file_id(batch.id, kind)
        count = 0

        def counted(source: Iterable[bytes]) -> Iterator[bytes]:
            nonlocal count
            for line in source:
                count += 1
                yield line

        size, sha = store.write_file(file_id, counted(lines))
        if count == 0:
            store.file_path(file_id).unlink(missing_ok=True)
            continue
        if kind == "error":
            failed = count
        ids[kind] = file_id
        files.append(
            FileRow(
                id=file_id,
                owner=batch.owner,
                purpose="batch_output",
                filename=f"{batch.id}_{kind}.jsonl",
                bytes=size,
                lines=count,
                sha256=sha,
                created_at=now,
            )
        )
    store.finish(
        batch.id,
        files,
        status=status,
        output_file_id=ids["output"],
        error_file_id=ids["error"],
        completed=counts.completed,
        failed=failed,
        **{at_key: now},
    )


def _chain(*sources: Iterable[bytes]) -> Iterator[bytes]:
    for source in sources:
        yield from source


def _undone(store: Store, batch: BatchRow, reason: str) -> Iterator[bytes]:
    """An expired batch's lines that never ran, as error lines (OpenAI's ``batch_expired``)."""
    done = store.done_lines(batch.id)
    if not store.has_file(batch.input_file_id):
        return
    with store.open_file(batch.input_file_id) as f:
        for line in request_lines(f):
            if line.index in done:
                continue
            record = {
                "id": new_id("batch_req_"),
                "custom_id": line.custom_id,
                "response": None,
                "error": {"code": "batch_expired", "message": reason},
            }
            yield json.dumps(record).encode() + b"\n"
