"""The streamed transcript's pieces (mlxd/engine/transcription/windows.py, issue 37): each new
piece sent once, split characters and trailing spaces held back, the pieces joining to the
final text; the window hook reads the text so far from a generate shaped like mlx-audio's
and stops it before the next window once the request is cancelled."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from mlxd.engine.transcription.windows import Stopped, TextSoFar, per_window


def test_pieces_join_to_the_final_text() -> None:
    sent: list[str] = []
    text = TextSoFar(sent.append)
    text.offer(" Hello wor")
    text.offer(" Hello wor")  # nothing new
    text.offer(" Hello world \ufffd")  # a character split across tokens waits
    text.offer(" Hello world caf\u00e9 ")
    text.offer(" Hello world caf\u00e9 ok", final=True)
    assert sent == ["Hello wor", "ld", " caf\u00e9", " ok"]
    assert "".join(sent) == "Hello world caf\u00e9 ok"


def test_a_text_that_changed_sends_nothing_more() -> None:
    sent: list[str] = []
    text = TextSoFar(sent.append)
    text.offer("abc")
    text.offer("xyz and more")
    assert sent == ["abc"] and text.sent == "abc"


class _Tokenizer:
    def decode(self, tokens: list[int]) -> str:
        return "".join(f" w{t}" for t in tokens)


class _Whisper:
    """mlx-audio's Model.generate in outline: a closure decodes each window."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.sent: list[str] = []

    def decode(self, segment: Any, options: Any) -> list[int]:
        self.calls.append(list(self.sent))  # what the client had when this window began
        return [segment]

    def generate(self, windows: list[int]) -> str:
        tokenizer = _Tokenizer()
        initial_prompt_tokens = [99]
        all_tokens = list(initial_prompt_tokens)

        def decode_with_fallback(segment: int) -> list[int]:
            return self.decode(segment, None)

        for window in windows:
            all_tokens.extend(decode_with_fallback(window))
        return tokenizer.decode(all_tokens[len(initial_prompt_tokens) :]).strip()


def test_the_hook_sends_each_window_before_the_next_is_decoded() -> None:
    model = _Whisper()
    text = TextSoFar(model.sent.append)
    with per_window(model, text):
        final = model.generate([1, 2, 3])
    text.offer(final, final=True)
    assert model.calls == [[], ["w1"], ["w1", " w2"]]
    assert "".join(model.sent) == final == "w1 w2 w3"
    assert "decode" not in vars(model)  # the hook is gone after the block


def test_a_cancelled_request_stops_before_the_next_window() -> None:
    model = _Whisper()
    cancelled = threading.Event()
    real = model.decode

    def decode(segment: Any, options: Any) -> list[int]:
        if segment == 2:
            cancelled.set()  # the client leaves during window 2
        return real(segment, options)

    model.decode = decode
    with pytest.raises(Stopped), per_window(model, None, cancelled):
        model.generate([1, 2, 3, 4])
    assert len(model.calls) == 2  # windows 3 and 4 never began
