"""Turning a request's prompt into tokens and checking it, with the model that will run it.

:func:`prepare` runs on the engine's intake thread
(:mod:`mlxd.engine.chat.intake_thread`), so the engine thread never waits
for a tokenizer; it is the tokenizer plus pure checks, no MLX. A request is
still tokenized by the model that serves it: the engine thread hands it over
with the model of the moment and prepares it again, on the engine thread,
when that model was swapped out meanwhile; a swap prepares what is queued
again (docs/design.md, "Where tokenizing happens").
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from mlxd.config import Settings
from mlxd.engine.chat import checkpoints, image_cost
from mlxd.engine.chat.grammar import ConstraintProcessor, GrammarError
from mlxd.engine.chat.loading import LoadedModel
from mlxd.engine.chat.output import initial_phase
from mlxd.engine.chat.reasoning_budget import make_budget
from mlxd.engine.chat.vision_intake import ImageSet, tokenize_images
from mlxd.engine.checks import IntakeError, check_request
from mlxd.engine.messages import (
    ChatPrompt,
    Constraint,
    Failed,
    GenerationRequest,
    TextPrompt,
    TokenPrompt,
)
from mlxd.engine.policy import admission
from mlxd.engine.policy.admission import RowExtent
from mlxd.engine.policy.budget import KvRoom
from mlxd.engine.policy.lanes import LaneDecision, decide


def _plain_chat(messages: tuple[dict, ...]) -> str:
    # For models without a chat template, the same fallback mlx-lm uses.
    lines = [f"{m['role']}: {m.get('content') or ''}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


def encode(tokenizer: Any, text: str, *, special: bool) -> list[int]:
    """``text``'s token ids, as ``tokenizer.encode(text, add_special_tokens=special)``.

    For Hugging Face's own fast tokenizers this calls the Rust backend
    directly: it encodes without holding the GIL, and skips transformers'
    Python post-processing, which holds the GIL for a long while on a long
    prompt (the engine thread needs the GIL between its MLX calls). Wrappers
    that preprocess text in Python (mlx-lm's NewlineTokenizer, slow
    tokenizers) take the ordinary path.
    """
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None and type(hf).__module__.startswith("transformers."):
        return backend.encode_batch([text], add_special_tokens=special)[0].ids
    return list(hf.encode(text, add_special_tokens=special))


def render(
    tokenizer: Any, prompt: ChatPrompt, messages: tuple[dict, ...], *, generation: bool
) -> str:
    """``messages`` through the chat template, with ``prompt``'s tools and template variables."""
    kwargs = dict(prompt.template_kwargs)
    if prompt.tools:
        kwargs["tools"] = [dict(t) for t in prompt.tools]
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=generation, **kwargs
    )


def tokenize(loaded: LoadedModel, request: GenerationRequest) -> list[int]:
    """The prompt's token ids (see :func:`tokenize_with_images`)."""
    return tokenize_with_images(loaded, request)[0]


def tokenize_with_images(
    loaded: LoadedModel, request: GenerationRequest
) -> tuple[list[int], ImageSet | None]:
    """The prompt's token ids, and its images when it has any.

    Raises:
        IntakeError: the chat template rejects the messages, the prompt
            is empty, or it holds images the model cannot take (a text
            model) or that cannot be decoded. Token ids are checked before,
            by ``check_request``.
    """
    tokenizer = loaded.tokenizer
    prompt = request.prompt
    if isinstance(prompt, ChatPrompt) and prompt.images:
        if loaded.vision is None:
            where = prompt.images[0].where
            raise IntakeError(
                f"{where}: the model '{loaded.info.id}' does not take images (it is not a "
                "vision-language model); send text only, or ask a vision model",
                code="invalid_image",
                param=where,
            )
        ids, images = tokenize_images(loaded.vision, tokenizer, prompt)
        if not ids:
            raise IntakeError("the prompt is empty after tokenization", param="prompt")
        return ids, images
    if isinstance(prompt, ChatPrompt):
        if tokenizer.has_chat_template:
            try:
                text = render(tokenizer, prompt, prompt.messages, generation=True)
            except Exception as exc:  # jinja2 TemplateError and friends
                raise IntakeError(
                    f"the model's chat template rejected these messages: {exc}", param="messages"
                ) from exc
            try:
                ids = encode(tokenizer, text, special=False)
            except Exception as exc:
                raise IntakeError(
                    f"the messages cannot be tokenized: {exc}", param="messages"
                ) from exc
        else:
            try:
                ids = encode(tokenizer, _plain_chat(prompt.messages), special=True)
            except Exception as exc:
                raise IntakeError(
                    f"the messages cannot be tokenized: {exc}", param="messages"
                ) from exc
    elif isinstance(prompt, TextPrompt):
        try:
            ids = encode(tokenizer, prompt.text, special=True)
        except Exception as exc:  # text the tokenizer cannot take
            raise IntakeError(f"the prompt cannot be tokenized: {exc}", param="prompt") from exc
    elif isinstance(prompt, TokenPrompt):
        ids = list(prompt.ids)  # checked against the vocabulary by check_request
    else:  # pragma: no cover - the API only builds the three kinds
        raise IntakeError(f"unknown prompt kind {type(prompt).__name__}")
    ids = list(ids)
    if not ids:
        raise IntakeError("the prompt is empty after tokenization", param="prompt")
    return ids, None


@dataclass(frozen=True)
class Prepared:
    """A request that passed intake: its tokens, effective max_tokens, lane and projection."""

    prompt: list[int]
    max_tokens: int
    decision: LaneDecision
    extent: RowExtent
    # Where the output starts: "reasoning" when the prompt opened a think block.
    phase: str = "normal"
    # The row's grammar and thinking budget, as one logits processor
    # (mlxd.engine.chat.grammar, mlxd.engine.chat.reasoning_budget).
    constraint: Any = None
    # Where the system prefix and the reusable prompt end (mlxd.engine.chat.checkpoints).
    system_end: int | None = None
    prompt_end: int | None = None
    # The prompt's images, for the vision tower (mlxd.engine.chat.vision).
    images: ImageSet | None = None


def check_tools(loaded: LoadedModel, request: GenerationRequest) -> Failed | None:
    """Tools need the model's tool parser; an enforced call needs its format."""
    tool_format = loaded.info.tool_format
    wants = request.parse_tools or (
        request.constraint is not None and request.constraint.kind == "tools"
    )
    if wants and tool_format is None:
        return Failed(
            "tools_unsupported",
            f"The model '{loaded.info.id}' has no tool-call parser, so it cannot take "
            "'tools' (send tool_choice 'none', or serve a model with tool calling).",
            400,
            param="tools",
        )
    c = request.constraint
    if c is not None and c.kind == "tools" and c.tool_format != tool_format:
        return Failed(
            "tools_unsupported",
            f"This request's tool grammar was built for the {c.tool_format} format, but the "
            f"model '{loaded.info.id}' uses {tool_format}; send it again.",
            400,
            param="tool_choice",
        )
    return None


def prepare(
    loaded: LoadedModel, request: GenerationRequest, settings: Settings, room: KvRoom
) -> Prepared | Failed:
    """Tokenize and check a request against the model's context and the KV budget.

    Thread-safe with respect to the engine: it reads ``loaded`` and calls
    the tokenizer, and creates no MLX state, so the engine runs it on its
    intake thread (see :mod:`mlxd.engine.chat.engine`).

    ``max_tokens`` is clamped to the room left in the context. A prompt that
    leaves no room, or a request whose KV projection alone exceeds the budget
    (it could never be admitted), is refused with a 400 that says why.
    """
    refused = check_tools(loaded, request)
    if refused is not None:
        return refused
    refused = costly_images(loaded, request, settings, room)
    if refused is not None:
        return refused
    try:
        check_request(request, loaded.info)
        prompt, images = tokenize_with_images(loaded, request)
    except IntakeError as exc:
        return Failed(exc.code, str(exc), 400, param=exc.param)
    ctx = loaded.info.context_length
    if len(prompt) >= ctx:
        return Failed(
            "context_length_exceeded",
            f"This model's maximum context length is {ctx} tokens. However, your prompt is "
            f"{len(prompt)} tokens, which leaves no room to generate.",
            400,
            param="messages",
        )
    max_tokens = min(request.max_tokens or ctx, ctx - len(prompt))
    batch = settings.batch
    extent = admission.row_extent(len(prompt), max_tokens, batch.decode_allowance)
    alone = admission.never_fits(loaded.layout, extent, room.bytes, batch.prefill_step_size)
    if alone is not None:
        what = f"This request ({len(prompt)} prompt tokens + {extent.decode} to generate)"
        return Failed("context_over_budget", room.over(alone, what), 400)
    decision = decide(request, batch.size, settings.lanes, loaded.capabilities)
    chat = isinstance(request.prompt, ChatPrompt)
    phase = initial_phase(loaded.tokenizer, prompt) if chat else "normal"
    processor = None
    if request.constraint is not None:
        processor = constraint_processor(loaded, request.constraint, phase)
        if isinstance(processor, Failed):
            return processor
    if chat:
        processor = make_budget(loaded.tokenizer, request.reasoning_budget, phase, processor)
    system_end, prompt_end = None, len(prompt) - 1
    if isinstance(request.prompt, ChatPrompt):
        system_end = system_prefix_end(loaded, request.prompt, prompt)
        prompt_end = checkpoints.prompt_end(loaded.tokenizer, prompt)
    return Prepared(
        prompt, max_tokens, decision, extent, phase, processor, system_end, prompt_end, images
    )


def costly_images(
    loaded: LoadedModel, request: GenerationRequest, settings: Settings, room: KvRoom
) -> Failed | None:
    """Images that would cost too much once resized, refused from their headers alone."""
    prompt = request.prompt
    if not (isinstance(prompt, ChatPrompt) and prompt.images and loaded.vision is not None):
        return None
    return image_cost.refusal(
        loaded.vision.processor,
        prompt.images,
        max_pixels=settings.limits.image_pixels,
        context_length=loaded.info.context_length,
        layout=loaded.layout,
        room=room,
        decode_allowance=settings.batch.decode_allowance,
        prefill_step_size=settings.batch.prefill_step_size,
    )


_SYSTEM_ROLES = ("system", "developer")


def system_prefix_end(loaded: LoadedModel, prompt: ChatPrompt, ids: list[int]) -> int | None:
    """Where the system/developer messages and the tool schemas end in ``ids``, or None.

    The template renders them followed by an empty user message, as
    mlx_lm.server does; the tokens both renderings share are the prefix every
    conversation with these instructions and tools starts with. A template
    that refuses that rendering just gets no such checkpoint.
    """
    tokenizer = loaded.tokenizer
    leading = 0
    for message in prompt.messages:
        if message.get("role") not in _SYSTEM_ROLES:
            break
        leading += 1
    if not tokenizer.has_chat_template or (leading == 0 and not prompt.tools):
        return None
    messages = (*prompt.messages[:leading], {"role": "user", "content": ""})
    try:
        text = render(tokenizer, prompt, messages, generation=False)
        system_ids = _SYSTEM_IDS.get(tokenizer, text)
        if system_ids is None:
            system_ids = encode(tokenizer, text, special=False)
            _SYSTEM_IDS.put(tokenizer, text, system_ids)
    except Exception:  # the template wants more than a system part: no checkpoint there
        return None
    return checkpoints.system_end(ids, system_ids)


class _Tokenized:
    """The last few system parts' token ids: an agent resends the same one every turn.

    Tokenizing a 30k-token system prompt a second time costs as much as the
    prompt itself (about 0.3 s on a 2-core x86 box); rendering it and looking
    it up costs milliseconds. Shared by the intake thread and the engine
    thread (a swap prepares queued requests again), hence the lock.
    """

    def __init__(self, size: int):
        self._size = size
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[weakref.ref[Any], list[int]]] = OrderedDict()

    def get(self, tokenizer: Any, text: str) -> list[int] | None:
        with self._lock:
            found = self._entries.get(text)
            if found is None or found[0]() is not tokenizer:
                return None
            self._entries.move_to_end(text)
            return found[1]

    def put(self, tokenizer: Any, text: str, ids: list[int]) -> None:
        with self._lock:
            self._entries[text] = (weakref.ref(tokenizer), ids)
            self._entries.move_to_end(text)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)


_SYSTEM_IDS = _Tokenized(16)


def constraint_processor(loaded: LoadedModel, constraint: Constraint, phase: str) -> Any:
    """The row's grammar matcher as a logits processor, or a 400 saying why not."""
    if loaded.grammars is None:
        return Failed(
            "invalid_request",
            f"Structured output is not available for the model '{loaded.info.id}' "
            "(llguidance could not read its tokenizer).",
            400,
            param="response_format",
        )
    try:
        matcher = loaded.grammars.matcher(constraint)
    except GrammarError as exc:
        return Failed("invalid_schema", f"The grammar cannot be compiled: {exc}", 400)
    tok = loaded.tokenizer
    think_end = tok.think_end_tokens if getattr(tok, "has_thinking", False) else None
    return ConstraintProcessor(
        matcher,
        think_end=think_end,
        reasoning=phase == "reasoning",
        vocab=loaded.grammars.tokenizer.vocab_size,
    )
