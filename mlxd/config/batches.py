"""``[batches]``: the Batch API's files and the idle-time lane its lines run on."""

from __future__ import annotations

import re

from pydantic import field_validator

from mlxd.config.sections import Section, _field
from mlxd.config.units import Bytes

_HOURS = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)-([01]\d|2[0-3]):([0-5]\d)$")


class BatchesSettings(Section):
    """The Batch API (docs/batches.md): its files, and the idle-time lane its lines run on."""

    max_file_bytes: Bytes = _field(
        "100MiB", "live", "Largest file POST /v1/files accepts; larger gets 413."
    )
    max_lines: int = _field(
        50_000, "live", "Most request lines one batch input file may hold; more gets 400.", ge=1
    )
    upload_timeout: float = _field(
        300.0, "live", "Seconds a client may take to upload one file; then 408.", gt=0
    )
    max_rows: int | None = _field(
        None,
        "live",
        "Rows of a chat model's batch that batch lines may hold at once; default: all but "
        "one (an interactive request always finds a free row).",
        ge=1,
    )
    hours: str | None = _field(
        None,
        "live",
        'Local time window batch lines may run in ("22:00-07:00"); default: any time.',
    )
    max_files: int = _field(
        10_000, "live", "Files (uploads and batch results) kept at most; more gets 400.", ge=1
    )

    @field_validator("hours")
    @classmethod
    def _check_hours(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip()
        match = _HOURS.match(value)
        if match is None:
            raise ValueError('use "HH:MM-HH:MM" in 24-hour local time, e.g. "22:00-07:00"')
        if value[:5] == value[6:]:
            raise ValueError("the window is empty: its start and end are the same time")
        return value
