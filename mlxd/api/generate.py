"""The one generation path every API shares: route, check, submit, accept, answer or stream.

Chat completions, completions, Responses and Messages differ only in how they
read a body and how they render events (their :class:`~mlxd.api.answer.Output`).
Everything between is here: the fleet lends the model
(:func:`mlxd.api.lease.acquire`), the request's values and grammar are checked
before anything is queued (:func:`check_generation`), :func:`generate` builds
the engine request as its :class:`~mlxd.api.http.caller.Caller`, submits it,
waits until the engine accepts and admits or refuses it, then answers whole or
as SSE (:mod:`mlxd.api.answer`), and a client that goes away cancels its
generation at the next token.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from litestar import Request, Response
from litestar.response import Stream

from mlxd.api import params
from mlxd.api.answer import Done, Output, streamed, whole
from mlxd.api.forced_tool import force_tool_call
from mlxd.api.grammar import prepare_off_loop
from mlxd.api.http.caller import Caller, caller_of
from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.requestlog import Note, note_of
from mlxd.api.image_fetch import fetch_images
from mlxd.api.lease import is_anthropic
from mlxd.api.lookup import PROMPT_CACHE_HEADER, PROMPT_RULES_HEADER, header_value
from mlxd.api.priority import effective as effective_priority
from mlxd.api.prompt_rules import apply_prompt_rules
from mlxd.api.state import AppState
from mlxd.engine import (
    Accepted,
    CacheLookup,
    Failed,
    Finished,
    GenerationRequest,
    IntakeError,
    LaneDecision,
    ModelInfo,
    RequestHandle,
    check_request,
)

if TYPE_CHECKING:
    from mlxd.engine import Lease

# The number of tools left out of a request to a model that cannot call tools.
TOOLS_IGNORED_HEADER = "X-Mlxd-Tools-Ignored"
MAX_TOKENS_HEADER = "X-Mlxd-Max-Tokens"  # a max_tokens above [limits] max_tokens, clamped


async def check_generation(
    state: AppState, lease: Lease, gen: GenerationRequest, *, json_param: str, tools_param: str
) -> None:
    """All that is checked before ``gen`` is queued: its values, then its grammar (400s)."""
    check_values(lease.info, gen)
    await warm_constraint(state, lease, gen, json_param=json_param, tools_param=tools_param)


def check_values(info: ModelInfo | None, gen: GenerationRequest) -> None:
    """Token ids and prompt size against the served model, before anything is queued."""
    if info is None:
        return
    try:
        check_request(gen, info)
    except IntakeError as exc:
        param = prompt_param(gen, exc.param)
        err = OpenAIError(400, str(exc), code=exc.code, param=param)
        raise worded(gen, err, info) from None


async def warm_constraint(
    state: AppState, lease: Lease, gen: GenerationRequest, *, json_param: str, tools_param: str
) -> None:
    """Check and compile a request's grammar off the event loop before it is queued (400s)."""
    constraint = gen.constraint
    if constraint is None:
        return
    warmed = await prepare_off_loop(
        lease.engine,
        constraint,
        param=json_param if constraint.kind == "json" else tools_param,
        budget=state.settings.limits.grammar_timeout,
    )
    if warmed is not None:
        for observe in state.compile_observers:
            observe(*warmed)


# What each API calls the prompt, where the engine says "messages" (chat's name).
_PROMPT_PARAMS = {"responses": "input"}


def prompt_param(gen: GenerationRequest, param: str | None) -> str | None:
    """The engine's ``param`` as ``gen``'s API names it (the prompt is ``input`` in Responses)."""
    if param == "messages":
        return _PROMPT_PARAMS.get(gen.api, param)
    return param


_TOO_LONG = re.compile(
    r"maximum context length is (\d+) tokens\. However, your prompt is (\d+) (tokens|characters)"
)


def worded(gen: GenerationRequest, err: OpenAIError, info: ModelInfo | None) -> OpenAIError:
    """``err`` in the words its API's clients parse.

    Claude Code compacts its conversation only on Anthropic's own wording of
    a context overflow, ``prompt is too long: N tokens > M maximum`` (M: the
    longest prompt that leaves room for one token).
    """
    if gen.api != "messages" or err.code != "context_length_exceeded":
        return err
    found = _TOO_LONG.search(err.message)
    if found is None:
        return err
    ctx, size, unit = int(found[1]), int(found[2]), found[3]
    if unit == "characters":  # refused before tokenizing: at least this many tokens
        per_token = info.max_token_chars if info is not None and info.max_token_chars else 1
        size = max(ctx, -(-size // per_token))
    err.message = f"prompt is too long: {size} tokens > {ctx - 1} maximum"
    return err


def refusal(gen: GenerationRequest, failed: Failed, info: ModelInfo | None = None) -> OpenAIError:
    """The engine's refusal or failure of ``gen`` as an error of its API."""
    err = OpenAIError.from_failed(failed)
    err.param = prompt_param(gen, err.param)
    return worded(gen, err, info)


async def generate(
    request: Request,
    state: AppState,
    lease: Lease,
    gen: GenerationRequest,
    make_output: Callable[[Accepted, CacheLookup], Output],
    *,
    stream: bool,
    headers: dict[str, str] | None = None,
    asked: str | None = None,
) -> Response[Any] | Stream:
    """Submit ``gen``, wait until the engine admits it, then answer whole or as SSE.

    Every API goes through here: same lanes, admission, queue (429 with
    ``Retry-After``), stop handling, metrics observers and disconnect
    cancellation. A refusal or a failure raises :class:`OpenAIError`, which
    the route's router renders in its API's error envelope. ``lease`` is
    released when the answer is complete (a stream's last byte).

    The response starts once the request has left the queue, when its
    prompt-cache lookup is known: every answer, streamed or not, carries
    ``X-Mlxd-Prompt-Cache`` (docs/api.md), and a request that fails while it
    waits gets its error status, not an SSE error after a 200.

    The request runs as its :class:`~mlxd.api.http.caller.Caller` (its API
    key's name, at the priority class it ``asked`` for, never above its
    key's: :mod:`mlxd.api.priority`); its tokens count against the key's
    ``tokens_per_minute`` when it ends, unless it is a Batch API line.
    """
    caller = caller_of(request.scope)
    note = note_of(request.scope)
    try:
        gen = await _prepared(state, lease, _as_caller(gen, caller, asked, note))
        submission = _Submission(request, lease, gen)
    except BaseException:
        lease.release()
        raise
    try:
        accepted, lookup = await _admitted(state, lease, gen, submission, note)
        output = make_output(accepted, lookup)
        headers = _headers(request, state, caller, gen, accepted, lookup, headers)
        done = _ending(state, caller, note, accepted)
        if stream:
            keepalive = state.settings.server.stream_keepalive
            return streamed(
                submission.handle, output, done, lease, note, keepalive=keepalive, headers=headers
            )
        return await whole(
            submission.handle, output, done, lambda f: refusal(gen, f, lease.info), headers
        )
    except BaseException:
        submission.handle.cancel()
        lease.release()
        raise
    finally:
        submission.unwatch()  # a stream listens for disconnects itself
        if not stream:
            lease.release()


def _as_caller(
    gen: GenerationRequest, caller: Caller, asked: str | None, note: Note
) -> GenerationRequest:
    """``gen`` run as ``caller``: its key's name, the class it ``asked`` for under its ceiling.

    A Batch API line runs in the idle-time ``batch`` class (docs/batches.md).
    """
    gen = replace(
        gen, client=caller.key, priority=effective_priority(gen.priority, caller.priority, asked)
    )
    if caller.who is not None or gen.priority != "normal":  # without keys the line stays as it was
        note.priority = gen.priority
    return gen


async def _prepared(state: AppState, lease: Lease, gen: GenerationRequest) -> GenerationRequest:
    """``gen`` as it is submitted: remote images fetched, prompt rules applied."""
    gen = await fetch_images(gen, lease.settings)  # remote images, when fetch_images is on
    gen = apply_prompt_rules(gen, lease.settings.prompt_cache.volatile_rules)
    forced = force_tool_call(gen, lease.info, enabled=state.fault_injection)
    if forced is not gen:  # test-only (MLXD_FORCE_TOOL_CALL): compile its grammar
        await warm_constraint(state, lease, forced, json_param="", tools_param="tool_choice")
        gen = forced
    return gen


async def _watch_disconnect(request: Request, handle: RequestHandle) -> None:
    """Cancel ``handle`` when the client goes away (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


class _Submission:
    """``gen`` submitted to ``lease``'s engine, cancelled if the client goes away."""

    def __init__(self, request: Request, lease: Lease, gen: GenerationRequest) -> None:
        self._request, self._lease, self._gen = request, lease, gen
        self._submit()

    def again(self) -> None:
        """Submit the request once more (the engine refused the first for want of room)."""
        self._watcher.cancel()
        self._submit()

    def _submit(self) -> None:
        self.handle = self._lease.engine.submit(self._gen)
        self._watcher = asyncio.create_task(_watch_disconnect(self._request, self.handle))

    def unwatch(self) -> None:
        self._watcher.cancel()


def _short_of_room(accepted: Accepted | Failed) -> bool:
    return isinstance(accepted, Failed) and accepted.code == "context_over_budget"


async def _admitted(
    state: AppState, lease: Lease, gen: GenerationRequest, submission: _Submission, note: Note
) -> tuple[Accepted, CacheLookup]:
    """Wait until the engine accepts the request and it leaves the queue; a refusal raises."""
    accepted = await submission.handle.accepted()
    # Short of KV room because other models' reservations fill [memory] budget:
    # the fleet unloads an idle one and the request is tried again (docs/batching.md).
    while _short_of_room(accepted) and await state.fleet.make_kv_room(lease.id):
        submission.again()
        accepted = await submission.handle.accepted()
    if isinstance(accepted, Failed):
        raise refusal(gen, accepted, lease.info)
    note.accepted(accepted, gen.prompt_rules)
    note.tools_ignored = gen.tools_ignored or None
    admitted = await submission.handle.admitted()
    if isinstance(admitted, Failed):
        note.ended(admitted)
        state.observe(accepted, admitted)
        raise refusal(gen, admitted, lease.info)
    note.admitted(admitted.lookup)
    return accepted, admitted.lookup


def _headers(
    request: Request,
    state: AppState,
    caller: Caller,
    gen: GenerationRequest,
    accepted: Accepted,
    lookup: CacheLookup,
    extra: dict[str, str] | None,
) -> dict[str, str]:
    """The answer's headers: the route's, the key's quotas, the lane, the id, the cache."""
    headers = {
        **(extra or {}),
        **state.quotas.headers(caller.who, anthropic=is_anthropic(request)),
        "X-Mlxd-Lane": LaneDecision(accepted.lane, accepted.reason).header,
        "X-Request-Id": gen.id,
        PROMPT_CACHE_HEADER: header_value(lookup),
    }
    if gen.prompt_rules:
        headers[PROMPT_RULES_HEADER] = ",".join(gen.prompt_rules)
    if gen.tools_ignored:
        headers[TOOLS_IGNORED_HEADER] = str(gen.tools_ignored)
    if gen.max_tokens_asked is not None and gen.max_tokens is not None:
        headers[MAX_TOKENS_HEADER] = params.max_tokens_header(gen.max_tokens, gen.max_tokens_asked)
    return headers


def _ending(state: AppState, caller: Caller, note: Note, accepted: Accepted) -> Done:
    """What runs once when the request ends: its key's tokens, the log line, the metrics."""

    def done(outcome: Finished | Failed) -> None:
        if isinstance(outcome, Finished):
            usage = outcome.usage
            tokens = usage.prompt_tokens + usage.completion_tokens
            if caller.spends_quota:
                state.quotas.spend(caller.who, tokens)
            else:  # a Batch API line: in the key's totals, not its quotas
                state.quotas.count_outside(caller.who, tokens=tokens)
        note.ended(outcome)
        state.observe(accepted, outcome)

    return done
