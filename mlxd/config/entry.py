"""A ``[models.<id>]`` table: one model of the registry and how it is served."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import Field, create_model

from mlxd.config.sections import (
    BatchSettings,
    LaneSettings,
    ModelSettings,
    PromptCacheSettings,
    SamplingSettings,
    Section,
    _field,
)
from mlxd.config.speculative import SpeculativeSettings
from mlxd.config.units import KeepAlive

# The sections an entry may override, by name.
OVERRIDABLE = {
    "batch": BatchSettings,
    "lanes": LaneSettings,
    "sampling": SamplingSettings,
    "prompt_cache": PromptCacheSettings,
    "speculative": SpeculativeSettings,
}


def _override(section: type[Section]) -> type[Section]:
    """``section`` with every key optional: the keys an entry sets, nothing else."""
    fields: dict[str, Any] = {}
    for name, info in section.model_fields.items():
        annotation = (
            Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        )
        fields[name] = (
            Optional[annotation],  # noqa: UP045 - a runtime type expression
            Field(None, description=info.description, json_schema_extra=info.json_schema_extra),
        )
    name = section.__name__.removesuffix("Settings") + "Override"
    return create_model(name, __base__=Section, **fields)


BatchOverride = _override(BatchSettings)
LaneOverride = _override(LaneSettings)
SamplingOverride = _override(SamplingSettings)
PromptCacheOverride = _override(PromptCacheSettings)
SpeculativeOverride = _override(SpeculativeSettings)


class ModelEntry(ModelSettings):
    """One ``[models.<id>]`` table: which model, and how it is served."""

    kind: Literal["chat", "embedding", "rerank", "transcription", "speech"] = _field(
        "chat",
        "swap",
        'What the model serves: "chat" (chat, completions, responses, messages), '
        '"embedding" (/v1/embeddings), "rerank" (/v1/rerank), "transcription" '
        "(/v1/audio/transcriptions and /translations, a Whisper or Parakeet model through "
        "mlx-audio) "
        'or "speech" (/v1/audio/speech, a text-to-speech model through mlx-audio).',
    )
    default: bool = _field(
        False, "live", "Serve requests that name no model (one default per kind)."
    )
    pin: bool = _field(
        False, "live", "Load at start and never unload (not for idleness, not for memory)."
    )
    keep_alive: KeepAlive = _field(
        "forever",
        "live",
        'Unload after this long without requests ("30m", "2h"); '
        '"forever" unloads only to make room.',
    )
    # The override classes are made by create_model() at import time: a type
    # checker sees variables, not classes, in these annotations (hence the ignores).
    batch: BatchOverride = _field(BatchOverride(), "live", "[batch] keys for this model alone.")  # type: ignore[valid-type]
    lanes: LaneOverride = _field(LaneOverride(), "live", "[lanes] keys for this model alone.")  # type: ignore[valid-type]
    sampling: SamplingOverride = _field(  # type: ignore[valid-type]
        SamplingOverride(), "live", "[sampling] keys for this model alone."
    )
    prompt_cache: PromptCacheOverride = _field(  # type: ignore[valid-type]
        PromptCacheOverride(), "live", "[prompt_cache] keys for this model alone."
    )
    speculative: SpeculativeOverride = _field(  # type: ignore[valid-type]
        SpeculativeOverride(), "live", "[speculative] keys for this model alone."
    )
