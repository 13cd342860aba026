"""The serial lane's turn: starting the row the scheduler planned, and advancing it one token.

Runs on the engine thread over an :class:`~mlxd.engine.chat.core.EngineCore`;
the run itself (mlx-lm's ``generate_step``) is :mod:`mlxd.engine.chat.serial`.
"""

from __future__ import annotations

import logging
import time

from mlxd.engine.chat.core import EngineCore
from mlxd.engine.chat.prompt_cache import Fetched
from mlxd.engine.chat.row import Row

logger = logging.getLogger(__name__)


def start(core: EngineCore, row: Row, fetched: Fetched) -> None:
    """Make ``row`` the serial row, from ``fetched``: its planned prompt-cache hit."""
    loaded = core.loaded
    assert loaded is not None
    core.admit_lookup(row, fetched)
    try:
        core.serial = core.hooks.make_serial_run(
            loaded,
            row,
            fetched.cache,
            fetched.rest,
            prefill_step_size=core.settings.batch.prefill_step_size,
            pump=core.pump,
            faults=core.faults,
            on_checkpoint=core.store_checkpoint if row.checkpoints else None,
        )
    except Exception as exc:
        logger.exception("starting %s", row.id)
        core.fail(row, f"could not start generation: {exc}")


def step(core: EngineCore) -> None:
    """Advance the serial row one token (the first advance prefills); end it when it is done."""
    run = core.serial
    assert run is not None and core.loaded is not None
    advanced = run.step(core.loaded.tokenizer.eos_token_ids)
    if advanced.prefill:
        core.counters.prefill_seconds += advanced.seconds
    else:
        core.counters.decode_seconds += advanced.seconds
    core.last_step_wall = time.time()
    if advanced.token:
        core.throughput.add(1, time.time())
    if advanced.ended is None:
        core.note_kv(after_step=True)
        return
    core.serial = None
    row = run.row
    if advanced.ended == "cancelled":
        if advanced.prefill:
            core.keep_prefill(row, row.prompt[: run.held], run.cache)
        core.cancelled(row)
    elif advanced.ended == "failed":
        core.counters.engine_errors += advanced.engine_error
        core.fail(row, advanced.error or "generation failed")
    else:
        core.complete(row, advanced.ended, stopped_by_string=advanced.stopped_by_string)
        core.store_cache(row.prompt + row.generated_ids, run.cache)
