"""A transcript's text as Whisper decodes it, window by window (``stream=true``; MLX-free).

The same hook stops a request whose client has gone: before each window,
:func:`per_window` raises :class:`Stopped` when the job's ``cancelled`` is set,
so ``generate`` ends there and the model is free for the next upload.

mlx-audio's Whisper ``Model.generate`` decodes an upload in 30 s windows
(each one seeking on from the last timestamp the window said) but returns only
at the end, with no per-window callback; its ``stream=True`` is another
algorithm (AlignAtt) whose text differs from the plain decode's. So
:func:`per_window` wraps ``model.decode`` for one ``generate`` call: before
each window is decoded, the text the finished windows made is read from
``generate``'s own frame (``all_tokens`` past ``initial_prompt_tokens``,
decoded by its ``tokenizer``: the call that makes its final ``text``) and
offered to a :class:`TextSoFar`, which sends what is new. mlx-audio 0.6.2
has no public per-window hook (``verbose=True`` prints, the ``tqdm`` bar
counts frames, ``stream=True`` is AlignAtt), hence the frame. The streamed text is
therefore the very text the same request gets without ``stream``.

Should a later mlx-audio rename those locals, nothing is read before the end
and the text comes as one piece when ``generate`` returns (still correct;
tests/http/test_transcription_stream.py fails so the change is seen).
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

# Held back until more text comes: trailing whitespace (the final text is
# stripped) and U+FFFD (a character whose bytes are split across tokens).
_UNSETTLED = re.compile(r"[\s\ufffd]+$")


class Stopped(Exception):
    """Raised inside ``generate`` before a window when the request was cancelled."""


class TextSoFar:
    """Sends each new piece of a growing transcript once; the pieces join to the text."""

    def __init__(self, send: Callable[[str], None]):
        self._send = send
        self.sent = ""

    def offer(self, text: str, *, final: bool = False) -> None:
        """``text`` is the transcript so far (``final``: the whole, stripped text)."""
        text = text.lstrip()
        if not final:
            text = _UNSETTLED.sub("", text)
        if len(text) <= len(self.sent):
            return
        if not text.startswith(self.sent):
            logger.warning("transcript stream: the text so far changed; sending the rest only")
            return
        piece, self.sent = text[len(self.sent) :], text
        self._send(piece)


def _text_so_far(frame: Any) -> str | None:
    """The text of the windows ``generate`` has finished, read from its frame."""
    names = frame.f_locals
    tokens, prompt, tokenizer = (
        names.get("all_tokens"),
        names.get("initial_prompt_tokens"),
        names.get("tokenizer"),
    )
    if not isinstance(tokens, list) or not isinstance(prompt, list) or tokenizer is None:
        return None
    return str(tokenizer.decode(tokens[len(prompt) :]))


@contextlib.contextmanager
def per_window(
    model: Any, text: TextSoFar | None, cancelled: threading.Event | None = None
) -> Iterator[None]:
    """While the block runs ``model.generate``, before each window: raise :class:`Stopped`
    if ``cancelled`` is set, else offer ``text`` (when given) the text so far."""
    real = model.decode

    def decode(segment: Any, options: Any) -> Any:
        if cancelled is not None and cancelled.is_set():
            raise Stopped
        if text is not None:
            # Called by generate's decode_with_fallback (a closure): its caller is generate.
            caller = sys._getframe(1).f_back
            so_far = _text_so_far(caller) if caller is not None else None
            if so_far is not None:
                text.offer(so_far)
        return real(segment, options)

    object.__setattr__(model, "decode", decode)
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError):
            object.__delattr__(model, "decode")


__all__ = ["Stopped", "TextSoFar", "per_window"]
