"""``POST /v1/rerank`` (and ``/rerank``): the Jina/Cohere rerank route.

``{model, query, documents, top_n, return_documents}`` answers
``{results: [{index, relevance_score, document?}], usage}``, best first.

A reranker (``kind = "rerank"``: a cross-encoder or a yes/no LM,
:mod:`mlxd.engine.rerank`) scores each (query, document) pair itself, a
probability in [0, 1]. An embedding model (``kind = "embedding"``) serves it
by cosine similarity: the query and the documents are embedded in one batch
by the model's :class:`~mlxd.engine.embeddings.engine.EmbeddingEngine` (unit
vectors), and each document's score is its vector's dot product with the
query's, a value in [-1, 1]. The answer's ``scoring`` says which
(``cross_encoder``, ``yes_no_lm``, ``embedding_cosine``). A request that names
no model gets the default reranker, else the default embedding model.
Limits: at most :data:`MAX_DOCUMENTS` documents, each (and the query, or
each pair) within the model's context, else a 400 naming the document.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from typing import Any

import msgspec
import numpy as np
from litestar import Controller, Request, Response, post

from mlxd.api.http.body import read_body
from mlxd.api.http.decode import decode_parameters
from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.requestlog import note_of
from mlxd.api.lease import check_accepting, held
from mlxd.api.state import AppState, Mlxd
from mlxd.config.registry import default_id, registry, resolve
from mlxd.engine import EmbeddingError, Failed, check_embedding_inputs, rerank_pair_texts

# Cohere's own bound on the documents of one request (the query comes on top).
MAX_DOCUMENTS = 1000

# What the answer's "scoring" says about how the scores were made.
COSINE = "embedding_cosine"


class Document(msgspec.Struct, forbid_unknown_fields=False):
    text: str


class RerankRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # Absent or "": the default embedding model ([models.<id>] default).
    model: str = ""
    query: str
    # Strings, or objects with a "text" (Jina's and Cohere v1's shapes).
    documents: list[str | Document]
    top_n: int | None = None
    return_documents: bool = False
    # Cohere v2: accepted; a document longer than the context is refused, not cut.
    max_tokens_per_doc: int | None = None
    # Accepted and ignored, as in the other routes.
    user: str | None = None


def _bad(message: str, param: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, code=code, param=param)


def document_texts(req: RerankRequest) -> list[str]:
    """The request's documents as texts, checked for shape and count.

    Raises:
        OpenAIError: (400) an empty query, no documents, more than
            :data:`MAX_DOCUMENTS`, an empty document, a ``top_n`` below 1.
    """
    if not req.query.strip():
        raise _bad("'query' must not be empty.", "query")
    if not req.documents:
        raise _bad("'documents' must not be an empty list.", "documents")
    if len(req.documents) > MAX_DOCUMENTS:
        raise _bad(
            f"'documents' has {len(req.documents)} items; at most {MAX_DOCUMENTS} per "
            "request. Send the rest in another request.",
            "documents",
        )
    texts = [d if isinstance(d, str) else d.text for d in req.documents]
    for index, text in enumerate(texts):
        if not text.strip():
            raise _bad(f"Document {index} is empty; every document needs some text.", "documents")
    if req.top_n is not None and req.top_n < 1:
        raise _bad(f"'top_n' must be at least 1, got {req.top_n}.", "top_n")
    return texts


def ranked(scores: np.ndarray, top_n: int | None) -> list[int]:
    """Document indices, best score first (ties in document order), cut to ``top_n``."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    return order if top_n is None else order[:top_n]


def cosine_scores(vectors: list[np.ndarray]) -> np.ndarray:
    """Each document's cosine similarity to the query (``vectors[0]``); unit vectors in."""
    matrix = np.stack([np.asarray(v, dtype=np.float32) for v in vectors])
    return matrix[1:] @ matrix[0]


def kind_of(state: AppState, name: str) -> str:
    """The fleet kind the request goes to: "rerank", or "embedding" (cosine).

    A named model goes to its own kind (a chat model to "rerank", refused
    there with the routes it serves); no name: the default reranker, else
    the default embedding model.
    """
    settings = state.settings
    if not name:
        return "rerank" if default_id(settings, "rerank") else "embedding"
    model_id = resolve(settings, name, "rerank")
    entry = registry(settings).get(model_id or "")
    return "embedding" if entry is not None and entry.kind == "embedding" else "rerank"


def response_body(
    texts: list[str],
    scores: np.ndarray,
    req: RerankRequest,
    model: str,
    tokens: int,
    scoring: str = COSINE,
) -> dict[str, Any]:
    """The rerank answer: results best first, each with its document when asked."""
    results: list[dict[str, Any]] = []
    for index in ranked(scores, req.top_n):
        item: dict[str, Any] = {"index": index, "relevance_score": float(scores[index])}
        if req.return_documents:
            item["document"] = {"text": texts[index]}
        results.append(item)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {
        "object": "list",
        "model": model,
        "scoring": scoring,
        "results": results,
        "usage": usage,
    }


_INPUT = re.compile(r"^Input (\d+)")


def _named(message: str, kind: str) -> str:
    """The engine's "Input N" as the query or the document it is (an embedding model's
    input 0 is the query; a reranker's input N is document N with the query)."""

    def name(match: re.Match[str]) -> str:
        n = int(match.group(1))
        if kind == "rerank":
            return f"Document {n} (with the query)"
        return "The query" if n == 0 else f"Document {n - 1}"

    return _INPUT.sub(name, message, count=1)


def _refusal(failed: Failed, kind: str) -> OpenAIError:
    """The engine's refusal, its "Input N" told apart as the query or a document."""
    if _INPUT.match(failed.message):
        param = "query" if kind == "embedding" and failed.message.startswith("Input 0 ") else None
        failed = replace(failed, message=_named(failed.message, kind), param=param or "documents")
    return OpenAIError.from_failed(failed)


class RerankController(Controller):
    """``/v1/rerank`` under the API router."""

    path = "/"

    @post("/rerank", status_code=200)
    async def rerank(self, request: Request, mlxd: Mlxd) -> Response[Any]:
        return await serve_rerank(request, mlxd)


async def serve_rerank(request: Request, state: AppState) -> Response[Any]:
    """Read, check, embed and score one rerank request."""
    check_accepting(state)
    body = await read_body(request, state.settings.limits.max_body_bytes)
    policy = state.settings.server.unknown_parameters
    req, headers = decode_parameters(body, RerankRequest, policy, request.url.path)
    note = note_of(request.scope)
    note.model = req.model
    texts = document_texts(req)
    note.inputs = len(texts)
    kind = kind_of(state, req.model)
    # A reranker reads one text per (query, document) pair; an embedding model the query first.
    inputs = rerank_pair_texts(req.query, texts) if kind == "rerank" else [req.query, *texts]
    try:
        async with held(state, req.model, kind, request=request) as lease:
            engine = lease.engine
            note.model = lease.id
            if engine.info is not None:
                check_embedding_inputs(inputs, engine.info, None)
            result = await asyncio.wrap_future(engine.submit(inputs))
            scoring = (engine.info.scoring if engine.info is not None else "") or COSINE
    except EmbeddingError as exc:
        note.error = exc.code
        raise _refusal(exc.failed, kind) from None
    if isinstance(result, Failed):
        note.error = result.code
        raise _refusal(result, kind)
    note.prompt_tokens = result.prompt_tokens
    vectors = list(result.vectors)
    scores = cosine_scores(vectors) if kind == "embedding" else np.array([v[0] for v in vectors])
    body_out = response_body(texts, scores, req, lease.id, result.prompt_tokens, scoring)
    return Response(body_out, headers=headers)
