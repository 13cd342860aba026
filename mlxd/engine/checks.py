"""Checks of a request's values against the model that will serve it (pure).

Every token id a request carries must index the model's vocabulary before
it reaches MLX (an out-of-range ``logit_bias`` key used to crash the whole
process), and a prompt that certainly cannot fit the context is refused
before anyone spends time tokenizing it. The HTTP side runs these checks
against :class:`~mlxd.engine.messages.ModelInfo` before queueing; intake runs
them again on the engine's side, since a model swap may change the vocabulary.
"""

from __future__ import annotations

from mlxd.engine.messages import (
    ChatPrompt,
    ErrorCode,
    GenerationRequest,
    ModelInfo,
    TextPrompt,
    TokenPrompt,
)


class IntakeError(ValueError):
    """A request the model cannot take; answered with a 400."""

    def __init__(
        self, message: str, *, code: ErrorCode = "invalid_request", param: str | None = None
    ):
        super().__init__(message)
        self.code: ErrorCode = code
        self.param = param


def _content_chars(content: object) -> int:
    if isinstance(content, list):  # text and image parts: the text counts
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return len(content) if isinstance(content, str) else 0


def prompt_chars(request: GenerationRequest) -> int:
    """Characters of text in the prompt (0 for token ids)."""
    prompt = request.prompt
    if isinstance(prompt, TextPrompt):
        return len(prompt.text)
    if isinstance(prompt, ChatPrompt):
        return sum(_content_chars(m.get("content")) for m in prompt.messages)
    return 0


def check_request(request: GenerationRequest, info: ModelInfo) -> None:
    """Check ``request``'s token ids and size against the model described by ``info``.

    Raises:
        IntakeError: a token id outside ``[0, vocab_size)``, a ``top_k``
            larger than the vocabulary, or a prompt with more characters than
            the context can hold in tokens.
    """
    vocab = info.vocab_size
    if vocab > 0:
        bad = [t for t, _ in request.penalties.logit_bias if not 0 <= t < vocab]
        if bad:
            raise IntakeError(
                f"logit_bias has token ids outside this model's vocabulary of {vocab} "
                f"(ids 0 to {vocab - 1}): {bad[:5]}",
                code="invalid_value",
                param="logit_bias",
            )
        if isinstance(request.prompt, TokenPrompt):
            bad = [t for t in request.prompt.ids if not 0 <= t < vocab]
            if bad:
                raise IntakeError(
                    f"token ids out of range for a vocabulary of {vocab}: {bad[:5]}",
                    code="invalid_value",
                    param="prompt",
                )
        if request.sampling.top_k > vocab:
            raise IntakeError(
                f"'top_k' is {request.sampling.top_k}, more than this model's vocabulary "
                f"of {vocab}; use 0 to disable top-k.",
                code="invalid_value",
                param="top_k",
            )
    ctx = info.context_length
    if isinstance(request.prompt, TokenPrompt) and len(request.prompt.ids) >= ctx:
        raise context_exceeded(ctx, f"{len(request.prompt.ids)} tokens", "prompt")
    if info.max_token_chars > 0:
        chars = prompt_chars(request)
        if chars > ctx * info.max_token_chars:
            param = "messages" if isinstance(request.prompt, ChatPrompt) else "prompt"
            raise context_exceeded(ctx, f"{chars} characters, certainly more tokens", param)


def context_exceeded(ctx: int, size: str, param: str) -> IntakeError:
    return IntakeError(
        f"This model's maximum context length is {ctx} tokens. However, your prompt is "
        f"{size}, which leaves no room to generate.",
        code="context_length_exceeded",
        param=param,
    )
