"""The API's own routes: ``/v1`` behind its key guard, the operations endpoints, the envelopes.

:func:`mlxd.web.make_app` composes them with the dashboard into the one app.
"""

from __future__ import annotations

from litestar import Router
from litestar.types import ControllerRouterHandler

from mlxd.api.anthropic.errors import ANTHROPIC
from mlxd.api.anthropic.routes import MESSAGES_PATH, messages_router
from mlxd.api.batches.files import FilesController
from mlxd.api.batches.routes import BatchesController
from mlxd.api.http.caller import api_key_guard
from mlxd.api.http.errors import OPENAI, Envelopes
from mlxd.api.http.requestlog import request_log
from mlxd.api.openai.audio import AudioController
from mlxd.api.openai.embeddings import EmbeddingsController
from mlxd.api.openai.rerank import RerankController
from mlxd.api.openai.routes import OpenAIController
from mlxd.api.openai.speech import SpeechController
from mlxd.api.ops.admin import AdminController
from mlxd.api.ops.downloads import DownloadsController
from mlxd.api.ops.health import HealthController, root_probe
from mlxd.api.ops.memory import MemoryController
from mlxd.api.ops.metrics import MetricsController
from mlxd.api.ops.stats import StatsController
from mlxd.api.responses.routes import ResponsesController

API_PATH = "/v1"

# Errors that no router handles (a request that reaches no route, one the
# request guard refuses before routing) in the envelope of the API whose path
# holds the request: Anthropic's under /v1/messages, OpenAI's everywhere else.
ERROR_ENVELOPES = Envelopes(OPENAI, {f"{API_PATH}{MESSAGES_PATH}": ANTHROPIC})


def api_router() -> Router:
    """``/v1``: every API, behind the API-key guard (which resolves each request's caller)."""
    return Router(
        path=API_PATH,
        route_handlers=[
            OpenAIController,  # /v1/models, /v1/chat/completions, /v1/completions
            EmbeddingsController,  # /v1/embeddings
            RerankController,  # /v1/rerank
            AudioController,  # /v1/audio/transcriptions, /v1/audio/translations
            SpeechController,  # /v1/audio/speech
            ResponsesController,  # /v1/responses
            messages_router(),  # /v1/messages: Anthropic's, in its own envelope
            FilesController,  # /v1/files (the Batch API's files)
            BatchesController,  # /v1/batches
        ],
        guards=[api_key_guard],
        middleware=[request_log],
    )


def rerank_root_router() -> Router:
    """``/rerank`` (Jina's and Cohere's path, without ``/v1``), behind the same key guard."""
    return Router(
        path="/",
        route_handlers=[RerankController],
        guards=[api_key_guard],
        middleware=[request_log],
    )


def api_route_handlers() -> list[ControllerRouterHandler]:
    """The routes the API side serves: ``/v1`` and the operations endpoints."""
    return [
        api_router(),
        rerank_root_router(),  # /rerank
        HealthController,  # /health, /ready
        StatsController,  # /stats
        MetricsController,  # /metrics
        AdminController,  # /admin/reload
        DownloadsController,  # /admin/models/{id}/pull, /admin/downloads
        MemoryController,  # /admin/memory (finding a leak)
        root_probe,  # HEAD /: 200 (Claude Code probes it)
    ]
