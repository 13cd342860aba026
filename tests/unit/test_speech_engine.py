"""SpeechEngine (issue 37) driven as the fleet drives it, without loading a model:
refusals before a load, a failed load, stop. (tests/http/test_speech.py loads and speaks.)"""

from __future__ import annotations

import queue
from pathlib import Path

import pytest

from mlxd.config import load_settings
from mlxd.engine import Failed, SpeechJob


def job(events: queue.Queue) -> SpeechJob:
    return SpeechJob(text="Hi.", deliver=events.put, voice="alloy", response_format="pcm")


def test_refuse_fail_to_load_stop(tmp_path: Path) -> None:
    from mlxd.engine.speech.engine import SpeechEngine

    settings = load_settings(None, overrides={"model": {"path": str(tmp_path)}})
    engine = SpeechEngine(settings, "tts")
    engine.start()
    events: queue.Queue = queue.Queue()
    try:
        engine.submit(job(events))
        before = events.get(timeout=30)
        assert isinstance(before, Failed) and before.code == "model_not_loaded"
        assert before.status == 503 and engine.snapshot().requests_failed == 1
        with pytest.raises(Exception, match=r"config\.json"):
            engine.load(settings).result(30)
        snap = engine.snapshot()
        assert snap.state == "failed" and snap.load_error and "config.json" in snap.load_error
        assert engine.info is None and engine.weights_bytes == 0 and not engine.busy
    finally:
        engine.stop()
    assert not engine.alive and engine.snapshot().state == "stopped"
    engine.submit(job(events))
    stopped = events.get(timeout=1)
    assert isinstance(stopped, Failed) and stopped.code == "shutting_down"


class _Words:
    """A text tokenizer of the Hugging Face shape: one token per word."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens  # the text alone, without the model's markers
        return list(range(len(text.split())))


class _Phonemes:
    """Not a text tokenizer: its encode takes other arguments (a phoneme vocabulary)."""

    def encode(self, phonemes: list[str]) -> list[int]:
        return [0] * len(phonemes)


def test_input_tokens_are_the_models_tokens_else_characters() -> None:
    from types import SimpleNamespace

    from mlxd.engine.speech.loading import LoadedSpeaker, input_tokens

    def speaker(tokenizer: object) -> LoadedSpeaker:
        return LoadedSpeaker(SimpleNamespace(tokenizer=tokenizer), None)  # type: ignore[arg-type]

    text = "Hello there, river."
    assert input_tokens(speaker(_Words()), text) == 3
    assert input_tokens(speaker(None), text) == len(text)  # Kokoro: no text tokenizer
    assert input_tokens(speaker(_Phonemes()), text) == len(text)
