"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``: OpenAI's speech-to-text.

The multipart form (:mod:`mlxd.api.openai.audio_form`) is checked, the file
decoded to 16 kHz mono (:func:`mlxd.engine.decode_audio`, under ``[limits]
audio_bytes`` and ``audio_seconds``), and the samples transcribed by the named
(else the default) ``kind = "transcription"`` model's engine, held through the
usual lease (keys' ``models``, quotas, loading under ``[memory] budget``).
A translation is Whisper's ``translate`` task: the speech in English.

The answer is ``response_format``: ``json`` (``{"text"}``, the default, as
OpenAI has it), ``text``, ``srt``, ``vtt`` or ``verbose_json``. With
``stream=true`` the answer is OpenAI's transcript stream (server-sent events
``transcript.text.delta``, one per segment, then ``transcript.text.done``);
the deltas come once the whole upload is transcribed, not as it decodes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from litestar import Controller, Request, Response, post
from litestar.response import Stream

from mlxd.api.http.body import read_body
from mlxd.api.http.decode import IGNORED_HEADER, ignored_header
from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.guard import audio_body_limit
from mlxd.api.http.requestlog import note_of
from mlxd.api.lease import check_accepting, held
from mlxd.api.openai.audio_form import AudioForm, parse_form
from mlxd.api.state import AppState, Mlxd
from mlxd.engine import (
    AudioError,
    Failed,
    Transcript,
    TranscriptionJob,
    decode_audio,
    render_transcript,
)


class AudioController(Controller):
    """``/v1/audio/transcriptions`` and ``/v1/audio/translations`` under the API router."""

    path = "/audio"

    @post("/transcriptions", status_code=200)
    async def transcriptions(self, request: Request, mlxd: Mlxd) -> Response[Any]:
        return await serve_audio(request, mlxd, "transcribe")

    @post("/translations", status_code=200)
    async def translations(self, request: Request, mlxd: Mlxd) -> Response[Any]:
        return await serve_audio(request, mlxd, "translate")


def _unknown(form: AudioForm, policy: str) -> dict[str, str]:
    """Unknown form fields under ``[server] unknown_parameters``: 400, or a header."""
    if not form.unknown:
        return {}
    if policy != "ignore":
        name = form.unknown[0][:40]
        raise OpenAIError(
            400,
            f"Unrecognized request argument supplied: {name}",
            code="unknown_parameter",
            param=name,
        )
    return {IGNORED_HEADER: ignored_header(form.unknown)}


async def serve_audio(request: Request, state: AppState, task: str) -> Response[Any]:
    """Read, check, decode and transcribe one upload."""
    check_accepting(state)
    limits = state.settings.limits
    body = await read_body(request, audio_body_limit(limits.audio_bytes))
    form = parse_form(body, request.headers.get("content-type", ""))
    headers = _unknown(form, state.settings.server.unknown_parameters)
    note = note_of(request.scope)
    note.model = form.model
    note.inputs = 1
    try:
        decoded = await asyncio.to_thread(
            decode_audio, form.file, max_bytes=limits.audio_bytes, max_seconds=limits.audio_seconds
        )
    except AudioError as exc:
        note.error = exc.code
        raise OpenAIError(exc.status, exc.message, code=exc.code, param=exc.param) from None
    job = TranscriptionJob(
        samples=decoded.samples,
        seconds=decoded.seconds,
        task=task,
        language=form.language,
        prompt=form.prompt,
        temperature=form.temperature,
        words="word" in form.granularities,
    )
    async with held(state, form.model, "transcription", request=request) as lease:
        note.model = lease.id
        result = await asyncio.wrap_future(lease.engine.submit(job))
    if isinstance(result, Failed):
        note.error = result.code
        raise OpenAIError.from_failed(result)
    assert isinstance(result, Transcript)
    note.generated = sum(len(s.tokens) for s in result.segments)
    if form.stream:
        return Stream(_events(result), media_type="text/event-stream", headers=headers)
    content, media_type = render_transcript(result, form.response_format, form.granularities)
    return Response(content, media_type=media_type, headers=headers)


async def _events(transcript: Transcript) -> AsyncIterator[bytes]:
    """OpenAI's transcript stream: a delta per segment (or the whole text), then done."""
    pieces = [s.text for s in transcript.segments] or [transcript.text]
    for piece in pieces:
        if piece:
            yield _sse({"type": "transcript.text.delta", "delta": piece})
    yield _sse({"type": "transcript.text.done", "text": transcript.text})


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()
