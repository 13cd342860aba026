"""A model lent for one request: the fleet's lease under the request's API key's rules.

Every route that runs a model goes through :func:`acquire` (or :func:`held`
for an answer sent whole): the key's ``models`` list is checked before
anything loads (403 ``model_not_allowed``), the request takes its place in
the key's quotas (429 when over one; given back with the lease), and the
fleet lends the model (404, 400, 503 as docs/api.md lists). A Batch API line
runs as its owner's key but outside its quotas: the lines run in idle time.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

from litestar import Request

from mlxd.api.http.caller import Caller, caller_of
from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.keys import Who
from mlxd.api.state import AppState
from mlxd.config.registry import resolve
from mlxd.engine import FleetRefusal

if TYPE_CHECKING:
    from mlxd.engine import Lease


def check_accepting(state: AppState) -> None:
    """503 ``shutting_down`` once a graceful shutdown has begun."""
    if state.shutting_down:
        raise OpenAIError(
            503,
            "The server is shutting down; retry on another instance or later.",
            code="shutting_down",
        )


async def acquire(
    state: AppState,
    name: str | None,
    kind: str = "chat",
    *,
    request: Request | None = None,
    quota: bool = True,
) -> Lease:
    """The model ``name`` (an id or alias) stands for, loaded and held for one request.

    Unknown names get 404 ``model_not_found`` listing the ids; a model of the
    other kind 400; a model that cannot load 503; one that can never fit in
    ``[memory] budget`` 400. Release the lease when the answer is sent.

    With the ``request``, its API key's rules apply first: a model outside the
    key's ``models`` is 403 ``model_not_allowed`` (before anything loads), and
    the request counts against the key's quotas (``quota``), a 429 when over
    one; its place in ``max_concurrent`` is given back with the lease.
    """
    caller = caller_of(request.scope) if request is not None else Caller()
    if caller.who is not None:
        _check_model(state, caller.who, name, kind)
    # A Batch API line runs as its owner's key but outside its quotas (idle time only);
    # it still counts in the key's totals (/metrics, /stats keys).
    if quota and caller.is_batch_line:
        state.quotas.count_outside(caller.who, requests=1)
    quota = quota and caller.spends_quota
    release = state.quotas.take(caller.who, anthropic=is_anthropic(request)) if quota else None
    try:
        lease = await state.fleet.acquire(name, kind)
    except FleetRefusal as exc:
        if release is not None:
            release()
        failed = exc.failed
        if failed.code == "model_load_failed" and state.downloads is not None:
            # [server] downloads = true: a repo not in the cache is pulled, not just refused.
            failed = state.downloads.on_load_failed(resolve(state.settings, name, kind), failed)
        raise OpenAIError.from_failed(failed) from None
    except BaseException:
        if release is not None:
            release()
        raise
    if release is not None:
        lease.on_release(release)
    return lease


def is_anthropic(request: Request | None) -> bool:
    """Whether ``request`` came in on Anthropic's Messages API (its header names apply)."""
    return request is not None and request.url.path.startswith("/v1/messages")


def _check_model(state: AppState, who: Who, name: str | None, kind: str) -> None:
    model_id = resolve(state.settings, name, kind)
    if model_id is None or who.may_use(model_id, name):
        return  # an unknown name gets the fleet's 404
    raise OpenAIError(
        403,
        f"The API key '{who.name}' may not use the model '{name or model_id}'.",
        code="model_not_allowed",
        param="model",
    )


@contextlib.asynccontextmanager
async def held(
    state: AppState,
    name: str | None,
    kind: str = "chat",
    *,
    request: Request | None = None,
    quota: bool = True,
) -> AsyncIterator[Lease]:
    """:func:`acquire` for a request answered whole: released when the block ends."""
    lease = await acquire(state, name, kind, request=request, quota=quota)
    try:
        yield lease
    finally:
        lease.release()


@contextlib.contextmanager
def released_on_error(lease: Lease) -> Iterator[Lease]:
    """Hold ``lease`` past the block (``generate`` releases it), unless the block fails."""
    try:
        yield lease
    except BaseException:
        lease.release()
        raise
