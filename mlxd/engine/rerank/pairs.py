"""A (query, document) pair as the one text the embedding engine's queue carries (pure).

The query and the document are joined by :data:`PAIR_SEP`, stripped from both
first; the reranker's encoder splits them again.
"""

from __future__ import annotations

from collections.abc import Sequence

PAIR_SEP = "\x1f"


def pair_texts(query: str, documents: Sequence[str]) -> list[str]:
    """One text per (query, document) pair, the separator stripped from both first."""
    query = query.replace(PAIR_SEP, " ")
    return [f"{query}{PAIR_SEP}{d.replace(PAIR_SEP, ' ')}" for d in documents]


def split_pair(text: str) -> tuple[str, str]:
    """The query and the document of one pair's text."""
    query, _, document = text.partition(PAIR_SEP)
    return query, document
