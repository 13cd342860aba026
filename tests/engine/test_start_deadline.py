"""An engine start stuck past ``[server] engine_start_timeout`` fails visibly, then recovers.

The start (here: the model load, held on an event) does not finish in time:
the engine shows ``failed`` with the reason as its load error (what
``/ready`` shows), a request queued meanwhile and a new one get 503 at
once, and a command fails instead of waiting. Once the start finishes after
all, the engine serves.
"""

from __future__ import annotations

import asyncio
import threading

from mlxd.config import load_settings
from mlxd.engine.chat.engine import Engine
from mlxd.engine.chat.served_model import ServedModel
from mlxd.engine.messages import Failed
from tests.support.engine import run_all, token_request, wait_for


def test_a_start_past_its_deadline_fails_visibly_then_recovers(tmp_path, monkeypatch, tiny_models):
    release = threading.Event()
    load_first = ServedModel.load_first

    def stuck_load_first(self):
        release.wait(30)  # a hung mount, a FIFO: something outside mlxd
        return load_first(self)

    monkeypatch.setattr(ServedModel, "load_first", stuck_load_first)
    settings = load_settings(
        None,
        overrides={
            "model": {"path": str(tiny_models("llama"))},
            "server": {"state_dir": str(tmp_path), "engine_start_timeout": 0.3},
        },
    )
    engine = Engine(settings)
    engine.start()
    try:

        async def queued_then_new() -> tuple[Failed | None, Failed | None]:
            early = engine.submit(token_request("early", [20, 21, 22], 2))
            assert engine.wait_loaded(10)  # the deadline ends the wait
            late = engine.submit(token_request("late", [20, 21, 22], 2))
            ends = []
            for handle in (early, late):
                events = [e async for e in handle.events()]
                ends.append(events[-1] if events else None)
            return ends[0], ends[1]

        early, late = asyncio.run(asyncio.wait_for(queued_then_new(), 10))
        assert isinstance(early, Failed) and isinstance(late, Failed)
        assert early.status == late.status == 503 and late.code == "model_load_failed"
        assert "engine_start_timeout" in late.message
        assert engine.snapshot().state == "failed"
        assert engine.load_error is not None and "did not finish starting" in engine.load_error
        command = engine.clear_error()
        assert isinstance(command.exception(timeout=1), RuntimeError)
        release.set()  # the start finishes after all
        wait_for(lambda: engine.snapshot().state == "ready", timeout=30)
        assert engine.load_error is None
        (out,) = run_all(engine, [token_request("after", [20, 21, 22], 2)])
        assert out.ok
    finally:
        release.set()
        engine.stop()
