"""``POST /v1/embeddings``: OpenAI's embeddings route, served by an embedding model.

The body is decoded strictly (unknown parameters follow ``[server]
unknown_parameters``), the inputs are shaped and checked against the model
before anything is queued, then the fleet lends the model's
:class:`~mlxd.engine.embeddings.engine.EmbeddingEngine` for the time of the request
(loading it first if needed). The fleet refuses unknown models (404), chat
models (400), failed loads (503) and models that never fit (400).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal

import msgspec
import numpy as np
from litestar import Controller, Request, Response, post

from mlxd.api.http.body import read_body
from mlxd.api.http.decode import decode_parameters
from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.requestlog import note_of
from mlxd.api.lease import check_accepting, held
from mlxd.api.state import AppState, Mlxd
from mlxd.engine import EmbeddingError, EmbeddingResult, Failed, check_embedding_inputs


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Absent or "": the default model of the route's kind ([models.<id>] default).
    model: str = ""
    # A string, a list of strings, a list of token ids or a list of such lists.
    input: str | list[Any]
    encoding_format: str = "float"
    dimensions: int | None = None
    # Accepted and ignored, as in the other routes.
    user: str | None = None


Inputs = list[str] | list[list[int]]


def _bad(message: str, *, param: str = "input", code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, code=code, param=param)


def _is_id(value: Any) -> bool:
    return type(value) is int


def shape_inputs(value: str | list[Any]) -> Inputs:
    """The request's ``input`` as a list of texts or a list of token-id lists.

    Raises:
        OpenAIError: (400) an empty string or list, or a value of another shape.
    """
    if isinstance(value, str):
        if not value:
            raise _bad("'input' must not be an empty string.")
        return [value]
    if not value:
        raise _bad("'input' must not be an empty list.")
    if all(isinstance(v, str) for v in value):
        return list(value)
    if all(_is_id(v) for v in value):
        return [list(value)]
    if all(isinstance(v, list) and all(_is_id(t) for t in v) for v in value):
        return [list(v) for v in value]
    raise _bad(
        "'input' must be a string, a list of strings, a list of token ids (integers) "
        "or a list of lists of token ids.",
        code="invalid_type",
    )


def _check_format(encoding_format: str) -> Literal["float", "base64"]:
    if encoding_format not in ("float", "base64"):
        raise _bad(
            f"'encoding_format' must be 'float' or 'base64', got {encoding_format[:40]!r}.",
            param="encoding_format",
        )
    return encoding_format


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """One vector as JSON floats, or as base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, dtype="<f4").tobytes()).decode()
    return vector.astype(np.float32).tolist()


def response_body(result: EmbeddingResult, model: str, encoding_format: str) -> dict[str, Any]:
    """OpenAI's embeddings response for ``result``."""
    data = [
        {"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
        for i, v in enumerate(result.vectors)
    ]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def _openai(exc: EmbeddingError) -> OpenAIError:
    return OpenAIError(exc.status, exc.message, code=exc.code, param=exc.param)


class EmbeddingsController(Controller):
    """``/v1/embeddings``."""

    path = "/"

    @post("/embeddings", status_code=200)
    async def embeddings(self, request: Request, mlxd: Mlxd) -> Response[Any]:
        return await serve_embeddings(request, mlxd)


async def serve_embeddings(request: Request, state: AppState) -> Response[Any]:
    """Read, check and embed one request; the vectors come back in input order."""
    check_accepting(state)
    body = await read_body(request, state.settings.limits.max_body_bytes)
    policy = state.settings.server.unknown_parameters
    req, headers = decode_parameters(body, EmbeddingRequest, policy, request.url.path)
    note = note_of(request.scope)
    note.model = req.model
    inputs = shape_inputs(req.input)
    note.inputs = len(inputs)
    encoding_format = _check_format(req.encoding_format)
    try:
        async with held(state, req.model, "embedding", request=request) as lease:
            engine = lease.engine
            note.model = lease.id
            if engine.info is not None:
                check_embedding_inputs(inputs, engine.info, req.dimensions)
            result = await asyncio.wrap_future(engine.submit(inputs, dimensions=req.dimensions))
    except EmbeddingError as exc:
        note.error = exc.code
        raise _openai(exc) from None
    if isinstance(result, Failed):
        note.error = result.code
        raise OpenAIError.from_failed(result)
    note.prompt_tokens = result.prompt_tokens
    if any(not isinstance(i, str) for i in inputs):
        headers = {**headers, TOKEN_IDS_HEADER: token_ids_warning(engine.info)}
    return Response(response_body(result, lease.id, encoding_format), headers=headers)


# Token-id input cannot be told apart from another tokenizer's ids: said on every answer.
TOKEN_IDS_HEADER = "X-Mlxd-Token-Ids"


def token_ids_warning(info: Any) -> str:
    """What token-id input was read as (docs/api.md, "Token-id input")."""
    vocab = getattr(info, "vocab_size", None)
    return (
        f"read as this model's own token ids (vocabulary {vocab}); ids of another "
        "tokenizer (tiktoken cl100k, as LangChain's OpenAIEmbeddings sends) embed other "
        "text: send strings (check_embedding_ctx_length=False)"
    )
