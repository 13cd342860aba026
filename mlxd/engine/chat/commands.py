"""The messages the chat engine thread takes from its inbox: requests, cancels, commands.

Plain frozen values and no logic (vLLM's ``EngineCoreRequestType`` and its
messages): other threads say *what* to do, and only the engine thread,
between two steps, does it (:mod:`mlxd.engine.chat.engine_thread`). A
command travels with the future its sender waits on (:class:`Order`); the
two commands that replace the model (:class:`Load`, :class:`Unload`) first
drain both lanes.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

from mlxd.config import ModelSettings, Settings, SpeculativeSettings
from mlxd.engine.channel import Channel
from mlxd.engine.messages import GenerationRequest


@dataclass(frozen=True)
class Submit:
    """A new request and the channel its events go out on."""

    request: GenerationRequest
    channel: Channel


@dataclass(frozen=True)
class Cancel:
    """End a request wherever it is (intake, a queue or a lane)."""

    request_id: str


@dataclass(frozen=True)
class Load:
    """Drain both lanes, load ``model`` and serve it; on failure the old model stays.

    Resolves to the new model's :class:`~mlxd.engine.messages.ModelInfo`.
    """

    model: ModelSettings
    # The new [speculative] table: a draft model loads with its target.
    speculative: SpeculativeSettings | None = None


@dataclass(frozen=True)
class Unload:
    """Drain both lanes and drop the model; the thread waits for the next :class:`Load`."""


@dataclass(frozen=True)
class Apply:
    """Take new policy settings between two steps; running rows keep running."""

    settings: Settings


@dataclass(frozen=True)
class StopAccepting:
    """Refuse new requests from the next step on (a graceful shutdown); queued ones run."""


@dataclass(frozen=True)
class AbortAll:
    """End every queued and running request with ``message`` (503 shutting_down)."""

    message: str


@dataclass(frozen=True)
class ClearError:
    """Forget the latest engine error (a good reload clears the status bar's)."""


@dataclass(frozen=True)
class Rename:
    """Account under ``model_id`` in the shared memory pool from the next step on."""

    model_id: str


@dataclass(frozen=True)
class CountTokens:
    """How many prompt tokens ``request`` has, tokenized as at intake.

    Resolves to an ``int``, or a :class:`~mlxd.engine.messages.Failed` when
    the prompt cannot be tokenized or no model is loaded.
    """

    request: GenerationRequest


Command = Load | Unload | Apply | StopAccepting | AbortAll | ClearError | Rename | CountTokens


@dataclass(frozen=True)
class Order:
    """A command in the inbox, with the future its sender waits on."""

    command: Command
    future: concurrent.futures.Future[Any]


def drain_reason(command: Command) -> str | None:
    """Why both lanes drain before ``command`` runs (shown in the drain log), or None."""
    if isinstance(command, Load):
        return "model_swap"
    if isinstance(command, Unload):
        return "model_unload"
    return None
