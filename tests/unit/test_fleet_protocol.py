"""The fleet drives every engine through ModelEngine alone, whatever its kind (no MLX).

Recording engines that have nothing but the protocol's members stand in for
both kinds: anything else the fleet touched would raise AttributeError.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Any

import pytest

from mlxd.config import Settings, load_settings
from mlxd.engine.fleet.fleet import Fleet
from mlxd.engine.fleet.values import FleetRefusal


@dataclass(frozen=True)
class Info:
    weights_bytes: int
    dimensions: int = 0


@dataclass(frozen=True)
class Numbers:
    state: str


class Recorder:
    """A ModelEngine that records its commands and answers them at once."""

    def __init__(self, settings: Settings, model_id: str, at_start: bool = False):
        self.model_id = model_id
        self.at_start = at_start
        self.calls: list[tuple[Any, ...]] = []
        self._info: Info | None = None
        self._alive = False

    def start(self) -> None:
        self.calls.append(("start",))
        self._alive = True

    def wait_loaded(self, timeout: float | None = None) -> bool:
        return True

    @property
    def load_error(self) -> str | None:
        return None

    def load(self, settings: Settings) -> concurrent.futures.Future[Info]:
        self.calls.append(("load", settings.model.path))
        self._info = Info(weights_bytes=1000)
        return _done(self._info)

    def unload(self) -> concurrent.futures.Future[None]:
        self.calls.append(("unload",))
        self._info = None
        return _done(None)

    def apply(self, settings: Settings) -> concurrent.futures.Future[None]:
        self.calls.append(("apply", settings.batch.size))
        return _done(None)

    def rename(self, model_id: str) -> None:
        self.calls.append(("rename", model_id))

    def stop(self, timeout: float = 10.0) -> None:
        self.calls.append(("stop",))
        self._alive = False

    def snapshot(self) -> Numbers:
        return Numbers("ready" if self._info else "unloaded")

    @property
    def info(self) -> Info | None:
        return self._info

    @property
    def busy(self) -> bool:
        return False

    @property
    def alive(self) -> bool:
        return self._alive


def _done(value: Any) -> concurrent.futures.Future[Any]:
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_result(value)
    return future


def settings_with(tmp_path, emb_batch: int = 4, emb_kind: str = "embedding") -> Settings:
    models = {
        "chat": {"path": str(tmp_path / "chat"), "default": True},
        "emb": {"path": str(tmp_path / "emb"), "kind": emb_kind, "batch": {"size": emb_batch}},
    }
    return load_settings(None, overrides={"models": models, "memory": {"budget": "1GiB"}})


def test_both_kinds_load_unload_apply_and_stop_through_the_protocol(tmp_path):
    made: dict[str, list[Recorder]] = {"chat": [], "embedding": []}

    def chat(settings, model_id, pool, at_start):
        made["chat"].append(engine := Recorder(settings, model_id, at_start))
        return engine

    def embedding(settings, model_id):
        made["embedding"].append(engine := Recorder(settings, model_id))
        return engine

    async def scenario() -> None:
        fleet = Fleet(
            settings_with(tmp_path),
            device_bytes=2**34,
            make_engine=chat,
            make_embedding=embedding,
        )
        fleet.start()
        runner = asyncio.ensure_future(fleet.run())
        try:
            (chat_engine,), (emb_engine,) = made["chat"], made["embedding"]
            assert chat_engine.calls == emb_engine.calls == [("start",)]
            for name, kind, engine in [
                ("chat", "chat", chat_engine),
                ("emb", "embedding", emb_engine),
            ]:
                lease = await fleet.acquire(name, kind)
                assert lease.engine is engine and lease.info == Info(1000)
                assert engine.calls[-1] == ("load", str(tmp_path / name))
                state = fleet.status().get(name)
                assert state is not None and (state.state, state.weights_bytes) == ("loaded", 1000)
                lease.release()
            with pytest.raises(FleetRefusal) as refused:
                await fleet.acquire("emb", "chat")
            assert refused.value.failed.code == "model_kind_mismatch"
            assert (await fleet.unload("emb")).state == "unloaded"
            assert emb_engine.calls[-1] == ("unload",) and emb_engine.info is None
            # A reload reaches both engines as a settings value, through apply.
            assert (await fleet.apply(settings_with(tmp_path, emb_batch=2))).failed == {}
            assert ("apply", 2) in emb_engine.calls and chat_engine.calls[-1][0] == "apply"
            # A new kind is a new engine; the old one stops.
            assert (await fleet.apply(settings_with(tmp_path, emb_kind="chat"))).failed == {}
            assert emb_engine.calls[-1] == ("stop",) and len(made["chat"]) == 2
            assert made["chat"][1].calls == [("start",)]
        finally:
            runner.cancel()
        fleet.stop()
        assert all(e.calls[-1] == ("stop",) for kind in made.values() for e in kind)

    asyncio.run(scenario())


class SlowLoad(Recorder):
    """A Recorder whose load finishes only when the test says."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.pending: concurrent.futures.Future[Info] = concurrent.futures.Future()

    def load(self, settings: Settings) -> concurrent.futures.Future[Info]:
        self.calls.append(("load", settings.model.path))
        return self.pending


def _waiting(fleet: Fleet) -> int:
    state = fleet.status().get("chat")
    assert state is not None
    return state.waiting


def test_a_request_waiting_for_a_load_is_refused_at_once_on_shutdown(tmp_path):
    """Issue 33 item 8: SIGTERM's 503 reached a waiting request only after the load."""
    from mlxd.engine import Failed

    made: list[SlowLoad] = []

    def chat(settings, model_id, pool, at_start):
        made.append(engine := SlowLoad(settings, model_id, at_start))
        return engine

    async def scenario() -> None:
        fleet = Fleet(
            settings_with(tmp_path), device_bytes=2**34, make_engine=chat, make_embedding=Recorder
        )
        fleet.start()
        runner = asyncio.ensure_future(fleet.run())
        try:
            waiter = asyncio.ensure_future(fleet.acquire("chat", "chat"))
            while _waiting(fleet) == 0:
                await asyncio.sleep(0.01)
            fleet.refuse_waiting(Failed("shutting_down", "shutting down", 503))
            with pytest.raises(FleetRefusal) as refused:
                await asyncio.wait_for(waiter, 2)
            assert (refused.value.failed.code, refused.value.failed.status) == (
                "shutting_down",
                503,
            )
            assert _waiting(fleet) == 0
            with pytest.raises(FleetRefusal):  # and any later request
                await fleet.acquire("chat", "chat")
            made[0].pending.set_result(Info(weights_bytes=1000))  # the load itself goes on
        finally:
            runner.cancel()
            fleet.stop()

    asyncio.run(scenario())


def test_a_request_waiting_for_a_load_is_refused_when_a_reload_removes_its_model(tmp_path):
    """A reload that removed a model left the requests waiting for its load hanging."""
    made: list[SlowLoad] = []

    def embedding(settings, model_id):
        made.append(engine := SlowLoad(settings, model_id))
        return engine

    async def scenario() -> None:
        fleet = Fleet(
            settings_with(tmp_path),
            device_bytes=2**34,
            make_engine=lambda settings, model_id, pool, at_start: Recorder(settings, model_id),
            make_embedding=embedding,
        )
        fleet.start()
        runner = asyncio.ensure_future(fleet.run())
        try:
            waiter = asyncio.ensure_future(fleet.acquire("emb", "embedding"))
            while (state := fleet.status().get("emb")) is None or state.waiting == 0:
                await asyncio.sleep(0.01)
            only_chat = load_settings(
                None,
                overrides={
                    "models": {"chat": {"path": str(tmp_path / "chat"), "default": True}},
                    "memory": {"budget": "1GiB"},
                },
            )
            await asyncio.wait_for(fleet.apply(only_chat), 2)
            with pytest.raises(FleetRefusal) as refused:
                await asyncio.wait_for(waiter, 2)  # before the fix: until the load ended
            failed = refused.value.failed
            assert (failed.code, failed.status, failed.param) == ("model_not_found", 404, "model")
            assert "'emb' was removed by a reload" in failed.message
            made[0].pending.set_result(Info(weights_bytes=1000))  # the load ends; then it leaves
            while fleet.status().get("emb") is not None:
                await asyncio.sleep(0.01)
            assert made[0].calls[-1] == ("stop",)
        finally:
            runner.cancel()
            fleet.stop()

    asyncio.run(scenario())
