"""One log line per API request, at ``info``: ``[server] log_requests``.

``POST /v1/chat/completions 200 model=SmolLM2-135M-Instruct lane=batch
prompt=25 cached=0 diverged_at=0 generated=64 finish=length ttft=0.251s duration=3.412s``

(``diverged_at`` on a partial prompt-cache hit or a miss, ``rules=`` when a
``[prompt_cache] volatile_rules`` rule changed the prompt; ``key=<name>
priority=<class>`` first when the request came with an API key.)

:func:`request_log` is the ``/v1`` router's middleware (so only the API's
routes are logged): it times the whole exchange (for a stream, until its last
chunk is sent) and reads the status the response started with; the handler
fills in what only it knows (model, lane, tokens, time to first token) on a
:class:`Note` kept in the ASGI scope. Nothing of the prompt or the answer is
logged, only counts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from mlxd.engine import Finished

if TYPE_CHECKING:
    from litestar.types import ASGIApp, Receive, Scope, Send

    from mlxd.engine import Accepted, CacheLookup, Failed

logger = logging.getLogger("mlxd.requests")

_SCOPE_KEY = "mlxd.request_note"


@dataclass
class Note:
    """What the handler learned about one request; unset fields are left out of the line."""

    # The API key's name (never the secret) and the priority class the request ran at.
    key: str | None = None
    priority: str | None = None
    model: str | None = None
    lane: str | None = None
    prompt_tokens: int | None = None
    cached: int | None = None
    diverged_at: int | None = None
    rules: str | None = None
    tools_ignored: int | None = None
    generated: int | None = None
    finish: str | None = None
    error: str | None = None
    ttft_s: float | None = None

    def accepted(self, accepted: Accepted, rules: tuple[str, ...] = ()) -> None:
        self.model, self.lane = accepted.model, accepted.lane
        self.prompt_tokens = accepted.prompt_tokens
        self.rules = ",".join(rules) or None

    def admitted(self, lookup: CacheLookup) -> None:
        self.cached, self.diverged_at = lookup.cached_tokens, lookup.diverged_at

    def ended(self, outcome: Finished | Failed) -> None:
        if isinstance(outcome, Finished):
            self.generated = outcome.usage.completion_tokens
            self.finish = outcome.finish_reason
            self.ttft_s = outcome.timings.ttft_s
        else:
            self.error = outcome.code

    def fields(self) -> str:
        parts = [
            ("key", self.key),
            ("priority", self.priority),
            ("model", self.model),
            ("lane", self.lane),
            ("prompt", self.prompt_tokens),
            ("cached", self.cached),
            ("diverged_at", self.diverged_at),
            ("rules", self.rules),
            ("tools_ignored", self.tools_ignored),
            ("generated", self.generated),
            ("finish", self.finish),
            ("error", self.error),
            ("ttft", None if self.ttft_s is None else f"{self.ttft_s:.3f}s"),
        ]
        return " ".join(f"{k}={v}" for k, v in parts if v is not None)


def note_of(scope: Any) -> Note:
    """The request's note (a throwaway one when the request is not logged)."""
    note = scope.get(_SCOPE_KEY) if isinstance(scope, dict) else None
    return note if isinstance(note, Note) else Note()


def request_log(app: ASGIApp) -> ASGIApp:
    """Litestar middleware: one line per request once answered (``[server] log_requests``)."""

    async def logged(scope: Scope, receive: Receive, send: Send) -> None:
        settings = scope["litestar_app"].state.mlxd.settings
        if scope["type"] != "http" or not settings.server.log_requests:
            await app(scope, receive, send)
            return
        note = Note()
        # A key of mlxd's own in the ASGI scope (Litestar's Scope type lists only its own).
        cast("dict[str, Any]", scope)[_SCOPE_KEY] = note
        status = [0]
        started = time.perf_counter()

        async def send_and_see(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await app(scope, receive, send_and_see)
        finally:
            duration = time.perf_counter() - started
            detail = note.fields()
            logger.info(
                "%s %s %s%s duration=%.3fs",
                scope.get("method", "-"),
                scope.get("path", ""),
                status[0] or "-",
                f" {detail}" if detail else "",
                duration,
            )

    return logged
