"""The values that cross between the HTTP side and an embedding engine's thread.

Plain frozen dataclasses, no MLX: the HTTP side imports this module (and
:mod:`mlxd.engine.embeddings.checks`) and nothing else of the embedding
engine. A request's outcome crosses back as a value, an
:class:`EmbeddingResult` or the engine's :class:`~mlxd.engine.messages.Failed`;
:class:`EmbeddingError` is raised only by the pure checks, on the caller's
own thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from mlxd.engine.messages import ErrorCode, Failed

# unloaded -> loading -> ready (or failed) -> ... -> stopped; "unloaded" again
# after an unload, "loading" again for the next load.
EmbeddingState = Literal["unloaded", "loading", "ready", "failed", "stopped"]


class EmbeddingError(Exception):
    """Inputs the model cannot take, found by a pure check; :attr:`failed` is the value.

    ``code`` and ``param`` are OpenAI's error fields (``context_length_exceeded``,
    ``invalid_value``, ...).
    """

    def __init__(self, status: int, message: str, *, code: ErrorCode, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code: ErrorCode = code
        self.param = param

    @property
    def failed(self) -> Failed:
        """The same refusal as the value a request's future resolves to."""
        return Failed(self.code, self.message, self.status, param=self.param)


@dataclass(frozen=True)
class EmbeddingInfo:
    """What the HTTP side may know about a loaded embedding model."""

    id: str
    path: str
    family: str
    # Length of each vector (the model's pooled output).
    dimensions: int
    # Most tokens one input may have (special tokens included).
    context_length: int
    # Token ids an input may carry are in [0, vocab_size).
    vocab_size: int
    weights_bytes: int
    # Whether ``dimensions`` (truncate, then renormalize) is allowed: the model
    # was trained for truncated vectors (Matryoshka representation learning).
    supports_dimensions: bool
    dtype: str
    # What bounds an input's tokens from below before it is tokenized
    # (embedding_model.size_bounds): the most characters one token stands for
    # (0: no such bound), and whether every whitespace-separated word is at
    # least one token.
    max_token_chars: int = 0
    min_token_per_word: bool = False
    created: int = 0
    # A reranker's (kind = "rerank", mlxd.engine.rerank): how its one-float rows score
    # a pair, "cross_encoder" or "yes_no_lm"; "" for an embedding model.
    scoring: str = ""


@dataclass(frozen=True)
class EmbeddingResult:
    """One request's vectors, in input order: a ``(len(inputs), dims)`` float32 array."""

    vectors: np.ndarray
    prompt_tokens: int


# What a request's future resolves to.
Embedded = EmbeddingResult | Failed


@dataclass(frozen=True)
class EmbeddingSnapshot:
    """An embedding engine at one moment, for ``/stats`` and the dashboard."""

    id: str
    state: EmbeddingState
    # Requests waiting for the thread, and requests with inputs in a forward pass.
    queued: int
    running: int
    requests_served: int
    requests_failed: int
    inputs_embedded: int
    tokens_embedded: int
    # Inputs in the most recent forward pass (0 before the first).
    last_batch_size: int
    batch_limit: int
    forward_passes: int
    weights_bytes: int
    load_error: str | None = None
