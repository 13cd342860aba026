"""Checks of an embedding request's inputs against the model that will embed them (pure).

The HTTP side runs :func:`check_inputs` before queueing, and the engine runs it
again on submit (a library caller skips the HTTP side). Nothing here tokenizes:
an input that certainly cannot fit is refused by its size alone, so a hostile
multi-megabyte string never reaches the tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mlxd.engine.embeddings.messages import EmbeddingError, EmbeddingInfo
from mlxd.engine.messages import ErrorCode

# OpenAI's own bound on the inputs of one request.
MAX_INPUTS = 2048

Inputs = Sequence[str] | Sequence[Sequence[int]]


def _bad(
    message: str, *, code: ErrorCode = "invalid_value", param: str = "input"
) -> EmbeddingError:
    return EmbeddingError(400, message, code=code, param=param)


def too_long(index: int, size: str, context: int) -> EmbeddingError:
    """The ``context_length_exceeded`` refusal for input ``index``."""
    return _bad(
        f"Input {index} is {size}; this model takes at most {context} tokens per input "
        "(special tokens included). Split the text into smaller pieces.",
        code="context_length_exceeded",
    )


def check_inputs(inputs: Inputs, info: EmbeddingInfo, dimensions: int | None) -> None:
    """Refuse inputs and ``dimensions`` the model described by ``info`` cannot take.

    Raises:
        EmbeddingError: (400) no inputs, more than :data:`MAX_INPUTS`, an empty
            input, a mix of texts and token lists, a token id outside
            ``[0, vocab_size)``, an input longer than the context (token lists
            by their length, texts by ``context_length * max_token_chars``
            non-space characters), or a ``dimensions`` the model cannot give.
    """
    check_dimensions(dimensions, info)
    if not inputs:
        raise _bad("'input' must not be empty.")
    if len(inputs) > MAX_INPUTS:
        raise _bad(f"'input' has {len(inputs)} items; at most {MAX_INPUTS} per request.")
    texts = isinstance(inputs[0], str)
    context, vocab = info.context_length, info.vocab_size
    for index, item in enumerate(inputs):
        if isinstance(item, str) != texts:
            raise _bad("'input' must be all strings or all token-id lists, not a mix.")
        if not item:
            raise _bad(f"Input {index} is empty; every input needs at least one token.")
        if isinstance(item, str):
            check_text_size(index, item, info)
            continue
        if len(item) > context:
            raise too_long(index, f"{len(item)} tokens", context)
        ids = np.asarray(item)
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise _bad(f"Input {index} must be a list of integer token ids.")
        if vocab > 0 and (ids.min() < 0 or ids.max() >= vocab):
            bad = [int(t) for t in ids[(ids < 0) | (ids >= vocab)][:5]]
            raise _bad(
                f"Input {index} has token ids outside this model's vocabulary of {vocab} "
                f"(ids 0 to {vocab - 1}): {bad}"
            )


def check_text_size(index: int, text: str, info: EmbeddingInfo) -> None:
    """Refuse a text that certainly has more tokens than the context, without tokenizing it.

    Whitespace may vanish in tokenizing, so only non-space characters count
    against ``context * max_token_chars``; with a WordPiece tokenizer, every
    word is at least one token.
    """
    context = info.context_length
    bound = context * info.max_token_chars
    if info.max_token_chars and len(text) > bound:
        chars = len("".join(text.split()))
        if chars > bound:
            raise too_long(index, f"{chars} characters, certainly more tokens", context)
    if info.min_token_per_word and len(text) > 2 * context:
        words = len(text.split())
        if words > context:
            raise too_long(index, f"{words} words, certainly more tokens", context)


def check_dimensions(dimensions: int | None, info: EmbeddingInfo) -> None:
    """``dimensions`` must be in ``[1, info.dimensions]`` on a model that allows truncation."""
    if dimensions is None:
        return
    if not info.supports_dimensions:
        raise _bad(
            f"The model '{info.id}' was not trained for truncated vectors, so 'dimensions' "
            f"is not supported; it always returns {info.dimensions} dimensions.",
            code="unsupported_parameter",
            param="dimensions",
        )
    if not 1 <= dimensions <= info.dimensions:
        raise _bad(
            f"'dimensions' must be between 1 and {info.dimensions} for '{info.id}', "
            f"got {dimensions}.",
            param="dimensions",
        )
