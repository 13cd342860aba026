"""The engine's intake thread: tokenizing and checking requests off the engine thread.

Tokenizing a long prompt takes seconds, so the engine thread hands each new
request (and each count_tokens job) to this thread together with the
``LoadedModel`` of the moment, and keeps stepping. The thread runs
``intake.prepare`` (the tokenizer and pure checks, no MLX) and posts the
result back to the engine's inbox as :class:`Intaken`; the engine queues it,
or prepares it again when the model was swapped meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlxd.config import Settings
from mlxd.engine.chat.commands import Submit
from mlxd.engine.chat.intake import Prepared, prepare, tokenize
from mlxd.engine.chat.loading import LoadedModel
from mlxd.engine.checks import IntakeError
from mlxd.engine.messages import Failed, GenerationRequest
from mlxd.engine.policy.budget import KvRoom

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Intaken:
    """A submitted request back from the intake thread, tokenized by ``loaded``."""

    submit: Submit
    prepared: Prepared | Failed
    loaded: LoadedModel


@dataclass(frozen=True)
class _Prepare:
    submit: Submit
    loaded: LoadedModel
    settings: Settings
    room: KvRoom


@dataclass(frozen=True)
class _Count:
    request: GenerationRequest
    loaded: LoadedModel
    future: concurrent.futures.Future[Any]


class IntakeThread:
    """One thread, fed by the engine thread; results go to ``deliver`` (the inbox)."""

    def __init__(self, name: str, deliver: Callable[[Intaken], None]):
        self._jobs: queue.SimpleQueue[_Prepare | _Count | None] = queue.SimpleQueue()
        self._deliver = deliver
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._jobs.put(None)

    def prepare(
        self, submit: Submit, loaded: LoadedModel, settings: Settings, room: KvRoom
    ) -> None:
        """Tokenize and check ``submit.request``; an :class:`Intaken` comes back."""
        self._jobs.put(_Prepare(submit, loaded, settings, room))

    def count(
        self,
        request: GenerationRequest,
        loaded: LoadedModel,
        future: concurrent.futures.Future[Any],
    ) -> None:
        """Resolve ``future`` to the prompt tokens of ``request``, or a Failed."""
        self._jobs.put(_Count(request, loaded, future))

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, _Count):
                job.future.set_result(_count(job))
                continue
            request = job.submit.request
            try:
                prepared: Prepared | Failed = prepare(job.loaded, request, job.settings, job.room)
            except Exception as exc:  # a bug: report it on this request alone
                logger.exception("preparing %s failed", request.id)
                prepared = Failed("generation_error", f"could not prepare the request: {exc}", 500)
            self._deliver(Intaken(job.submit, prepared, job.loaded))


def _count(job: _Count) -> int | Failed:
    try:
        return len(tokenize(job.loaded, job.request))
    except IntakeError as exc:
        return Failed(exc.code, str(exc), 400, param=exc.param)
    except Exception as exc:  # a bug: answer this count alone
        logger.exception("counting the tokens of %s failed", job.request.id)
        return Failed("generation_error", f"could not count the tokens: {exc}", 500)
