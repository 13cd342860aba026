"""A speech request's voice, format and speed against what the model and mlxd have (pure).

OpenAI's voices (``alloy``, ``ash``, ... ``verse``) are names of its own
speakers: a local model has other voices or none. A model with voices takes
one of its own names; any other is a 400 that lists them. A model without
voices speaks in its one voice whatever the request names (the route says
the voice was ignored).
"""

from __future__ import annotations

# OpenAI's bounds on speed.
MIN_SPEED = 0.25
MAX_SPEED = 4.0
# Most voice names a refusal lists.
_LISTED = 60


def voice_refusal(voice: str | None, voices: tuple[str, ...], model_id: str) -> str | None:
    """Why ``voice`` cannot be asked of a model with ``voices`` (None when it can)."""
    if voice is None or not voices or voice in voices:
        return None
    shown = ", ".join(voices[:_LISTED]) + (", ..." if len(voices) > _LISTED else "")
    return (
        f"The model '{model_id}' has no voice {voice[:80]!r}; its voices are: {shown}. "
        "(OpenAI's voice names are its own speakers, not this model's.)"
    )


def speed_refusal(speed: float) -> str | None:
    """Why ``speed`` is out of OpenAI's range (None when it is in)."""
    if MIN_SPEED <= speed <= MAX_SPEED:
        return None
    return f"'speed' must be between {MIN_SPEED} and {MAX_SPEED}, got {speed}."
