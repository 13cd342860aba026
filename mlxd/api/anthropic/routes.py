"""The Anthropic Messages routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Thin: decode and validate (:mod:`mlxd.api.anthropic.schema`), then run through
the same :func:`mlxd.api.generate.generate` path as chat completions, rendered
by :mod:`mlxd.api.anthropic.render`. Keys are accepted as ``x-api-key`` or
``Authorization: Bearer``; ``anthropic-version`` and ``anthropic-beta`` are
accepted and not interpreted. :func:`messages_router` gives these routes their
own error handlers, so every error they raise is answered in Anthropic's
envelope (:mod:`mlxd.api.anthropic.errors`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Controller, Request, Response, Router, post
from litestar.response import Stream

from mlxd.api.answer import Output
from mlxd.api.anthropic.errors import ANTHROPIC
from mlxd.api.anthropic.render import MessagesOutput
from mlxd.api.anthropic.schema import (
    CountTokensRequest,
    MessagesRequest,
    count_tokens_request,
    messages_request,
)
from mlxd.api.generate import check_generation, check_values, generate
from mlxd.api.http.body import read_body
from mlxd.api.http.decode import decode
from mlxd.api.http.errors import OpenAIError, error_handlers
from mlxd.api.image_fetch import fetch_images
from mlxd.api.lease import acquire, check_accepting, held, released_on_error
from mlxd.api.priority import requested as requested_priority
from mlxd.api.prompt_rules import apply_prompt_rules
from mlxd.api.state import Mlxd
from mlxd.engine import Accepted, CacheLookup, Failed

# Under /v1 (the router that mlxd.api.app mounts): /v1/messages.
MESSAGES_PATH = "/messages"


def messages_router() -> Router:
    """The Messages routes with Anthropic's error envelope for every error they raise."""
    return Router(
        path=MESSAGES_PATH,
        route_handlers=[MessagesController],
        exception_handlers=error_handlers(ANTHROPIC),
    )


class MessagesController(Controller):
    """``/v1/messages`` and ``/v1/messages/count_tokens``."""

    path = "/"

    @post("/", status_code=200)
    async def create(self, request: Request, mlxd: Mlxd) -> Response[Any] | Stream:
        check_accepting(mlxd)
        body = await read_body(request, mlxd.settings.limits.max_body_bytes)
        req = decode(body, MessagesRequest)
        asked = requested_priority(req)
        lease = await acquire(mlxd, req.model, request=request)
        with released_on_error(lease):
            info = lease.info
            call = messages_request(req, lease.settings, faults=mlxd.fault_injection, info=info)
            await check_generation(
                mlxd, lease, call.gen, json_param="output_config.format", tools_param="tool_choice"
            )

        def make_output(accepted: Accepted, lookup: CacheLookup) -> Output:
            return MessagesOutput(
                call.gen.id, accepted.model, accepted.prompt_tokens, lookup.cached_tokens
            )

        return await generate(
            request, mlxd, lease, call.gen, make_output, stream=call.stream, asked=asked
        )

    @post("/count_tokens", status_code=200)
    async def count_tokens(self, request: Request, mlxd: Mlxd) -> dict[str, int]:
        body = await read_body(request, mlxd.settings.limits.max_body_bytes)
        req = decode(body, CountTokensRequest)
        async with held(mlxd, req.model, request=request, quota=False) as lease:
            gen = count_tokens_request(req, lease.settings, info=lease.info)
            gen = await fetch_images(gen, lease.settings)
            # The prompt the real request runs: the same volatile rules apply.
            gen = apply_prompt_rules(gen, lease.settings.prompt_cache.volatile_rules)
            check_values(lease.info, gen)
            # Tokenized on the engine's intake thread, exactly as intake will.
            counted = await asyncio.wrap_future(lease.engine.count_tokens(gen))
        if isinstance(counted, Failed):
            raise OpenAIError.from_failed(counted)
        return {"input_tokens": counted}
