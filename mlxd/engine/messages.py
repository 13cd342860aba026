"""The values that cross between the HTTP side and the engine thread.

Plain frozen dataclasses, no logic and no MLX: requests go in, events come
out through a per-request channel. Errors cross as values
(:class:`Failed`), never as raised exceptions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mlxd.engine.deltas import Delta as Delta
from mlxd.engine.deltas import TokenLogprob as TokenLogprob
from mlxd.engine.deltas import ToolCall as ToolCall
from mlxd.engine.deltas import ToolCallPart as ToolCallPart
from mlxd.engine.deltas import TopLogprob as TopLogprob
from mlxd.engine.images import ImagePart

Lane = Literal["batch", "serial"]
# Which HTTP API a request came in through (shown in /stats and the dashboard).
Api = Literal["chat", "completions", "responses", "messages"]
# A request's priority class, most urgent first (docs/batching.md).
Priority = Literal["high", "normal", "low", "batch"]
FinishReason = Literal["stop", "length", "tool_calls"]
# Where a request's cached prompt prefix came from: the RAM tier, the disk tier,
# nowhere (a miss), or nowhere because the model's prompt cache is off.
CacheSource = Literal["ram", "disk", "none", "off"]


@dataclass(frozen=True)
class ChatPrompt:
    """Chat messages, rendered with the model's chat template on intake.

    ``tools`` are function definitions in the Hugging Face template shape
    (``{"type": "function", "function": {name, description, parameters}}``),
    passed to the template as ``tools=``; ``template_kwargs`` are extra
    template variables (``chat_template_kwargs``, e.g. ``enable_thinking``).
    Assistant messages may carry ``tool_calls`` and ``tool`` messages a
    ``tool_call_id``, in the same shape.

    A message with images has a content LIST of ``{"type": "text", "text": ...}``
    and ``{"type": "image", "image": i}`` parts, ``i`` indexing ``images`` (the
    images in prompt order, checked against the limits by the HTTP side).
    """

    messages: tuple[dict, ...]
    tools: tuple[dict, ...] = ()
    template_kwargs: tuple[tuple[str, object], ...] = ()
    images: tuple[ImagePart, ...] = ()


@dataclass(frozen=True)
class TextPrompt:
    """A raw completion prompt, tokenized as-is (special tokens parsed)."""

    text: str


@dataclass(frozen=True)
class TokenPrompt:
    """A completion prompt given as token ids."""

    ids: tuple[int, ...]


Prompt = ChatPrompt | TextPrompt | TokenPrompt


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None


@dataclass(frozen=True)
class PenaltyParams:
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def has_penalties(self) -> bool:
        return any(
            p not in (None, 0.0) for p in (self.presence_penalty, self.frequency_penalty)
        ) or self.repetition_penalty not in (None, 1.0)


@dataclass(frozen=True)
class Constraint:
    """A grammar the row's tokens must follow (llguidance's JSON grammar format).

    Built and checked before the request is queued (``mlxd.engine.constraints``);
    ``key`` hashes the grammar and keys the compiled-grammar cache. ``kind``
    is what ``/stats`` shows: ``json`` (response_format) or ``tools`` (an
    enforced tool call, whose grammar is in the model's ``tool_format``) or
    ``custom`` (a forced custom tool: the answer is its input, in its grammar).
    """

    kind: Literal["json", "tools", "custom"]
    grammar: str
    key: str
    tool_format: str | None = None
    # kind "custom": the custom tool whose input is the row's whole answer
    # (a forced freeform call, mlxd.engine.custom_tools).
    tool: str | None = None
    # The JSON Schemas inside the grammar, each with the parameter that named
    # it, for the checks before compiling (``constraints.check_constraint``);
    # never read by the engine, and not part of the grammar's identity.
    schemas: tuple[tuple[str, Any], ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class CustomTool:
    """A custom (freeform) tool: its input is one string, shaped by ``grammar`` if any.

    The model sees it as a function taking one string parameter, ``input``;
    ``grammar`` is llguidance grammar text (from the tool's Lark or regex
    format), None for the ``text`` format (any string).
    """

    name: str
    grammar: str | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One generation, as the engine receives it.

    ``max_tokens`` ``None`` means "until the context is full"; the engine
    clamps any value to the room left in the context.
    """

    id: str
    prompt: Prompt
    max_tokens: int | None
    sampling: SamplingParams = SamplingParams()
    penalties: PenaltyParams = PenaltyParams()
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    api: Api = "chat"
    # Split tool calls out of the output with the model's tool parser.
    parse_tools: bool = False
    constraint: Constraint | None = None
    # The request's custom tools: a call to one carries its ``input`` (checked
    # against its grammar), not JSON arguments.
    custom_tools: tuple[CustomTool, ...] = ()
    # The most tokens the model may think for before its end-of-thinking
    # marker is forced (mlxd.engine.chat.reasoning_budget); None: no cap.
    reasoning_budget: int | None = None
    # Test-only fault injection (see docs/testing.md); ignored unless the
    # engine was built with fault injection enabled.
    fault: str | None = None
    # The prompt rules the HTTP side applied to this request's prompt (the
    # names of [prompt_cache] volatile_rules that matched); the engine counts them.
    prompt_rules: tuple[str, ...] = ()
    # How many tools the HTTP side left out because the model cannot call
    # tools (tool_choice auto or absent); said in a header and the log line.
    tools_ignored: int = 0
    # The max_tokens the client asked for when it was above [limits] max_tokens
    # (clamped to it; said in X-Mlxd-Max-Tokens), else None.
    max_tokens_asked: int | None = None
    # Who asks and how urgently (issue 23): the priority class the scheduler
    # orders waiting requests by ("batch" is the Batch API's idle-time class),
    # and the NAME of the API key that sent it (never the secret), or None.
    priority: Priority = "normal"
    client: str | None = None


# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class Accepted:
    """The engine tokenized the request and chose its lane."""

    lane: Lane
    reason: str
    prompt_tokens: int
    model: str


@dataclass(frozen=True)
class CacheLookup:
    """What the prompt-cache lookup of one admitted request found (docs/design.md).

    Made on the engine thread when the request is admitted (the moment its
    prefix is taken from the cache and its prefill starts), so it is the
    truth the usage fields report, not a prediction.

    - ``prompt_tokens``: the prompt's length in tokens.
    - ``cached_tokens``: prompt tokens served from a stored prefix (never
      prefilled); at most ``prompt_tokens - 1``, since the last prompt token is
      always run to produce the first sampled token.
    - ``source``: where those tokens came from: ``ram``, ``disk``; ``none``
      on a miss (``cached_tokens == 0``); ``off`` when the model's prompt
      cache is disabled (``[prompt_cache] max_entries = 0``).
    - ``diverged_at``: the token index where the prompt leaves the nearest
      stored sequence (the stored prefix, RAM or disk, that shares the
      longest run of leading tokens with it): ``0`` when nothing stored shares
      even the first token (an empty cache included); ``None`` on a full hit
      (everything but the last token served) and when the cache is off. It can exceed
      ``cached_tokens``: a recurrent or sliding-window cache resumes only
      from a checkpoint at or before the divergence.
    - ``stored``: entries stored for this model when the lookup ran (RAM and
      disk together), so "nothing was cached yet" reads apart from "the
      prompt changed".
    - ``before`` / ``after``: about 60 characters of decoded prompt text on
      each side of ``diverged_at`` (empty when it is ``None``). Prompt text:
      show it to admins only.
    """

    prompt_tokens: int
    cached_tokens: int
    source: CacheSource
    diverged_at: int | None
    stored: int = 0
    before: str = ""
    after: str = ""


@dataclass(frozen=True)
class Admitted:
    """The request left its queue: its prompt-cache lookup is done and its prefill starts.

    Sent once per accepted request, after :class:`Accepted` and before its
    first :class:`Delta` (a request cancelled or failed while queued gets a
    :class:`Failed` instead). A streaming handler that wants the cached
    count in its headers waits for it; :class:`Finished` carries the same
    lookup for everyone else.
    """

    lookup: CacheLookup


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Of completion_tokens, those generated inside the think markers.
    reasoning_tokens: int = 0


@dataclass(frozen=True)
class Timings:
    """Seconds; ``None`` when the phase never happened."""

    queue_s: float
    prefill_s: float | None
    decode_s: float | None
    ttft_s: float | None
    total_s: float


@dataclass(frozen=True)
class Finished:
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    # The stop string that ended generation, when one did (Anthropic reports it).
    stop_sequence: str | None = None
    # The prompt-cache lookup made at admission (the same value Admitted carried).
    lookup: CacheLookup | None = None


ErrorCode = Literal[
    "context_length_exceeded",
    "context_over_budget",
    "queue_full",
    "shutting_down",
    "model_not_loaded",
    "cancelled",
    "generation_error",
    "invalid_request",
    # An image part that cannot be taken (undecodable, over a limit, or a text model's).
    "invalid_image",
    # A tool_choice the model's tool-call format has no grammar for (StructureError).
    "tool_format_unsupported",
    "invalid_schema",
    # A schema beyond the structured-output limits (mlxd.engine.schema_limits).
    "schema_too_complex",
    "tools_unsupported",
    "invalid_value",
    "peer_lost",
    # The fleet's refusals (routing, loading, memory, admin).
    "model_not_found",
    "model_kind_mismatch",
    "model_load_failed",
    "model_too_large",
    "model_pinned",
    # An embedding model's.
    "unsupported_parameter",
    "embedding_error",
]


@dataclass(frozen=True)
class Failed:
    """The request failed; ``status`` is the HTTP status to answer with."""

    code: ErrorCode
    message: str
    status: int
    retry_after: int | None = None
    param: str | None = None


Event = Accepted | Admitted | Delta | Finished | Failed


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP side may know about the loaded model."""

    id: str
    path: str
    family: str
    context_length: int
    created: int
    batchable: bool
    cache_kinds: tuple[str, ...] = field(default_factory=tuple)
    # Token ids a request may carry are in [0, vocab_size).
    vocab_size: int = 0
    # Most characters one token stands for; 0 when unknown (no cheap bound).
    max_token_chars: int = 0
    dtype: str = ""  # "float32", "bfloat16", "4-bit (group 64)"
    weights_bytes: int = 0
    # mlx-lm's tool parser module for this tokenizer (json_tools, mistral, ...),
    # None when the model has no tool calling.
    tool_format: str | None = None
    # The model's think markers, when it has them.
    reasoning: bool = False
    # llguidance could read the tokenizer: response_format and forced calls work.
    structured_output: bool = False
    # A vision-language model (loaded through mlx-vlm): chat prompts may hold images.
    vision: bool = False
