"""RerankEngine: a reranker served by the embedding engine's thread, queue and rounds.

A reranker's "input" is one (query, document) pair, carried as one text
(:mod:`mlxd.engine.rerank.pairs`) and encoded as a
pair by the reranker's own encoder; a forward pass gives one score per pair
in place of a vector. Everything else (intake threads, batching by
``[models.<id>.batch] size``, load and unload by command, the snapshot, the
fleet's budget) is :class:`~mlxd.engine.embeddings.engine.EmbeddingEngine`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from mlxd.config import Settings
from mlxd.engine.embeddings.engine import EmbeddingEngine
from mlxd.engine.embeddings.messages import Embedded
from mlxd.engine.rerank.pairs import pair_texts

if TYPE_CHECKING:
    from mlxd.engine.embeddings.loading import LoadedEmbedding


class RerankEngine(EmbeddingEngine):
    """A reranker (cross-encoder or yes/no LM) on its own thread; see the module docstring."""

    def score(self, query: str, documents: Sequence[str]) -> Future[Embedded]:
        """Queue the pairs; the result's ``vectors`` are ``(len(documents), 1)`` scores."""
        return self.submit(pair_texts(query, documents))

    def _load_model(self, settings: Settings) -> LoadedEmbedding:
        from mlxd.engine.rerank.loading import load_reranker

        return load_reranker(settings.model, self.model_id)


__all__ = ["RerankEngine"]
