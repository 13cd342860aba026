"""The OpenAI Responses routes: ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``.

Thin: decode and validate (:mod:`mlxd.api.responses.schema`), look up
``previous_response_id`` in the in-memory store, then run through the same
:func:`mlxd.api.generate.generate` path as chat completions, rendered by
:mod:`mlxd.api.responses.render`.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, MediaType, Request, Response, delete, get, post
from litestar.params import FromPath
from litestar.response import Stream

from mlxd.api.answer import Output
from mlxd.api.generate import check_generation, generate
from mlxd.api.http.body import read_body
from mlxd.api.http.caller import caller_of
from mlxd.api.http.decode import decode
from mlxd.api.http.errors import OpenAIError
from mlxd.api.lease import acquire, check_accepting, released_on_error
from mlxd.api.priority import requested as requested_priority
from mlxd.api.responses import compaction
from mlxd.api.responses.render import ResponsesOutput
from mlxd.api.responses.schema import ResponsesRequest, responses_request
from mlxd.api.responses.store import owner_of
from mlxd.api.state import AppState, Mlxd
from mlxd.engine import Accepted, CacheLookup


def _not_found(rid: str, *, status: int, param: str | None = None) -> OpenAIError:
    return OpenAIError(
        status,
        f"No stored response with id '{rid}' for this API key: it was never stored "
        "(store=false), belongs to another key, expired ([responses] ttl), was evicted "
        "([responses] max_stored, max_bytes) or the server restarted.",
        code="previous_response_not_found" if param else "response_not_found",
        param=param,
    )


def _owner(request: Request) -> str | None:
    """Who a stored response belongs to: the request's API key (hashed), None without keys."""
    return owner_of(caller_of(request.scope).owner)


class ResponsesController(Controller):
    """``/v1/responses``: create, retrieve and delete."""

    path = "/responses"

    @post("/", status_code=200)
    async def create(self, request: Request, mlxd: Mlxd) -> Response[Any] | Stream:
        return await _create(request, mlxd)

    @post("/compact", status_code=200)
    async def compact(self, request: Request, mlxd: Mlxd) -> Response[Any] | Stream:
        return await _create(request, mlxd, compact=True)

    @get("/{response_id:str}")
    async def retrieve(
        self, request: Request, mlxd: Mlxd, response_id: FromPath[str]
    ) -> Response[bytes]:
        stored = mlxd.responses.get(response_id, owner=_owner(request))
        if stored is None:
            raise _not_found(response_id, status=404)
        return Response(stored.body, media_type=MediaType.JSON)

    @delete("/{response_id:str}", status_code=200)
    async def remove(
        self, request: Request, mlxd: Mlxd, response_id: FromPath[str]
    ) -> dict[str, Any]:
        if not mlxd.responses.delete(response_id, owner=_owner(request)):
            raise _not_found(response_id, status=404)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


async def _create(
    request: Request, state: AppState, *, compact: bool = False
) -> Response[Any] | Stream:
    check_accepting(state)
    settings = state.settings
    body = await read_body(request, settings.limits.max_body_bytes)
    req = decode(body, ResponsesRequest)
    owner = _owner(request)
    # Compaction (docs/agents.md): capsules expanded, a trigger made a summary row.
    capsules = compaction.capsules_in(settings.server.state_dir)
    key = caller_of(request.scope).owner
    if compact:
        trigger = [{"type": "compaction_trigger"}]
        given = req.input if isinstance(req.input, list) else []
        if isinstance(req.input, str):
            given = [{"role": "user", "content": req.input}]
        req = msgspec.structs.replace(req, input=[*given, *trigger], stream=False, store=False)
    expanded, summarize = compaction.prepare(req.input, capsules, key)
    req = msgspec.structs.replace(req, input=expanded)
    previous: tuple[dict, ...] = ()
    if req.previous_response_id is not None:
        stored = state.responses.get(req.previous_response_id, owner=owner)
        if stored is None:
            raise _not_found(req.previous_response_id, status=400, param="previous_response_id")
        previous = stored.messages()
    asked = requested_priority(req)
    lease = await acquire(state, req.model, request=request)
    with released_on_error(lease):
        call = responses_request(
            req, lease.settings, previous, faults=state.fault_injection, info=lease.info
        )
        await check_generation(
            state, lease, call.gen, json_param="text.format", tools_param="tool_choice"
        )

    # A Batch API line is never stored: thousands of them would evict every interactive
    # user's stored responses (docs/batches.md).
    storing = call.store and caller_of(request.scope).stores_responses

    def keep(response: dict[str, Any], turn: dict[str, Any]) -> None:
        # A warm-up has no turn to continue; a summary row's is its capsule.
        if storing and call.generate and not summarize:
            state.responses.put(call.gen.id, response, (*call.history, turn), owner=owner)

    def make_output(accepted: Accepted, _lookup: CacheLookup) -> Output:
        if summarize:
            kind = compaction.CompactOutput if compact else compaction.CompactionOutput
            seal = lambda summary: capsules.seal(summary, key)  # noqa: E731
            return kind(call.gen.id, accepted.model, call.echo, seal)
        return ResponsesOutput(
            call.gen.id, accepted.model, call.echo, keep, warm_up=not call.generate
        )

    return await generate(
        request, state, lease, call.gen, make_output, stream=call.stream, asked=asked
    )
