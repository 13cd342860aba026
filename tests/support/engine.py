"""Driving a real :class:`Engine` (on a real model) from tests, without HTTP."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxd.config import load_settings
from mlxd.engine.chat.engine import Engine
from mlxd.engine.messages import (
    Accepted,
    Admitted,
    Delta,
    Failed,
    Finished,
    GenerationRequest,
    SamplingParams,
    TokenPrompt,
)


@dataclass
class Outcome:
    accepted: Accepted | Failed
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    end: Finished | Failed | None = None
    deltas: list[Delta] = field(default_factory=list)
    # The admission event (its prompt-cache lookup), and whether it came before any Delta.
    admitted: Admitted | None = None
    admitted_first: bool = False

    @property
    def ok(self) -> bool:
        return isinstance(self.end, Finished)


def greedy_reference(model: Any, tokenizer: Any, ids: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own greedy answer to ``ids`` (``stream_generate``), up to its EOS: the
    tokens a row of the engine must emit for the same prompt."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    tokens = []
    for r in stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens):
        if r.token in tokenizer.eos_token_ids:
            break
        tokens.append(r.token)
    return tokens


def make_engine(model_dir: Path, *, faults: bool = False, **sections: dict[str, Any]) -> Engine:
    """A started engine on ``model_dir``, loaded; its state (disk tier) in a fresh directory."""
    state = tempfile.mkdtemp(prefix="engine-", dir=os.environ.get("MLXD_SERVER__STATE_DIR"))
    server = {"state_dir": state, **sections.pop("server", {})}
    overrides = {"model": {"path": str(model_dir)}, "server": server, **sections}
    engine = Engine(load_settings(None, overrides=overrides), fault_injection=faults)
    engine.start()
    assert engine.wait_loaded(120), "model did not load"
    assert engine.info is not None, engine.snapshot().model.error
    return engine


@contextmanager
def running_engine(model_dir: Path, **kw: Any):
    engine = make_engine(model_dir, **kw)
    try:
        yield engine
    finally:
        engine.stop()


def token_request(rid: str, ids: list[int], max_tokens: int, **kw: Any) -> GenerationRequest:
    sampling = kw.pop("sampling", SamplingParams(temperature=0.0))
    return GenerationRequest(
        id=rid, prompt=TokenPrompt(tuple(ids)), max_tokens=max_tokens, sampling=sampling, **kw
    )


async def consume(
    engine: Engine, request: GenerationRequest, *, cancel_after: int | None = None
) -> Outcome:
    handle = engine.submit(request)
    out = Outcome(await handle.accepted())
    if isinstance(out.accepted, Failed):
        out.end = out.accepted
        return out
    async for event in handle.events():
        if isinstance(event, Admitted):
            out.admitted, out.admitted_first = event, not out.deltas
        elif isinstance(event, Delta):
            out.deltas.append(event)
            out.tokens.extend(event.token_ids)
            out.text += event.text
            if cancel_after is not None and len(out.tokens) >= cancel_after:
                handle.cancel()
                out.end = None
                return out
        else:
            out.end = event
    return out


def run_all(engine: Engine, requests: list[GenerationRequest], **kw: Any) -> list[Outcome]:
    async def main() -> list[Outcome]:
        return await asyncio.gather(*(consume(engine, r, **kw) for r in requests))

    return asyncio.run(main())


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.01) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError("condition not met")


def settled(engine: Engine, timeout: float = 30.0):
    """The snapshot once every accepted request has ended (events can outrun snapshots)."""

    def done():
        snap = engine.snapshot()
        c = snap.counters
        return snap if not snap.busy and c["finished"] == c["submitted"] else None

    return wait_for(done, timeout)
