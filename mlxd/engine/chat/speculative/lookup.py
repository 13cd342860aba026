"""Prompt lookup: a row's draft from its own tokens, by suffix n-gram (no MLX).

The row's last ``n`` tokens (longest ``n`` first) are looked up among its
earlier tokens, prompt and output alike; the tokens that followed their most
recent earlier occurrence are the draft. Agent turns that re-emit file text
or tool JSON, and edits of a given text, repeat long runs of their prompt.
"""

from __future__ import annotations


class NgramIndex:
    """One row's tokens and, per n-gram length, where each n-gram last continued.

    Appending a token registers the n-grams that end just before it, so a
    lookup only ever finds an earlier occurrence of the suffix (O(1) a token).
    """

    def __init__(self, ngram_min: int, ngram_max: int):
        self.tokens: list[int] = []
        self._maps: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(ngram_max, ngram_min - 1, -1)
        }

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1
            for n, seen in self._maps.items():
                if end >= n:
                    seen[tuple(self.tokens[end - n : end])] = end

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest suffix's last earlier occurrence."""
        size = len(self.tokens)
        for n, seen in self._maps.items():
            if size < n:
                continue
            at = seen.get(tuple(self.tokens[size - n :]))
            if at is not None:
                return self.tokens[at : at + k]
        return []
