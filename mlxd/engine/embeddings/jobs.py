"""One embedding request inside the engine, and how a round is cut into passes (no MLX).

A :class:`Job` is prepared (checked and tokenized) on an intake thread, then
embedded by the model's thread pass by pass; :func:`plan_passes` decides which
inputs share a forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlxd.engine.embeddings.checks import check_inputs, too_long
from mlxd.engine.embeddings.messages import (
    Embedded,
    EmbeddingError,
    EmbeddingInfo,
    EmbeddingResult,
)
from mlxd.engine.messages import Failed

# Padded tokens (inputs x longest input) one forward pass may hold, beyond a
# single input: attention memory grows with the square of the length, so long
# inputs go in narrower passes.
PASS_TOKENS = 16384

Encoder = Callable[[list[str]], list[list[int]]]


@dataclass(eq=False)
class Job:
    """One request: its inputs, then their token ids, then their vectors."""

    inputs: list[Any]
    dimensions: int | None
    future: Future[Embedded]
    ids: list[list[int]] = field(default_factory=list)
    vectors: np.ndarray | None = None
    left: int = 0

    @property
    def width(self) -> int:
        """Inputs it brings to a round."""
        return len(self.inputs)


def shutting_down() -> Failed:
    return Failed("shutting_down", "The server is shutting down; retry later.", 503)


def copy_inputs(inputs: Any) -> list[Any]:
    """A private copy of ``inputs`` (a caller may reuse its lists), shape-checked.

    Raises:
        EmbeddingError: (400) not a list of strings or of integer lists.
    """
    if isinstance(inputs, str) or not isinstance(inputs, Sequence):
        raise EmbeddingError(
            400,
            "inputs must be a list of strings or of token-id lists",
            code="invalid_value",
            param="input",
        )
    out: list[Any] = []
    for item in inputs:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, Sequence) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item
        ):
            out.append([int(t) for t in item])
        else:
            raise EmbeddingError(
                400,
                "each input must be a string or a list of integer token ids",
                code="invalid_value",
                param="input",
            )
    return out


def prepare(job: Job, info: EmbeddingInfo, encode: Encoder) -> None:
    """Check ``job`` against ``info``, tokenize its texts, and make room for its vectors.

    Raises:
        EmbeddingError: (400) an input the model cannot take, found before
            or after tokenizing.
    """
    check_inputs(job.inputs, info, job.dimensions)
    job.ids = encode(job.inputs) if isinstance(job.inputs[0], str) else job.inputs
    for index, ids in enumerate(job.ids):
        if len(ids) > info.context_length:
            raise too_long(index, f"{len(ids)} tokens", info.context_length)
    job.vectors = np.zeros((len(job.ids), info.dimensions), dtype=np.float32)
    job.left = len(job.ids)


Item = tuple[Job, int]


def plan_passes(jobs: list[Job], limit: int, pass_tokens: int = PASS_TOKENS) -> list[list[Item]]:
    """The round's inputs, sorted by length, cut into forward passes.

    A pass holds at most ``limit`` inputs and at most ``pass_tokens`` padded
    tokens (inputs x its longest), or one input alone however long it is.
    Sorting first means each pass pads to a length close to all of its rows.
    """
    items = [(job, i) for job in jobs for i in range(len(job.ids))]
    items.sort(key=lambda item: len(item[0].ids[item[1]]))
    passes: list[list[Item]] = []
    limit = max(1, limit)
    for item in items:
        width = len(item[0].ids[item[1]])
        current = passes[-1] if passes else None
        if (
            current is not None
            and len(current) < limit
            and (len(current) + 1) * width <= (pass_tokens)
        ):
            current.append(item)
        else:
            passes.append([item])
    return passes


def result_of(job: Job) -> EmbeddingResult:
    """The job's vectors (truncated to ``dimensions`` and renormalized) and token count."""
    vectors = job.vectors
    assert vectors is not None
    if job.dimensions is not None and job.dimensions < vectors.shape[1]:
        vectors = normalize(vectors[:, : job.dimensions])
    return EmbeddingResult(vectors=vectors, prompt_tokens=sum(len(ids) for ids in job.ids))


def normalize(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (a zero row stays zero)."""
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)
