"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``: OpenAI's speech-to-text.

The multipart form (:mod:`mlxd.api.openai.audio_form`) is checked, the file
decoded to 16 kHz mono (:func:`mlxd.engine.decode_audio`, under ``[limits]
audio_bytes`` and ``audio_seconds``), and the samples transcribed by the named
(else the default) ``kind = "transcription"`` model's engine, held through the
usual lease (keys' ``models``, quotas, loading under ``[memory] budget``).
A translation is Whisper's ``translate`` task: the speech in English.

The answer is ``response_format``: ``json`` (``{"text"}``, the default, as
OpenAI has it), ``text``, ``srt``, ``vtt`` or ``verbose_json``. With
``stream=true`` (json or text only, else 400) the answer is OpenAI's
transcript stream: server-sent events ``transcript.text.delta`` as each
window of the upload is decoded, then one ``transcript.text.done`` whose
``text`` is the deltas joined (and what the request answers unstreamed).

A client that leaves, streamed or not, cancels its upload: the engine skips
it if it still waits, else stops before the next 30 s window (Whisper), and
the model is free for the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import weakref
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

from litestar import Controller, Request, Response, post
from litestar.response import Stream

from mlxd.api.http.body import read_body
from mlxd.api.http.decode import IGNORED_HEADER, ignored_header
from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.guard import audio_body_limit
from mlxd.api.http.requestlog import note_of
from mlxd.api.lease import acquire, check_accepting, held, released_on_error
from mlxd.api.openai.audio_form import AudioForm, parse_form
from mlxd.api.openai.render import sse_error
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
    if form.stream:
        return await _stream(request, state, form.model, job, headers)
    async with held(state, form.model, "transcription", request=request) as lease:
        note.model = lease.id
        future = lease.engine.submit(job)
        with _watched(request, job):
            result = await asyncio.wrap_future(future)
    if isinstance(result, Failed):
        if result.code == "cancelled":
            note.cancelled(0)
        else:
            note.error = result.code
        raise OpenAIError.from_failed(result)
    assert isinstance(result, Transcript)
    note.generated = sum(len(s.tokens) for s in result.segments)
    content, media_type = render_transcript(result, form.response_format, form.granularities)
    return Response(content, media_type=media_type, headers=headers)


async def _stream(
    request: Request, state: AppState, model: str, job: TranscriptionJob, headers: dict[str, str]
) -> Response[Any]:
    """OpenAI's transcript stream: the text's pieces as the engine makes them, then done.

    The engine calls ``on_text`` on its thread as each window finishes
    (:mod:`mlxd.engine.transcription.windows`); the pieces and then the
    outcome reach this loop in that order. The answer starts with the first of
    them, so a refusal (an unknown language, a failed model) is still a plain
    error response; a failure after the first piece is an ``error`` event.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str | Transcript | Failed] = asyncio.Queue()

    def put(item: str | Transcript | Failed) -> None:  # on the engine's thread
        with contextlib.suppress(RuntimeError):  # the loop has closed
            loop.call_soon_threadsafe(queue.put_nowait, item)

    note = note_of(request.scope)
    lease = await acquire(state, model, "transcription", request=request)
    with released_on_error(lease):
        note.model = lease.id
        future = lease.engine.submit(replace(job, on_text=put))
        future.add_done_callback(lambda f: put(f.result()))
        with _watched(request, job):
            first = await queue.get()
    if isinstance(first, Failed):
        lease.release()
        if first.code == "cancelled":
            note.cancelled(0)
        else:
            note.error = first.code
        raise OpenAIError.from_failed(first)

    def release(_: object = None) -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(lease.release)

    def ended() -> None:
        job.cancelled.set()  # a no-op once done; else the engine stops at its next window
        future.add_done_callback(release)  # at once when done; else when the engine is

    async def events() -> AsyncIterator[bytes]:
        item = first
        try:
            while isinstance(item, str):
                yield _sse({"type": "transcript.text.delta", "delta": item})
                item = await queue.get()
            if isinstance(item, Failed):
                note.error = item.code
                yield sse_error({"type": "error", **OpenAIError.from_failed(item).body()})
                return
            note.generated = sum(len(s.tokens) for s in item.segments)
            yield _sse({"type": "transcript.text.done", "text": item.text})
        finally:
            if not future.done():
                note.cancelled(0)
            ended()

    body = events()
    # A stream the client left before its first byte is never iterated: stop it then.
    weakref.finalize(body, ended)
    return Stream(body, media_type="text/event-stream", headers=headers)


@contextlib.contextmanager
def _watched(request: Request, job: TranscriptionJob) -> Iterator[None]:
    """While the block awaits the engine, a client that leaves sets ``job.cancelled``."""
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    try:
        yield
    finally:
        watcher.cancel()


async def _watch_disconnect(request: Request, job: TranscriptionJob) -> None:
    """Set ``job.cancelled`` when the client goes away (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancelled.set()
            return


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()
