"""The speech-to-text routes' multipart form, parsed and checked (400s in OpenAI's shape).

The request guard has read the body under ``[limits] audio_bytes``
(:func:`mlxd.api.http.guard.audio_body_limit`); here it is parsed in memory by
python-multipart into OpenAI's fields: ``file`` (required), ``model``,
``language``, ``prompt``, ``response_format`` (json, the default, text,
srt, vtt, verbose_json), ``temperature`` (0 to 1), ``timestamp_granularities[]``
(segment, word; only with verbose_json) and ``stream`` (json or text only,
as OpenAI's streamed transcripts). Every value is
checked here; an unknown field is refused or ignored by ``[server]
unknown_parameters`` like the JSON routes' fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from python_multipart import FormParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header

from mlxd.api.http.errors import OpenAIError
from mlxd.engine import TRANSCRIPT_FORMATS, TRANSCRIPT_GRANULARITIES

# Form fields other than the file are short (a prompt is the longest).
MAX_FIELD_BYTES = 16_384

KNOWN = frozenset(
    {
        "file",
        "model",
        "language",
        "prompt",
        "response_format",
        "temperature",
        "timestamp_granularities",
        "timestamp_granularities[]",
        "stream",
        "user",
        "include[]",
        "chunking_strategy",
    }
)

_LANGUAGE = re.compile(r"^[a-z]{2,3}$")


@dataclass
class AudioForm:
    """The checked form of one transcription or translation request."""

    file: bytes = b""
    filename: str = ""
    model: str = ""
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0
    granularities: list[str] = field(default_factory=list)
    stream: bool = False
    unknown: list[str] = field(default_factory=list)


def _bad(
    message: str, param: str | None, code: str = "invalid_value", status: int = 400
) -> OpenAIError:
    return OpenAIError(status, message, code=code, param=param)


def _raw(body: bytes, content_type: str) -> tuple[dict[str, list[str]], list[tuple[str, bytes]]]:
    """The form's text fields (each name's values) and its files (name, bytes)."""
    kind, params = parse_options_header(content_type)
    if kind != b"multipart/form-data" or b"boundary" not in params:
        raise _bad(
            "Send the audio as multipart/form-data with a 'file' field (as OpenAI's clients do).",
            "file",
            code="unsupported_media_type",
            status=415,
        )
    fields: dict[str, list[str]] = {}
    files: list[tuple[str, bytes, str]] = []
    oversized: list[str] = []

    def on_field(f: Any) -> None:
        name = (f.field_name or b"").decode("utf-8", "replace")
        value = f.value or b""
        if len(value) > MAX_FIELD_BYTES:
            oversized.append(name)
            return
        fields.setdefault(name, []).append(value.decode("utf-8", "replace"))

    def on_file(f: Any) -> None:
        name = (f.field_name or b"").decode("utf-8", "replace")
        f.file_object.seek(0)
        files.append((name, f.file_object.read(), (f.file_name or b"").decode("utf-8", "replace")))
        f.close()

    parser = FormParser(
        "multipart/form-data",
        on_field,
        on_file,
        boundary=params[b"boundary"],
        config={"MAX_MEMORY_FILE_SIZE": len(body) + 1, "MAX_BODY_SIZE": len(body) + 1},
    )
    try:
        parser.write(body)
        parser.finalize()
    except (FormParserError, ValueError) as exc:
        raise _bad(f"The multipart body is malformed: {str(exc)[:200]}", None) from None
    if oversized:
        name = oversized[0][:40]
        raise _bad(f"The form field {name!r} is longer than {MAX_FIELD_BYTES} bytes.", name)
    # A file part named like a text field (a client may send fields as files): its text.
    uploads: list[tuple[str, bytes]] = []
    for name, data, filename in files:
        if name == "file":
            uploads.append((filename, data))
        elif len(data) <= MAX_FIELD_BYTES:
            fields.setdefault(name, []).append(data.decode("utf-8", "replace"))
        else:
            raise _bad(f"The form field {name[:40]!r} is too long.", name[:40])
    return fields, uploads


def _one(fields: dict[str, list[str]], name: str) -> str | None:
    values = fields.get(name)
    if not values:
        return None
    if len(values) > 1:
        raise _bad(f"The form field '{name}' is given {len(values)} times; give it once.", name)
    return values[0].strip()


def parse_form(body: bytes, content_type: str) -> AudioForm:
    """``body`` as a checked :class:`AudioForm`; 400 for anything OpenAI would refuse."""
    fields, uploads = _raw(body, content_type)
    form = AudioForm(unknown=sorted(n for n in fields if n not in KNOWN))
    if "file" in fields:
        raise _bad("'file' must be an uploaded file (a multipart file part), not text.", "file")
    if not uploads:
        raise _bad("The form has no 'file': upload the audio as the 'file' field.", "file")
    if len(uploads) > 1:
        raise _bad("The form has more than one 'file'; send one audio file per request.", "file")
    form.filename, form.file = uploads[0]
    form.model = _one(fields, "model") or ""
    language = _one(fields, "language")
    if language:
        if not _LANGUAGE.match(language):
            raise _bad(
                "'language' must be an ISO-639-1 code such as 'en' or 'de'; "
                f"got {language[:40]!r}.",
                "language",
            )
        form.language = language
    form.prompt = _one(fields, "prompt") or None
    fmt = _one(fields, "response_format") or "json"
    if fmt not in TRANSCRIPT_FORMATS:
        raise _bad(
            f"'response_format' must be one of {', '.join(TRANSCRIPT_FORMATS)}; got {fmt[:40]!r}.",
            "response_format",
        )
    form.response_format = fmt
    temperature = _one(fields, "temperature")
    if temperature:
        try:
            value = float(temperature)
        except ValueError:
            value = -1.0
        if not 0.0 <= value <= 1.0:
            raise _bad(
                f"'temperature' must be a number from 0 to 1; got {temperature[:40]!r}.",
                "temperature",
            )
        form.temperature = value
    grains = fields.get("timestamp_granularities[]", []) + fields.get("timestamp_granularities", [])
    for grain in grains:
        if grain.strip() not in TRANSCRIPT_GRANULARITIES:
            raise _bad(
                f"'timestamp_granularities[]' values must be segment or word; got {grain[:40]!r}.",
                "timestamp_granularities[]",
            )
    if grains and fmt != "verbose_json":
        raise _bad(
            "'timestamp_granularities[]' needs response_format verbose_json.",
            "timestamp_granularities[]",
        )
    form.granularities = sorted({g.strip() for g in grains})
    stream = (_one(fields, "stream") or "false").lower()
    if stream not in ("true", "false"):
        raise _bad(f"'stream' must be true or false; got {stream[:40]!r}.", "stream")
    form.stream = stream == "true"
    if form.stream and fmt not in ("json", "text"):
        raise _bad(
            f"'stream' needs response_format json or text; {fmt} is not streamed "
            "(send stream=false for it).",
            "stream",
        )
    return form
