"""A request's grammar is prepared in the grammar pool under ``[limits] grammar_timeout``.

In process, with an engine stand-in whose compile blocks until the test lets
it go (a compile as slow as the test needs, on any machine): past the budget
the request is a 400 ``schema_too_complex`` while the compile finishes in the
background; with every worker busy, a request whose compile never started is
a 429; meanwhile the event loop keeps running.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from mlxd.api import grammar
from mlxd.api.http.errors import OpenAIError
from mlxd.engine import Constraint, json_constraint

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


class SlowEngine:
    """Compiles when :attr:`go` is set; counts what it compiled."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.compiled = 0

    def compile_grammar(self, constraint: Constraint) -> tuple[float, bool]:
        assert self.go.wait(30)
        self.compiled += 1
        return 0.0, False


def constraint() -> Constraint:
    return json_constraint(SCHEMA, strict=True, param="response_format.json_schema.schema")


async def prepare(engine: Any, budget: float) -> tuple[float, bool] | None:
    return await grammar.prepare_off_loop(
        engine, constraint(), param="response_format", budget=budget
    )


def test_a_compile_past_the_budget_is_a_400_and_finishes_in_the_background():
    engine = SlowEngine()

    async def run() -> tuple[OpenAIError, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        with pytest.raises(OpenAIError) as err:
            await prepare(engine, 0.3)
        ticker.cancel()
        return err.value, ticks

    err, ticks = asyncio.run(run())
    assert (err.status, err.code, err.param) == (
        400,
        "schema_too_complex",
        "response_format.json_schema.schema",
    )
    assert "0.3 s" in err.message and "grammar_timeout" in err.message
    assert ticks >= 5  # the loop ran while the compile waited
    engine.go.set()
    deadline = time.monotonic() + 10
    while engine.compiled < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.compiled == 1


def test_a_compile_that_never_started_in_a_busy_pool_is_a_429():
    engine = SlowEngine()

    async def run() -> OpenAIError:
        busy = [asyncio.create_task(prepare(engine, 30)) for _ in range(grammar.WORKERS)]
        await asyncio.sleep(0.1)
        with pytest.raises(OpenAIError) as err:
            await prepare(engine, 0.2)
        engine.go.set()
        assert await asyncio.gather(*busy) == [(0.0, False)] * grammar.WORKERS
        return err.value

    err = asyncio.run(run())
    assert (err.status, err.code) == (429, "queue_full")
    assert err.headers["Retry-After"] == "1"
    assert engine.compiled == grammar.WORKERS  # the refused one never ran


def test_without_a_model_llguidance_validates_alone():
    strict = json_constraint(
        {"type": "array", "uniqueItems": True}, strict=True, param="response_format"
    )
    with pytest.raises(OpenAIError) as err:
        asyncio.run(grammar.prepare_off_loop(None, strict, param="response_format", budget=10))
    assert (err.value.code, err.value.param) == ("invalid_schema", "response_format")
    assert "uniqueItems" in err.value.message
    ok = asyncio.run(
        grammar.prepare_off_loop(None, constraint(), param="response_format", budget=10)
    )
    assert ok is None
