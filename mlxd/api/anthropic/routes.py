"""The Anthropic Messages routes: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Thin: decode and validate (:mod:`mlxd.api.anthropic.schema`), then run through
the same :func:`mlxd.api.openai.routes.generate` path as chat completions, rendered
by :mod:`mlxd.api.anthropic.render`. Keys are accepted as ``x-api-key`` or
``Authorization: Bearer``; ``anthropic-version`` and ``anthropic-beta`` are
accepted and not interpreted. Every error under ``/v1/messages`` is answered
in Anthropic's envelope (see :mod:`mlxd.api.http.errors`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from litestar import Controller, Request, Response, post
from litestar.di import Provide
from litestar.response import Stream

from mlxd.api.anthropic.render import MessagesOutput
from mlxd.api.anthropic.schema import (
    CountTokensRequest,
    MessagesRequest,
    count_tokens_request,
    messages_request,
)
from mlxd.api.http.body import read_body
from mlxd.api.http.errors import OpenAIError
from mlxd.api.openai.routes import (
    Output,
    acquire,
    api_key_guard,
    check_accepting,
    check_generation,
    check_values,
    generate,
    held,
    released_on_error,
)
from mlxd.api.openai.schemas import decode
from mlxd.api.state import Mlxd, provide_app_state
from mlxd.engine import Accepted, Failed


class MessagesController(Controller):
    path = "/v1/messages"
    guards = [api_key_guard]
    dependencies = {"mlxd": Provide(provide_app_state, sync_to_thread=False)}

    @post("/", status_code=200)
    async def create(self, request: Request, mlxd: Mlxd) -> Response[Any] | Stream:
        check_accepting(mlxd)
        body = await read_body(request, mlxd.settings.limits.max_body_bytes)
        req = decode(body, MessagesRequest)
        lease = await acquire(mlxd, req.model)
        with released_on_error(lease):
            info = lease.info
            call = messages_request(req, lease.settings, faults=mlxd.fault_injection, info=info)
            await check_generation(
                mlxd, lease, call.gen, json_param="output_config.format", tools_param="tool_choice"
            )

        def make_output(accepted: Accepted) -> Output:
            return MessagesOutput(call.gen.id, accepted.model, accepted.prompt_tokens)

        return await generate(request, mlxd, lease, call.gen, make_output, stream=call.stream)

    @post("/count_tokens", status_code=200)
    async def count_tokens(self, request: Request, mlxd: Mlxd) -> dict[str, int]:
        body = await read_body(request, mlxd.settings.limits.max_body_bytes)
        req = decode(body, CountTokensRequest)
        async with held(mlxd, req.model) as lease:
            gen = count_tokens_request(req, info=lease.info)
            check_values(lease.info, gen)
            # Tokenized on the engine's intake thread, exactly as intake will.
            counted = await asyncio.wrap_future(lease.engine.count_tokens(gen))
        if isinstance(counted, Failed):
            raise OpenAIError.from_failed(counted)
        return {"input_tokens": counted}
