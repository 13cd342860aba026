"""The daemon factory: one ``mlxd serve`` per distinct config, started once and shared.

A test module asks the ``daemons`` fixture for the daemon of a config::

    @pytest.fixture(scope="module")
    def daemon(daemons, tiny_models):
        return daemons.get({"model": {"path": str(tiny_models("llama"))}, "batch": {"size": 2}})

Modules that ask for the same config (and the same ``env`` and ``args``) get the
same running daemon: it starts on the first request and is handed back to the
pool when the last module holding it ends. The pool keeps the few most recently
used idle daemons (``KEEP_IDLE``) so a later module with the same config starts
nothing, and stops the rest; every daemon is stopped at the end of the session.

A module that changes its daemon's state (reloads, edits its config file, sends
signals, reads its whole log) passes ``name=``: a named daemon is shared only with
modules that give the same name and config, and stops when its last module ends.
Tests that start, kill or restart a daemon themselves build a
:class:`~tests.support.daemon.Daemon` directly.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from mlxd.config import parse_toml
from tests.support.daemon import Daemon, toml_config

__all__ = [
    "DEMO_SDK",
    "KEEP_IDLE",
    "DaemonKey",
    "DaemonPool",
    "Daemons",
    "daemon_pool",
    "daemons",
    "tools_config",
    "uses_demo_model",
]

# Idle daemons kept for reuse: enough to bridge a few modules between two that
# share a config, few enough that idle processes do not pile up in memory.
KEEP_IDLE = 3


# The demo model as the SDK modules share it (test_openai_sdk, test_responses,
# test_messages): each model alias family, and a small Responses store.
DEMO_SDK: dict[str, Any] = {
    "batch": {"size": 4},
    "sampling": {"max_tokens": 48},
    "responses": {"max_stored": 3},
    "model": {"aliases": ["gpt-5*", "claude-*"]},
}


def tools_config(template: str) -> dict[str, Any]:
    """A tiny llama with a tools-capable chat ``template``, served as ``tiny-tools``.

    Shared by the tool and structured-output modules of all three APIs.
    """
    from tests.support.tinymodels import tiny_model_dir

    return {
        "model": {"path": str(tiny_model_dir("llama", template=template)), "name": "tiny-tools"},
        "batch": {"size": 8, "kv_budget": "128MiB"},
    }


def uses_demo_model(config: str) -> bool:
    """Whether a config serves the demo chat model (a chat model without a ``path`` or a
    ``repo``; the demo embedding model loads in a second and does not count)."""
    data = parse_toml(config, "<test config>")
    models = data.get("models")
    if isinstance(models, dict) and models:
        return any(
            not entry.get("path") and not entry.get("repo") and entry.get("kind", "chat") == "chat"
            for entry in models.values()
        )
    model = data.get("model", {})
    return not model.get("path") and not model.get("repo")


@dataclass(frozen=True)
class DaemonKey:
    """What makes two daemons the same: the config text, extra environment and arguments."""

    config: str
    env: tuple[tuple[str, str], ...] = ()
    args: tuple[str, ...] = ()
    name: str | None = None


@dataclass
class _Entry:
    daemon: Daemon
    holders: set[str] = field(default_factory=set)
    last_used: int = 0


class DaemonPool:
    """Every daemon of the session by key, with the modules holding each."""

    def __init__(
        self,
        tmp_path_factory: pytest.TempPathFactory,
        keep_idle: int = KEEP_IDLE,
        *,
        kind: type[Daemon] = Daemon,
        prefix: str = "mlxd",
    ):
        self._tmp = tmp_path_factory
        self._keep_idle = keep_idle
        # What the pool starts: a daemon process, or (tests/support/inprocess.py) an app in process.
        self._kind = kind
        self._prefix = prefix
        self._entries: dict[DaemonKey, _Entry] = {}
        self._clock = itertools.count(1)
        # Reported at the end of the session: how many daemons started, how often one was shared.
        self.started = 0
        self.reused = 0

    def get(
        self,
        holder: str,
        config: str | Mapping[str, Any],
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        args: list[str] | None = None,
        port: int | None = None,
        prepare: Callable[[Path], None] | None = None,
        timeout: float = 300.0,
    ) -> Daemon:
        """The running daemon for ``config`` (TOML text or ``{section: {key: value}}``).

        ``prepare`` is called with a new daemon's working folder before it starts.
        """
        text = config if isinstance(config, str) else toml_config(**config)
        key = DaemonKey(text, tuple(sorted((env or {}).items())), tuple(args or ()), name)
        entry = self._entries.get(key)
        if entry is not None and entry.daemon.alive():
            if holder not in entry.holders:
                self.reused += 1
            entry.holders.add(holder)
            entry.last_used = next(self._clock)
            return entry.daemon
        if entry is not None:  # it died (a test killed it): start a fresh one
            self._stop([entry.daemon])
            del self._entries[key]
        workdir = self._tmp.mktemp(name or self._prefix)
        daemon = self._kind(workdir, text, env=dict(env or {}), args=list(args or ()), port=port)
        if prepare is not None:
            prepare(workdir)
        daemon.start(timeout)
        self.started += 1
        self._entries[key] = _Entry(daemon, {holder}, next(self._clock))
        return daemon

    def release(self, holder: str) -> None:
        """``holder`` (a module) ended: its named daemons stop, the others may idle."""
        done = []
        for key, entry in list(self._entries.items()):
            entry.holders.discard(holder)
            if not entry.holders and key.name is not None:
                done.append(entry.daemon)
                del self._entries[key]
        self._stop(done)
        self._trim(self._keep_idle)

    def close(self) -> None:
        """Stop every daemon (at the end of the session)."""
        self._stop([e.daemon for e in self._entries.values()])
        self._entries.clear()

    def _trim(self, keep: int) -> None:
        idle = sorted(
            ((k, e) for k, e in self._entries.items() if not e.holders),
            key=lambda item: item[1].last_used,
        )
        extra = idle[: max(0, len(idle) - max(keep, 0))]
        for key, _ in extra:
            del self._entries[key]
        self._stop([e.daemon for _, e in extra])

    @staticmethod
    def _stop(daemons: list[Daemon]) -> None:
        for d in daemons:  # all at once: they shut down in parallel
            d.terminate()
        for d in daemons:
            d.stop()


class Daemons:
    """One module's door to the pool (the ``daemons`` fixture)."""

    def __init__(self, pool: DaemonPool, holder: str, *, slow: bool):
        self._pool = pool
        self._holder = holder
        self._slow = slow

    def get(self, config: str | Mapping[str, Any], **options: Any) -> Daemon:
        """The daemon for ``config``; options as :meth:`DaemonPool.get`.

        A daemon on the demo model serves the whole module, so the module must be
        marked ``slow`` (``pytestmark = pytest.mark.slow``); it gets 900 s to start.
        """
        text = config if isinstance(config, str) else toml_config(**config)
        if uses_demo_model(text):
            if not self._slow:
                pytest.fail(f"{self._holder} starts a demo-model daemon: mark the module slow")
            options.setdefault("timeout", 900.0)
        return self._pool.get(self._holder, text, **options)


_POOL = pytest.StashKey[DaemonPool]()


@pytest.fixture(scope="session")
def daemon_pool(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[DaemonPool]:
    """Every daemon the modules asked for; all stopped when the session ends."""
    pool = DaemonPool(tmp_path_factory)
    pytestconfig.stash[_POOL] = pool
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def daemons(daemon_pool: DaemonPool, request: pytest.FixtureRequest) -> Iterator[Daemons]:
    """The factory of shared daemons for this module: ``daemons.get(config, **options)``."""
    holder = request.module.__name__
    slow = request.node.get_closest_marker("slow") is not None
    yield Daemons(daemon_pool, holder, slow=slow)
    daemon_pool.release(holder)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    pool = config.stash.get(_POOL, None)
    if pool is not None and pool.started:
        terminalreporter.write_line(
            f"daemon factory: {pool.started} daemons started, "
            f"{pool.reused} times a running one was handed to another module"
        )
