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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")

# A node: child tokens, plus the value stored at this depth under the _VALUE key.
_VALUE = -1


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
        self._root: dict = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, tokens: Sequence[int], value: V) -> V | None:
        """Store ``value`` under ``tokens``; returns the value it replaced, if any."""
        node = self._root
        for t in tokens:
            node = node.setdefault(t, {})
        previous = node.get(_VALUE)
        node[_VALUE] = value
        if previous is None:
            self._count += 1
        return previous

    def get(self, tokens: Sequence[int]) -> V | None:
        node = self._node(tokens)
        return None if node is None else node.get(_VALUE)

    def pop(self, tokens: Sequence[int]) -> V | None:
        """Remove the value under ``tokens`` (and the branch it leaves empty)."""
        path = [self._root]
        for t in tokens:
            child = path[-1].get(t)
            if child is None:
                return None
            path.append(child)
        value = path[-1].pop(_VALUE, None)
        if value is None:
            return None
        self._count -= 1
        for i in range(len(tokens), 0, -1):
            if path[i]:
                break
            del path[i - 1][tokens[i - 1]]
        return value

    def prefixes(self, tokens: Sequence[int]) -> Iterator[tuple[int, V]]:
        """``(length, value)`` of every stored strict prefix of ``tokens``, shortest first."""
        node = self._root
        for i, t in enumerate(tokens):
            if i and _VALUE in node:
                yield i, node[_VALUE]
            node = node.get(t)
            if node is None:
                return

    def walk(
        self, tokens: Sequence[int], *, limit: int, rewindable: Callable[[V], bool]
    ) -> Walk[V]:
        """Follow ``tokens`` down the trie (see the module docstring).

        ``prefix`` is at most ``limit`` tokens long; ``below`` is a value
        ``rewindable`` accepts, and only looked for when it could serve more
        than ``prefix`` does.
        """
        node = self._root
        prefix: V | None = None
        prefix_len = 0
        depth = 0
        for t in tokens:
            child = node.get(t)
            if child is None:
                break
            node = child
            depth += 1
            value = node.get(_VALUE)
            if value is not None and depth <= limit:
                prefix, prefix_len = value, depth
        usable = min(depth, limit)
        if usable <= prefix_len:
            return Walk(depth, prefix, prefix_len)
        below, below_len = self._shortest_below(node, depth, rewindable)
        return Walk(depth, prefix, prefix_len, below, below_len)

    def _shortest_below(
        self, node: dict, depth: int, rewindable: Callable[[V], bool]
    ) -> tuple[V | None, int]:
        # Breadth first: the first rewindable value found is the shortest.
        level = [node]
        while level:
            following = []
            for n in level:
                value = n.get(_VALUE)
                if value is not None and rewindable(value):
                    return value, depth
                following.extend(child for key, child in n.items() if key != _VALUE)
            level = following
            depth += 1
        return None, 0

    def values(self) -> Iterator[V]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            for key, child in node.items():
                if key == _VALUE:
                    yield child
                else:
                    stack.append(child)

    def clear(self) -> None:
        self._root = {}
        self._count = 0

    def _node(self, tokens: Sequence[int]) -> dict | None:
        node = self._root
        for t in tokens:
            node = node.get(t)
            if node is None:
                return None
        return node
