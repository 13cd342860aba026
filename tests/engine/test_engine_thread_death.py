"""An engine thread that dies outside its loop fails its requests at once, never hangs them."""

from __future__ import annotations

import asyncio
import time

from mlxd.config import load_settings
from mlxd.engine.chat.engine import Engine
from mlxd.engine.chat.hooks import OneMachine
from mlxd.engine.messages import Failed
from tests.support.engine import consume, token_request


class _BrokenJoin(OneMachine):
    """Hooks whose start fails the way a garbled cluster join once did (a ValueError)."""

    def join(self, settings, *, optimized_blas):
        raise ValueError("bytes must be in range(0, 256)")


def test_a_thread_that_dies_while_starting_fails_requests_with_500(tmp_path, tiny_models):
    settings = load_settings(
        None,
        overrides={
            "model": {"path": str(tiny_models("llama"))},
            "server": {"state_dir": str(tmp_path)},
        },
    )
    engine = Engine(settings, cluster=_BrokenJoin())
    engine.start()
    try:
        deadline = time.monotonic() + 30
        while engine.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.alive
        out = asyncio.run(asyncio.wait_for(consume(engine, token_request("r", [1, 2], 4)), 10))
        assert isinstance(out.end, Failed), out
        assert (out.end.code, out.end.status) == ("generation_error", 500)
        assert "engine thread has stopped" in out.end.message
        assert "range(0, 256)" in (engine.snapshot().last_error or "")
    finally:
        engine.stop()
