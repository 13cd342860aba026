"""A request's grammar, checked and compiled off the event loop under a time budget.

Decoding a body only wraps its schemas into a grammar. Everything that costs
time runs here, in a small pool of worker threads, before the request is
queued: the schemas measured against the structured-output limits
(:func:`mlxd.engine.check_constraint`), then the grammar compiled for the
model that will run it (so the engine thread finds it cached), or validated
without a tokenizer when no model is loaded. The event loop only waits, so
other requests and ``/health`` are answered meanwhile.

A compile that outlasts ``[limits] grammar_timeout`` is a 400
``schema_too_complex``; its thread finishes in the background (llguidance
cannot be interrupted), and the pool's size bounds how many can. A request
whose compile never started within the budget (the pool busy with others) is
a 429 instead: the schema was never measured.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import TYPE_CHECKING

from mlxd.api.http.errors import OpenAIError
from mlxd.engine import Constraint, StructureError, check_constraint, validate_constraint

if TYPE_CHECKING:
    from mlxd.engine import Engine

WORKERS = 2
_pool = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="mlxd-grammar")


def prepare(
    engine: Engine | None, constraint: Constraint, *, param: str
) -> tuple[float, bool] | None:
    """Check and compile ``constraint`` (blocking); a 400 :class:`OpenAIError` when it cannot be.

    Returns ``(seconds, was_cached)`` from the engine's compile, or None
    when no model's tokenizer was at hand (then llguidance validated it
    alone, and intake compiles it).
    """
    param = _named(constraint, param)
    try:
        check_constraint(constraint)
        warmed = engine.compile_grammar(constraint) if engine is not None else None
        if warmed is None:
            validate_constraint(constraint, param)
        return warmed
    except StructureError as exc:
        raise OpenAIError(400, str(exc), code=exc.code, param=exc.param) from None
    except ValueError as exc:  # the engine's GrammarError
        raise OpenAIError(
            400,
            f"The grammar cannot be compiled for this model: {exc}",
            code="invalid_schema",
            param=param,
        ) from None


def _named(constraint: Constraint, param: str) -> str:
    """The parameter a refusal of the whole grammar names: a JSON format's schema itself."""
    if constraint.kind == "json" and constraint.schemas:
        return constraint.schemas[0][0]
    return param


async def prepare_off_loop(
    engine: Engine | None, constraint: Constraint, *, param: str, budget: float
) -> tuple[float, bool] | None:
    """:func:`prepare` in the grammar pool, waiting at most ``budget`` seconds."""
    future = _pool.submit(prepare, engine, constraint, param=param)
    try:
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), budget)
    except TimeoutError:
        if future.cancel():
            raise OpenAIError(
                429,
                "The server is busy compiling other requests' grammars; retry in a moment.",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        raise OpenAIError(
            400,
            f"The schema did not compile within {budget:g} s (limits.grammar_timeout); "
            "simplify it (docs/api.md, 'Structured output limits').",
            code="schema_too_complex",
            param=_named(constraint, param),
        ) from None
