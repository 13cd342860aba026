"""A trie of token sequences: where a prompt leaves what is stored, and what it may reuse.

Both prompt-cache tiers index their entries with it (RAM: the caches
themselves; disk: the files). Pure Python, no MLX. A lookup answers three
things at once, in one walk down the prompt's tokens:

- ``common``: how many leading tokens the prompt shares with anything stored
  (where it *diverged*);
- ``prefix``: the longest stored sequence that is a true prefix of the
  prompt, no longer than a limit (any cache can resume from it);
- ``below``: the shortest stored sequence that continues past the point of
  divergence and that the caller can rewind (a trimmable cache, cut back to
  ``common`` tokens).

A radix trie: an edge holds a run of tokens (an 8-byte ``array``), and
nodes exist only where sequences branch or a value is stored. One node per
token (a dict each, about 250 bytes a token) made the disk tier's index of
a long-running daemon the bulk of its memory growth (issue 34, N13).
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class _Node:
    """Where sequences branch or a value is stored; ``edges``: first token -> (run, child)."""

    __slots__ = ("edges", "value")

    def __init__(self) -> None:
        self.edges: dict[int, tuple[array, _Node]] = {}
        self.value: Any = None  # a V; Any keeps the node free of the trie's type


def _run(tokens: Sequence[int], start: int) -> array:
    return array("q", tokens[start:])


def _shared(run: array, tokens: Sequence[int], at: int) -> int:
    """How many leading tokens of ``run`` match ``tokens[at:]``."""
    n = min(len(run), len(tokens) - at)
    k = 0
    while k < n and run[k] == tokens[at + k]:
        k += 1
    return k


@dataclass(frozen=True)
class Walk(Generic[V]):
    """What one prompt found in the trie (see the module docstring).

    ``prefix_len`` and ``below_len`` are the lengths of the stored sequences;
    ``below`` serves ``min(common, limit)`` tokens once cut back.
    """

    common: int
    prefix: V | None = None
    prefix_len: int = 0
    below: V | None = None
    below_len: int = 0


class TokenTrie(Generic[V]):
    """Values keyed by token sequences; ``len`` is the number of values."""

    def __init__(self) -> None:
        self._root = _Node()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, tokens: Sequence[int], value: V) -> V | None:
        """Store ``value`` under ``tokens``; returns the value it replaced, if any."""
        node, at = self._root, 0
        while at < len(tokens):
            edge = node.edges.get(tokens[at])
            if edge is None:
                child = _Node()
                node.edges[tokens[at]] = (_run(tokens, at), child)
                node, at = child, len(tokens)
                break
            run, child = edge
            k = _shared(run, tokens, at)
            if k < len(run):  # split the edge where the sequences part
                middle = _Node()
                node.edges[tokens[at]] = (run[:k], middle)
                middle.edges[run[k]] = (run[k:], child)
                child = middle
            node, at = child, at + k
        previous = node.value
        node.value = value
        if previous is None:
            self._count += 1
        return previous

    def get(self, tokens: Sequence[int]) -> V | None:
        node = self._node(tokens)
        return None if node is None else node.value

    def pop(self, tokens: Sequence[int]) -> V | None:
        """Remove the value under ``tokens`` (and the branch it leaves empty)."""
        path: list[tuple[_Node, int]] = []
        node, at = self._root, 0
        while at < len(tokens):
            edge = node.edges.get(tokens[at])
            if edge is None or _shared(edge[0], tokens, at) < len(edge[0]):
                return None
            path.append((node, tokens[at]))
            node, at = edge[1], at + len(edge[0])
        value = node.value
        if value is None:
            return None
        node.value = None
        self._count -= 1
        if not node.edges and path:
            parent, key = path.pop()
            del parent.edges[key]
            node = parent
        if node is not self._root and node.value is None and len(node.edges) == 1 and path:
            # A node that neither branches nor holds a value: merge it into its parent's edge.
            parent, key = path[-1]
            run, _ = parent.edges[key]
            (tail, child) = next(iter(node.edges.values()))
            parent.edges[key] = (run + tail, child)
        return value

    def prefixes(self, tokens: Sequence[int]) -> Iterator[tuple[int, V]]:
        """``(length, value)`` of every stored strict prefix of ``tokens``, shortest first."""
        node, at = self._root, 0
        while at < len(tokens):
            if at and node.value is not None:
                yield at, node.value
            edge = node.edges.get(tokens[at])
            if edge is None or _shared(edge[0], tokens, at) < len(edge[0]):
                return
            node, at = edge[1], at + len(edge[0])

    def walk(
        self, tokens: Sequence[int], *, limit: int, rewindable: Callable[[V], bool]
    ) -> Walk[V]:
        """Follow ``tokens`` down the trie (see the module docstring).

        ``prefix`` is at most ``limit`` tokens long; ``below`` is a value
        ``rewindable`` accepts, and only looked for when it could serve more
        than ``prefix`` does.
        """
        node, depth = self._root, 0
        prefix: V | None = None
        prefix_len = 0
        below_from, below_depth = self._root, 0
        while True:
            edge = node.edges.get(tokens[depth]) if depth < len(tokens) else None
            if edge is None:
                below_from, below_depth = node, depth
                break
            run, child = edge
            k = _shared(run, tokens, depth)
            if k < len(run):  # the prompt leaves in the middle of this edge
                below_from, below_depth = child, depth + len(run)
                depth += k
                break
            node, depth = child, depth + k
            if node.value is not None and depth <= limit:
                prefix, prefix_len = node.value, depth
        usable = min(depth, limit)
        if usable <= prefix_len:
            return Walk(depth, prefix, prefix_len)
        below, below_len = self._shortest_below(below_from, below_depth, rewindable)
        return Walk(depth, prefix, prefix_len, below, below_len)

    def _shortest_below(
        self, node: _Node, depth: int, rewindable: Callable[[V], bool]
    ) -> tuple[V | None, int]:
        # Shortest first: the first rewindable value taken off the heap is the shortest.
        order = itertools.count()
        heap = [(depth, next(order), node)]
        while heap:
            at, _, n = heapq.heappop(heap)
            if n.value is not None and rewindable(n.value):
                return n.value, at
            for run, child in n.edges.values():
                heapq.heappush(heap, (at + len(run), next(order), child))
        return None, 0

    def values(self) -> Iterator[V]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.value is not None:
                yield node.value
            stack.extend(child for _, child in node.edges.values())

    def clear(self) -> None:
        self._root = _Node()
        self._count = 0

    def _node(self, tokens: Sequence[int]) -> _Node | None:
        node, at = self._root, 0
        while at < len(tokens):
            edge = node.edges.get(tokens[at])
            if edge is None or _shared(edge[0], tokens, at) < len(edge[0]):
                return None
            node, at = edge[1], at + len(edge[0])
        return node
