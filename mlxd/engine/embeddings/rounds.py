"""One round on an embedding model's thread: its requests' inputs in length-sorted passes.

Runs on the model's thread (it makes MLX calls through
:func:`mlxd.engine.embeddings.loading.run_pass`); the passes are cut by
:func:`mlxd.engine.embeddings.jobs.plan_passes`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from mlxd.engine.embeddings.jobs import Job, plan_passes, shutting_down
from mlxd.engine.messages import Failed

if TYPE_CHECKING:
    from mlxd.engine.embeddings.loading import LoadedEmbedding
    from mlxd.engine.embeddings.queue import WorkQueue

logger = logging.getLogger(__name__)


def run_round(
    loaded: LoadedEmbedding,
    jobs: list[Job],
    limit: int,
    queue: WorkQueue,
    finish: Callable[[Job], None],
    fail: Callable[[Job, Failed], None],
) -> None:
    """Embed every input of ``jobs`` in passes of at most ``limit`` inputs.

    A request is ``finish``-ed as soon as its last input is embedded; a pass
    that fails fails its requests only (500 ``embedding_error``), and the
    round goes on. When the engine stops between two passes, the requests
    left fail with ``shutting_down``.
    """
    from mlxd.engine.embeddings.loading import run_pass

    passes = plan_passes(jobs, limit)
    for n, chunk in enumerate(passes):
        if queue.stopping:
            for job in {job for rest in passes[n:] for job, _ in rest}:
                fail(job, shutting_down())
            break
        rows = [job.ids[i] for job, i in chunk]
        try:
            if loaded.forward is not None:  # a reranker's scores (mlxd.engine.rerank)
                vectors = loaded.forward(rows)
            else:
                vectors = run_pass(loaded.model, rows, loaded.pad_id)
            if vectors.shape != (len(rows), loaded.info.dimensions):
                raise ValueError(
                    f"vectors of shape {vectors.shape}, expected "
                    f"{(len(rows), loaded.info.dimensions)}"
                )
        except Exception as exc:
            logger.exception("embedding pass of %d inputs failed", len(rows))
            error = Failed(
                "embedding_error", f"the embedding pass failed: {type(exc).__name__}: {exc}", 500
            )
            for job in {job for job, _ in chunk}:
                fail(job, error)
            continue
        queue.count_pass(len(rows))
        for (job, i), vector in zip(chunk, vectors, strict=True):
            if job.future.done():
                continue
            assert job.vectors is not None
            job.vectors[i] = vector
            job.left -= 1
            if job.left == 0:
                finish(job)
    queue.round_ended()
