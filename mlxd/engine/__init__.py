"""The engine's face: the names the HTTP side and the dashboard may import.

Everything here is a plain value, a pure check or a refusal; importing it
loads no MLX (``tests/unit/test_layers.py`` holds that). The engines
themselves (:class:`~mlxd.engine.chat.engine.Engine`,
:class:`~mlxd.engine.fleet.fleet.Fleet`) are built by the composition root,
:mod:`mlxd.server`; the web side only sees the fleet through the names below
and, for type annotations alone, the classes under ``TYPE_CHECKING``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlxd.engine.audio.decode import AudioError, Decoded, decode_audio
from mlxd.engine.audio.encode import FORMATS as SPEECH_FORMATS
from mlxd.engine.audio.encode import MEDIA_TYPES as SPEECH_MEDIA_TYPES
from mlxd.engine.audio.encode import EncoderUnavailable
from mlxd.engine.audio.encode import check_format as check_speech_format
from mlxd.engine.audio.transcript import FORMATS as TRANSCRIPT_FORMATS
from mlxd.engine.audio.transcript import GRANULARITIES as TRANSCRIPT_GRANULARITIES
from mlxd.engine.audio.transcript import Transcript
from mlxd.engine.audio.transcript import render as render_transcript
from mlxd.engine.channel import RequestHandle
from mlxd.engine.checks import IntakeError, check_request
from mlxd.engine.cluster_status import ClusterStatus
from mlxd.engine.constraints import (
    TOOL_GRAMMAR_FORMATS,
    StructureError,
    check_constraint,
    json_constraint,
    tool_constraint,
    validate_constraint,
)
from mlxd.engine.custom_tools import custom_constraint, custom_grammar, template_tool
from mlxd.engine.embeddings.checks import check_inputs as check_embedding_inputs
from mlxd.engine.embeddings.messages import (
    EmbeddingError,
    EmbeddingInfo,
    EmbeddingResult,
    EmbeddingSnapshot,
)
from mlxd.engine.fleet.slot import Lease
from mlxd.engine.fleet.values import STATES as MODEL_STATES
from mlxd.engine.fleet.values import FleetEvent, FleetRefusal, FleetStatus, ModelState
from mlxd.engine.images import IMAGE_PART, ImageError, ImageLimits, ImagePart
from mlxd.engine.images import count_check as check_image_count
from mlxd.engine.images import from_base64 as image_from_base64
from mlxd.engine.images import from_bytes as image_from_bytes
from mlxd.engine.images import from_data_url as image_from_data_url
from mlxd.engine.messages import (
    Accepted,
    Admitted,
    Api,
    CacheLookup,
    CacheSource,
    ChatPrompt,
    Constraint,
    CustomTool,
    Delta,
    ErrorCode,
    Event,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    ModelInfo,
    PenaltyParams,
    Priority,
    Prompt,
    SamplingParams,
    TextPrompt,
    TokenLogprob,
    TokenPrompt,
    ToolCall,
    ToolCallPart,
    TopLogprob,
    Usage,
)
from mlxd.engine.policy.lanes import LaneDecision
from mlxd.engine.policy.priority import CLASSES as PRIORITY_CLASSES
from mlxd.engine.policy.priority import capped as capped_priority
from mlxd.engine.rerank.pairs import pair_texts as rerank_pair_texts
from mlxd.engine.snapshot import RecentLookup, Snapshot
from mlxd.engine.speech.messages import SpeechAudio, SpeechDone, SpeechJob, SpeechStarted
from mlxd.engine.speech.voices import speed_refusal, voice_refusal
from mlxd.engine.transcription.messages import TranscriptionJob

if TYPE_CHECKING:
    from mlxd.engine.chat.engine import Engine
    from mlxd.engine.fleet.fleet import Fleet

__all__ = [
    "IMAGE_PART",
    "MODEL_STATES",
    "PRIORITY_CLASSES",
    "SPEECH_FORMATS",
    "SPEECH_MEDIA_TYPES",
    "TOOL_GRAMMAR_FORMATS",
    "TRANSCRIPT_FORMATS",
    "TRANSCRIPT_GRANULARITIES",
    "Accepted",
    "Admitted",
    "Api",
    "AudioError",
    "CacheLookup",
    "CacheSource",
    "ChatPrompt",
    "ClusterStatus",
    "Constraint",
    "CustomTool",
    "Decoded",
    "Delta",
    "EmbeddingError",
    "EmbeddingInfo",
    "EmbeddingResult",
    "EmbeddingSnapshot",
    "EncoderUnavailable",
    "Engine",
    "ErrorCode",
    "Event",
    "Failed",
    "FinishReason",
    "Finished",
    "Fleet",
    "FleetEvent",
    "FleetRefusal",
    "FleetStatus",
    "GenerationRequest",
    "ImageError",
    "ImageLimits",
    "ImagePart",
    "IntakeError",
    "LaneDecision",
    "Lease",
    "ModelInfo",
    "ModelState",
    "PenaltyParams",
    "Priority",
    "Prompt",
    "RecentLookup",
    "RequestHandle",
    "SamplingParams",
    "Snapshot",
    "SpeechAudio",
    "SpeechDone",
    "SpeechJob",
    "SpeechStarted",
    "StructureError",
    "TextPrompt",
    "TokenLogprob",
    "TokenPrompt",
    "ToolCall",
    "ToolCallPart",
    "TopLogprob",
    "Transcript",
    "TranscriptionJob",
    "Usage",
    "capped_priority",
    "check_constraint",
    "check_embedding_inputs",
    "check_image_count",
    "check_request",
    "check_speech_format",
    "custom_constraint",
    "custom_grammar",
    "decode_audio",
    "image_from_base64",
    "image_from_bytes",
    "image_from_data_url",
    "json_constraint",
    "render_transcript",
    "rerank_pair_texts",
    "speed_refusal",
    "template_tool",
    "tool_constraint",
    "validate_constraint",
    "voice_refusal",
]
