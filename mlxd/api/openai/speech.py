"""``POST /v1/audio/speech``: OpenAI's text-to-speech, streamed as it is generated.

``{model, input, voice, instructions, response_format, speed, stream_format}``
is checked here (400s naming the field), then spoken by the named (else the
default) ``kind = "speech"`` model's engine (:mod:`mlxd.engine.speech`), held
through the usual lease (keys' ``models``, quotas, loading under ``[memory]
budget``). The voice is checked against the model's own once it is loaded;
the engine makes the first segment before the first byte, so a model that
cannot speak still gets an error answer; then the audio streams in
``response_format`` (chunked transfer) one generated segment at a time, or,
with ``stream_format: "sse"``, as OpenAI's ``speech.audio.delta`` events
(base64) and one ``speech.audio.done`` whose ``usage`` counts the text's
tokens read (``input_tokens``) and the audio tokens made; both count in the
key's ``tokens_per_minute`` when the speech is done. The lease is held until
the last byte; a client that leaves stops the generation at the next segment.
"""

from __future__ import annotations

import asyncio
import base64
import json
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import msgspec
from litestar import Controller, Request, Response, post
from litestar.response import Stream

from mlxd.api.http.body import read_body
from mlxd.api.http.caller import caller_of
from mlxd.api.http.decode import IGNORED_HEADER, decode_parameters
from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.requestlog import Note, note_of
from mlxd.api.lease import acquire, check_accepting, released_on_error
from mlxd.api.state import AppState, Mlxd
from mlxd.engine import (
    SPEECH_FORMATS,
    SPEECH_MEDIA_TYPES,
    EncoderUnavailable,
    Failed,
    SpeechAudio,
    SpeechDone,
    SpeechJob,
    SpeechStarted,
    check_speech_format,
    speed_refusal,
    voice_refusal,
)

STREAM_FORMATS = ("audio", "sse")
# The response header that says the audio's sample rate (pcm has no header of its own).
RATE_HEADER = "X-Mlxd-Sample-Rate"


class SpeechRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Absent or "": the default speech model.
    model: str = ""
    input: str
    # One of the model's voices; ignored (and said so) by a model that has none.
    voice: str | None = None
    # Passed to models that take them (Qwen3-TTS's instruct); else ignored, said so.
    instructions: str | None = None
    response_format: str = "mp3"
    speed: float = 1.0
    stream_format: str = "audio"


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(400, message, code="invalid_value", param=param)


def check_request(req: SpeechRequest, max_chars: int) -> None:
    """Every value of ``req`` against OpenAI's rules and ``[limits] speech_chars`` (400s)."""
    if not req.input.strip():
        raise _bad("'input' must not be empty.", "input")
    if len(req.input) > max_chars:
        raise _bad(
            f"'input' has {len(req.input)} characters; at most {max_chars} "
            "(limits.speech_chars). Split the text and send the rest in another request.",
            "input",
        )
    if req.instructions is not None and len(req.instructions) > max_chars:
        raise _bad(
            f"'instructions' has {len(req.instructions)} characters; at most {max_chars}.",
            "instructions",
        )
    if req.voice is not None and not req.voice.strip():
        raise _bad("'voice' must not be empty.", "voice")
    if req.response_format not in SPEECH_FORMATS:
        raise _bad(
            f"'response_format' must be one of {', '.join(SPEECH_FORMATS)}; "
            f"got {req.response_format[:40]!r}.",
            "response_format",
        )
    refusal = speed_refusal(req.speed)
    if refusal is not None:
        raise _bad(refusal, "speed")
    if req.stream_format not in STREAM_FORMATS:
        raise _bad(
            f"'stream_format' must be 'audio' or 'sse'; got {req.stream_format[:40]!r}.",
            "stream_format",
        )
    try:
        check_speech_format(req.response_format, req.speed)
    except EncoderUnavailable as exc:
        raise OpenAIError(
            501, str(exc), code="unsupported_format", param="response_format"
        ) from None


class SpeechController(Controller):
    """``/v1/audio/speech`` under the API router."""

    path = "/audio"

    @post("/speech", status_code=200)
    async def speech(self, request: Request, mlxd: Mlxd) -> Response[Any]:
        return await serve_speech(request, mlxd)


async def serve_speech(request: Request, state: AppState) -> Response[Any]:
    """Check, lease, start the speech; the answer streams from the engine's events."""
    check_accepting(state)
    body = await read_body(request, state.settings.limits.max_body_bytes)
    policy = state.settings.server.unknown_parameters
    req, headers = decode_parameters(body, SpeechRequest, policy, request.url.path)
    note = note_of(request.scope)
    note.model = req.model
    check_request(req, state.settings.limits.speech_chars)
    note.inputs = 1
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Any] = asyncio.Queue()

    def deliver(event: Any) -> None:  # on the engine's thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the loop closed: nobody reads any more
            job.cancelled.set()

    job = SpeechJob(
        text=req.input,
        deliver=deliver,
        voice=req.voice,
        instructions=req.instructions,
        response_format=req.response_format,
        speed=req.speed,
    )
    lease = await acquire(state, req.model, "speech", request=request)
    with released_on_error(lease):
        note.model = lease.id
        info = lease.engine.info
        # The voice against the model's own now, not after the texts queued before it.
        refusal = voice_refusal(req.voice, info.voices, lease.id) if info is not None else None
        if refusal is not None:
            note.error = "invalid_value"
            raise _bad(refusal, "voice")
        lease.engine.submit(job)
        try:
            first = await events.get()
        except BaseException:
            job.cancelled.set()
            raise
        if isinstance(first, Failed):
            note.error = first.code
            raise OpenAIError.from_failed(first)
    assert isinstance(first, SpeechStarted)
    headers[RATE_HEADER] = str(first.sample_rate)
    ignored = _ignored(req, info)
    if ignored:
        known = headers.get(IGNORED_HEADER)
        headers[IGNORED_HEADER] = ", ".join([*([known] if known else []), *ignored])
    headers["Cache-Control"] = "no-cache"
    caller = caller_of(request.scope)

    def spend(tokens: int) -> None:  # the key's tokens_per_minute, as a chat request's
        if caller.spends_quota:
            state.quotas.spend(caller.who, tokens)

    if req.stream_format == "sse":
        stream = _sse(events, note, spend)
        media_type = "text/event-stream"
    else:
        stream = _audio(events, note, spend)
        media_type = SPEECH_MEDIA_TYPES[req.response_format]
    body_out = _held(stream, job, lease.release)
    # A stream the client left before its first byte is never iterated: release then.
    weakref.finalize(body_out, lease.release)
    return Stream(body_out, media_type=media_type, headers=headers)


def _ignored(req: SpeechRequest, info: Any) -> list[str]:
    """The request's fields this model does not use (named in a response header)."""
    out: list[str] = []
    if info is None:
        return out
    if req.voice is not None and not info.voices:
        out.append("voice")
    if req.instructions and not info.takes_instructions:
        out.append("instructions")
    return out


async def _held(stream: AsyncIterator[bytes], job: SpeechJob, release: Any) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream:
            yield chunk
    finally:
        job.cancelled.set()  # a no-op once done; stops the generation if the client left
        release()


async def _audio(
    events: asyncio.Queue[Any], note: Note, spend: Callable[[int], None]
) -> AsyncIterator[bytes]:
    """The encoded audio as it comes; a failure mid-way ends it short."""
    async with aclosing(_outcomes(events, note, spend)) as outcomes:
        async for event in outcomes:
            if isinstance(event, SpeechAudio):
                yield event.data
            elif isinstance(event, SpeechDone) and event.tail:
                yield event.tail


async def _sse(
    events: asyncio.Queue[Any], note: Note, spend: Callable[[int], None]
) -> AsyncIterator[bytes]:
    """OpenAI's speech stream: ``speech.audio.delta`` per piece, then ``speech.audio.done``."""
    async with aclosing(_outcomes(events, note, spend)) as outcomes:
        async for event in outcomes:
            if isinstance(event, SpeechAudio):
                yield _event({"type": "speech.audio.delta", "audio": _b64(event.data)})
            elif isinstance(event, SpeechDone):
                if event.tail:
                    yield _event({"type": "speech.audio.delta", "audio": _b64(event.tail)})
                usage = {"input_tokens": event.input_tokens, "output_tokens": event.tokens}
                usage["total_tokens"] = event.input_tokens + event.tokens
                yield _event({"type": "speech.audio.done", "usage": usage})
            else:
                error = {"message": event.message, "type": "server_error", "code": event.code}
                yield _event({"type": "error", "error": error})


async def _outcomes(
    events: asyncio.Queue[Any], note: Note, spend: Callable[[int], None]
) -> AsyncGenerator[SpeechAudio | SpeechDone | Failed, None]:
    """The engine's events after the start, up to the last (done or failed), noted for the
    request log and, when done, its tokens spent; a client gone before the last is noted
    as cancelled."""
    ended = False
    try:
        while True:
            event = await events.get()
            if isinstance(event, SpeechDone):
                ended = True
                note.generated = event.tokens
                spend(event.input_tokens + event.tokens)
            elif isinstance(event, Failed):
                ended = True
                note.error = event.code
            elif not isinstance(event, SpeechAudio):
                continue
            yield event
            if ended:
                return
    finally:
        if not ended:
            note.cancelled(0)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _event(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()
