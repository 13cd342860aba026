"""Load a Whisper or Parakeet model directory through mlx-audio and run one transcription.

Only the transcription engine's thread calls these (MLX here). A model is
whatever ``mlx_audio.stt.load`` builds from the directory (``config.json``,
the weights, a saved ``WhisperProcessor``; for Parakeet, NeMo's config with its
vocabulary, told by ``model_type`` or NeMo's ``target``, see
:mod:`mlxd.engine.transcription.parakeet`); its facts become an
:class:`~mlxd.engine.embeddings.messages.EmbeddingInfo` (the per-model record
the fleet's views already read: ``context_length`` is the text decoder's
context, ``dimensions`` 0).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxd.engine.audio.transcript import Segment, Transcript, Word
from mlxd.engine.embeddings.messages import EmbeddingInfo
from mlxd.engine.transcription.messages import TranscriptionJob


@dataclass
class LoadedTranscriber:
    model: Any
    info: EmbeddingInfo
    whisper: bool  # Whisper's options (task, language, prompt, temperature, words) apply
    parakeet: bool = False  # NeMo's Parakeet: transcribes only (parakeet.refusal)


def load_transcriber(path: str | None, model_id: str) -> LoadedTranscriber:
    """Load the model at ``path``; raises ModelLoadError naming what is wrong."""
    from mlxd.engine.chat.loading import ModelLoadError

    if not path:
        raise ModelLoadError(f'{model_id}: a kind = "transcription" model needs a path')
    directory = Path(path).expanduser()
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{model_id}: {directory} has no config.json (a Whisper model dir)")
    config = json.loads(config_file.read_text())
    from mlx.utils import tree_flatten
    from mlx_audio.stt import load

    from mlxd.engine.transcription.parakeet import is_parakeet

    parakeet = is_parakeet(config)
    model = load(str(directory), model_type="parakeet") if parakeet else load(str(directory))
    arrays: list[Any] = [v for _, v in tree_flatten(model.parameters())]
    weights = sum(int(v.nbytes) for v in arrays)
    family = "parakeet" if parakeet else str(config.get("model_type", "whisper"))
    info = EmbeddingInfo(
        id=model_id,
        path=str(directory),
        family=family,
        dimensions=0,
        context_length=int(config.get("n_text_ctx", config.get("max_target_positions", 0))),
        vocab_size=int(config.get("n_vocab", config.get("vocab_size", 0)))
        or int((config.get("decoder") or {}).get("vocab_size", 0) if parakeet else 0),
        weights_bytes=int(weights),
        supports_dimensions=False,
        dtype=str(arrays[0].dtype).removeprefix("mlx.core.") if arrays else "",
        created=int(time.time()),
    )
    return LoadedTranscriber(model, info, whisper="whisper" in family, parakeet=parakeet)


def refusal(loaded: LoadedTranscriber, job: TranscriptionJob) -> tuple[str, str] | None:
    """Why this model cannot do ``job``: (the form field, the message), else None."""
    if loaded.parakeet:
        from mlxd.engine.transcription.parakeet import refusal as parakeet_refusal

        return parakeet_refusal(loaded.info.id, job)
    if job.language is None or not loaded.whisper:
        return None
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

    if job.language in LANGUAGES:
        return None
    return "language", (
        f"'language' must be an ISO-639-1 code Whisper knows (e.g. en, de, fr, ja); "
        f"got {job.language!r}."
    )


def transcribe(loaded: LoadedTranscriber, job: TranscriptionJob) -> tuple[Transcript, int]:
    """Run ``job`` to the end; the transcript and the tokens generated.

    A Whisper model raises :class:`~mlxd.engine.transcription.windows.Stopped`
    before the next window once ``job.cancelled`` is set; other models run to the end.
    """
    import mlx.core as mx

    from mlxd.engine.transcription.windows import TextSoFar, per_window

    audio = mx.array(job.samples)
    so_far = TextSoFar(job.on_text) if job.on_text is not None else None
    if loaded.whisper:
        with per_window(loaded.model, so_far, job.cancelled):
            out = loaded.model.generate(
                audio,
                task=job.task,
                language=job.language,
                initial_prompt=job.prompt,
                temperature=job.temperature,  # one value: no fallback passes
                word_timestamps=job.words,
                verbose=None,
            )
    elif loaded.parakeet:
        from mlxd.engine.transcription.parakeet import transcribe_parakeet

        transcript, tokens = transcribe_parakeet(loaded.model, audio, job)
        if so_far is not None:
            so_far.offer(transcript.text, final=True)
        return transcript, tokens
    else:
        out = loaded.model.generate(audio)
    segments: list[Segment] = []
    words: list[Word] = []
    tokens = 0
    for s in getattr(out, "segments", None) or []:
        seg_tokens = tuple(int(t) for t in s.get("tokens", ()))
        tokens += len(seg_tokens)
        segments.append(
            Segment(
                start=float(s.get("start", 0.0)),
                end=float(s.get("end", 0.0)),
                text=str(s.get("text", "")),
                tokens=seg_tokens,
                avg_logprob=float(s.get("avg_logprob", 0.0)),
                no_speech_prob=float(s.get("no_speech_prob", 0.0)),
                compression_ratio=float(s.get("compression_ratio", 0.0)),
                temperature=float(s.get("temperature", job.temperature)),
            )
        )
        for w in s.get("words", None) or []:
            words.append(Word(str(w["word"]), float(w["start"]), float(w["end"])))
    text = str(out.text).strip()
    if so_far is not None:
        so_far.offer(text, final=True)
    transcript = Transcript(
        text=text,
        language=str(getattr(out, "language", None) or job.language or ""),
        duration=job.seconds,
        task=job.task,
        segments=tuple(segments),
        words=tuple(words),
    )
    return transcript, tokens or int(getattr(out, "generation_tokens", 0) or 0)
