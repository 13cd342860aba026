"""From sampled tokens to text: detokenizing and stop strings, per row.

Both lanes feed tokens through the same :class:`TextStream`, so stop strings,
held-back text and the end of a row behave the same whether it batched or not.
"""

from __future__ import annotations

from dataclasses import dataclass


class StopMatcher:
    """Finds stop strings in streamed text without leaking a partial one.

    Text that could be the beginning of a stop string is held back until the
    next piece shows whether it is one.
    """

    def __init__(self, stops: tuple[str, ...]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return what is safe to release and whether a stop matched."""
        buf = self._held + text
        if not self._stops:
            self._held = ""
            return buf, False
        found = [(i, s) for s in self._stops if (i := buf.find(s)) >= 0]
        if found:
            first, self.matched = min(found, key=lambda f: f[0])
            self._held = ""
            return buf[:first], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The end of the row: nothing more can complete a stop string."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that begins some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if stop.startswith(buf[-n:]):
                    longest = n
                    break
        return longest


@dataclass
class Piece:
    text: str
    stopped: bool


class TextStream:
    """One row's detokenizer and stop matcher."""

    def __init__(self, detokenizer, stops: tuple[str, ...]):
        self._detok = detokenizer
        self._matcher = StopMatcher(stops)
        self.stopped = False

    @property
    def matched(self) -> str | None:
        """The stop string that ended the row, if one did."""
        return self._matcher.matched

    def add(self, token: int) -> Piece:
        """Add a generated (non end-of-sequence) token."""
        self._detok.add_token(token)
        text, self.stopped = self._matcher.feed(self._detok.last_segment)
        return Piece(text, self.stopped)

    def finish(self) -> Piece:
        """The row ends (end of sequence or length): release what is left."""
        self._detok.finalize()
        text, self.stopped = self._matcher.feed(self._detok.last_segment)
        if not self.stopped:
            text += self._matcher.flush()
        return Piece(text, self.stopped)
