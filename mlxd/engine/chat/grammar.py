"""Constrained decoding with llguidance: one matcher per row, as its logits processor.

A :class:`Grammars` is built once per loaded model (the llguidance tokenizer
takes up to a second on a large vocabulary). It compiles grammars into
matchers and keeps the compiled ones in an LRU keyed by the grammar's hash;
a row gets a copy. Compiling may happen on any thread (the HTTP side warms
the cache before submitting, so the engine thread usually only copies); the
matcher constructor releases the GIL.

The mask is applied inside the batched step as the row's own logits
processor, so a constrained row and a free row share one ``BatchGenerator``
and the free row's logits are never touched.

A grammar whose first mask allows nothing but the end (a ``$ref`` loop that
slipped past :mod:`mlxd.engine.schema_limits`) is refused when it is
compiled. One that hits llguidance's own limits while it generates fails its
row with a 400 naming the schema (:class:`GrammarFailure`), not as a
generation error.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from mlxd.engine.constraints import parser_limits, short
from mlxd.engine.messages import Constraint, ErrorCode

# Words in llguidance's errors that mean one of its limits was reached.
_LIMIT_WORDS = ("too many", "limit", "max is", "fuel", "too complex", "too large")


class GrammarError(ValueError):
    """The grammar cannot be compiled for this model."""


class GrammarFailure(GrammarError):
    """The grammar failed while a row generated: the schema's fault, a 400.

    ``code`` is ``schema_too_complex`` when llguidance ran out of one of its
    limits (Earley items in a row, lexer fuel), else ``invalid_schema`` (a
    dead end: no token can continue the output).
    """

    status = 400

    def __init__(self, message: str, *, generated: int):
        limit = any(word in message.lower() for word in _LIMIT_WORDS)
        self.code: ErrorCode = "schema_too_complex" if limit else "invalid_schema"
        what = "is too complex for the grammar engine" if limit else "reached a dead end"
        super().__init__(
            f"The schema {what} after {generated} generated tokens ({short(message)}); "
            "simplify it (docs/api.md, 'Structured output limits')."
        )


def make_ll_tokenizer(tokenizer: Any, width: int) -> LLTokenizer:
    """llguidance's view of the model's tokenizer, sized to the logits width.

    Every EOS id of the model ends a constrained row; ``width`` is the logits'
    last dimension, which is often padded past the tokenizer's vocabulary.
    """
    backend = copy.copy(tokenizer._tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    n_vocab = max(width, len(tokenizer))
    eos = sorted(tokenizer.eos_token_ids)
    return LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)


class Grammars:
    """The model's llguidance tokenizer and its compiled-grammar LRU (thread-safe)."""

    def __init__(self, ll_tokenizer: LLTokenizer, width: int, *, capacity: int = 64):
        self.tokenizer = ll_tokenizer
        self.width = width
        self._capacity = capacity
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()

    def warm(self, constraint: Constraint) -> tuple[float, bool]:
        """Compile ``constraint`` into the cache (any thread); raises GrammarError.

        Returns the seconds it took and whether it was already cached.
        """
        with self._lock:
            cached = constraint.key in self._cache
        started = time.perf_counter()
        self.matcher(constraint)
        return time.perf_counter() - started, cached

    def matcher(self, constraint: Constraint) -> LLMatcher:
        """A fresh matcher for ``constraint``: a copy of the cached compiled one."""
        with self._lock:
            cached = self._cache.get(constraint.key)
            if cached is not None:
                self._cache.move_to_end(constraint.key)
        if cached is None:
            cached = LLMatcher(
                self.tokenizer, constraint.grammar, log_level=0, limits=parser_limits()
            )
            if cached.is_error():
                raise GrammarError(short(cached.get_error()))
            self._check_start(cached)
            with self._lock:
                self._cache[constraint.key] = cached
                while len(self._cache) > self._capacity:
                    self._cache.popitem(last=False)
        with self._lock:
            return cached.deep_copy()

    def _check_start(self, matcher: LLMatcher) -> None:
        """Refuse a grammar whose first mask allows no token but the end."""
        probe = matcher.deep_copy()
        mask = probe.compute_bitmask()
        if probe.is_error():
            why = short(probe.get_error()) or "no token can start it"
            raise GrammarError(f"the grammar accepts no output: {why}")
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: self.width])
        if not set(allowed.tolist()) - set(self.tokenizer.eos_tokens):
            raise GrammarError("the grammar accepts no output: no token can start it")


def _portable_mask(bitmask: bytes, width: int) -> mx.array:
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:width]
    # mx.array takes a numpy array; its stub's DLPack protocol is stricter than numpy's.
    return mx.array(bits.astype(np.bool_))  # pyright: ignore[reportArgumentType]


def _metal_apply(logits: mx.array, bitmask: bytes) -> mx.array:
    from llguidance.mlx import apply_token_bitmask_kernel

    mask = mx.array(np.frombuffer(bitmask, dtype=np.int32)[None, :])
    # mx.custom_function's stub types the decorated kernel's result as object.
    return cast(mx.array, apply_token_bitmask_kernel(logits, mask))


def apply_mask(logits: mx.array, bitmask: bytes, *, metal: bool) -> mx.array:
    """Set every token the bitmask forbids to -inf (``logits`` is ``(1, width)``).

    On Apple silicon llguidance's Metal kernel does it; elsewhere (the Linux
    CPU backend, which has no Metal) a numpy unpack and ``mx.where``.
    """
    if metal:
        return _metal_apply(logits, bitmask)
    allowed = _portable_mask(bitmask, logits.shape[-1])
    return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))


class ConstraintProcessor:
    """A row's matcher as an mlx-lm logits processor ``(tokens, logits) -> logits``.

    mlx-lm calls it with the row's context (the prompt on the first call,
    then one more sampled token per call). Each new token is fed to the
    matcher before the next mask. While the output is inside the model's
    think markers the row runs free; the grammar starts after ``think_end``.
    """

    def __init__(
        self,
        matcher: LLMatcher,
        *,
        think_end: Sequence[int] | None = None,
        reasoning: bool = False,
        metal: bool | None = None,
        vocab: int | None = None,
    ):
        self.matcher = matcher
        self._think_end = tuple(think_end or ())
        self.active = not (reasoning and self._think_end)
        self._base: int | None = None
        self._seen = 0
        self._tail: list[int] = []
        # Tokens the matcher consumed (what a rewind rolls back).
        self._fed = 0
        # Masks computed ahead for the next calls (a verify step's draft), and
        # a mask's width in 32-bit words for llguidance's executor (0: unknown).
        self._ready: list[bytes] = []
        self.words = (vocab + 31) // 32 if vocab else 0
        self._metal = mx.metal.is_available() if metal is None else metal

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._base is None:
            self._base = int(tokens.shape[-1])
        else:
            new = cast(list[int], tokens[self._base + self._seen :].tolist())
            self._seen += len(new)
            self._consume(new)
        if not self.active:
            return logits
        bitmask = self._ready.pop(0) if self._ready else self.matcher.compute_bitmask()
        if self.matcher.is_error():
            raise GrammarFailure(self.matcher.get_error(), generated=self._seen)
        return apply_mask(logits, bitmask, metal=self._metal)

    def _consume(self, new: list[int]) -> None:
        for token in new:
            if not self.active:
                self._tail = [*self._tail, token][-len(self._think_end) :]
                if tuple(self._tail) == self._think_end:
                    self.active = True
                continue
            if not self.matcher.consume_token(token):
                raise GrammarFailure(
                    f"token {token} was refused: {self.matcher.get_error()}",
                    generated=self._seen,
                )
            self._fed += 1

    # Speculative decoding (mlxd.engine.chat.speculative.constrained): a verify
    # step calls the processor once per drafted position, then rewinds it to
    # the state after the tokens the row accepted.

    def allowed(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (the next ones this processor will see) the grammar allows."""
        active, tail = self.active, list(self._tail)
        for at, token in enumerate(tokens):
            if active:
                return at + self.matcher.validate_tokens(list(tokens[at:]))
            tail = [*tail, token][-len(self._think_end) :]
            active = tuple(tail) == self._think_end
        return len(tokens)

    def prefetch(self, masks: list[bytes]) -> None:
        """Masks for the next calls, computed ahead; ``[]`` drops any left."""
        self._ready = list(masks)

    def replay(self, mark: tuple[Any, ...], matcher: LLMatcher, tokens: Sequence[int]) -> None:
        """Back to ``mark`` with ``matcher`` (a copy taken there), then ``tokens`` fed
        one call at a time, each call's mask computed: raises where those calls would."""
        self.matcher = matcher
        active, tail, self._seen, self._fed = mark
        self.active, self._tail, self._ready = active, list(tail), []
        for token in tokens:
            self._seen += 1
            self._consume([token])
            if self.active:
                self.matcher.compute_bitmask()
                if self.matcher.is_error():
                    raise GrammarFailure(self.matcher.get_error(), generated=self._seen)

    def mark(self) -> tuple[Any, ...]:
        """The processor's state now, for :meth:`rewind`."""
        return (self.active, tuple(self._tail), self._seen, self._fed)

    def rewind(self, mark: tuple[Any, ...]) -> None:
        """Back to ``mark``: the matcher rolls back the tokens it consumed since."""
        active, tail, seen, fed = mark
        if self._fed > fed and not self.matcher.rollback(self._fed - fed):
            raise GrammarFailure(
                f"rollback failed: {self.matcher.get_error()}", generated=self._seen
            )
        self.active, self._tail, self._seen, self._fed = active, list(tail), seen, fed
