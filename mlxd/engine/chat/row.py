"""A request inside the engine: its lane, progress, timings and output.

A :class:`Row` lives on the engine thread only. It turns each sampled token
into events for its client (text through :class:`TextStream`, logprobs) and
keeps the numbers the snapshot shows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import mlx.core as mx

from mlxd.engine.channel import Channel
from mlxd.engine.chat.output import RowOutput, Split
from mlxd.engine.chat.stops import TextStream
from mlxd.engine.messages import (
    CacheLookup,
    Delta,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    Lane,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from mlxd.engine.policy.admission import RowExtent

if TYPE_CHECKING:
    from mlxd.engine.chat.prompt_cache import Kind

Phase = Literal["pending", "queued", "prefill", "decode"]
_NO_EXTENT = RowExtent(0)


class Hit(Protocol):
    """A prompt-cache lookup as the scheduler sees it (a ``prompt_cache.Fetched``)."""

    @property
    def cache(self) -> Any: ...
    @property
    def rest(self) -> list[int]: ...


@dataclass(eq=False)
class Row:
    request: GenerationRequest
    channel: Channel
    lane: Lane
    reason: str
    prompt: list[int]
    max_tokens: int
    text: TextStream
    tokenizer: Any
    output: RowOutput
    received_mono: float
    received_wall: float
    phase: Phase = "pending"
    uid: int | None = None
    # What admission projects for the row (a follower's mirrored row has none to project).
    extent: RowExtent = _NO_EXTENT
    projected_bytes: int = 0
    cached_tokens: int = 0
    prefill_done: int = 0
    prefill_total: int = 0
    generated: int = 0
    # Of those, the tokens generated inside the model's think markers.
    reasoning_tokens: int = 0
    # Every sampled token, end-of-sequence included (what the KV cache holds).
    generated_ids: list[int] = field(default_factory=list)
    # The head of the pending queue keeps its prompt-cache lookup while it waits.
    prefetched: Hit | None = None
    # Where the system prefix and the reusable prompt end (intake; None: no such point).
    system_end: int | None = None
    prompt_end: int | None = None
    # Checkpoints still to take while prefilling: (position, kind), in order.
    checkpoints: list[tuple[int, Kind]] = field(default_factory=list)
    # The prompt-cache lookup made at admission.
    lookup: CacheLookup | None = None
    admitted_mono: float | None = None
    first_token_mono: float | None = None
    cancelled: bool = False
    # The row's grammar matcher (mlxd.engine.chat.grammar), when it is constrained.
    matcher: Any = None
    # Set when something raised for this row alone (its logits processor,
    # sampler or detokenizer); the engine removes the row and reports it.
    error: BaseException | None = None
    # Why a queued row counts as stalled (refused on an idle lane; see
    # mlxd.engine.policy.stalls); admission then looks past it.
    stalled: str | None = None
    # Scheduling (mlxd.engine.policy.priority): arrival number, when the row
    # (re-)entered its queue, and preemption. A preempted row's generated
    # tokens are folded into ``prompt`` (``folded`` of them) so that it resumes
    # from its kept cache; ``max_tokens`` stays the request's whole allowance.
    seq: int = 0
    queued_mono: float = 0.0
    preemptions: int = 0
    folded: int = 0
    resumed: bool = False
    # When the row last started running (its admission, or its resumption).
    started_mono: float = 0.0
    # The prompt's images (mlxd.engine.chat.vision_intake.ImageSet), registered with
    # the vision model while the row prefills.
    images: Any = None
    images_held: bool = False
    # Seconds the vision tower ran for this row (0 when its images came from the cache).
    vision_seconds: float = 0.0
    # Speculative decoding: tokens drafted for the row and accepted (mlxd.engine.chat.speculative).
    spec_drafted: int = 0
    spec_accepted: int = 0

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def priority(self) -> str:
        return self.request.priority

    @property
    def key(self) -> str:
        """The API key's name the row counts against for fair share ("" without keys)."""
        return self.request.client or ""

    @property
    def prompt_tokens(self) -> int:
        """The request's own prompt, without generated tokens folded in by a preemption."""
        return len(self.prompt) - self.folded

    @property
    def tokens_left(self) -> int:
        """Tokens the row may still generate."""
        return max(0, self.max_tokens - self.generated)

    def fold(self) -> None:
        """Make the tokens generated so far part of the prompt: the row resumes after them."""
        self.prompt = self.prompt + self.generated_ids[self.folded :]
        self.folded = self.generated
        self.preemptions += 1
        self.resumed = True
        self.queued_mono = time.monotonic()
        self.phase = "pending"
        self.checkpoints = []
        self.prefetched = None
        self.uid = None

    def projected(self) -> RowExtent:
        """What admission projects for the row now: its extent, prefilling until its first token."""
        return replace(
            self.extent, prefilling=self.first_token_mono is None, prefilled=self.prefill_done
        )

    def admitted(self, cached_tokens: int) -> None:
        self.admitted_mono = self.started_mono = time.monotonic()
        self.cached_tokens = cached_tokens
        self.prefill_total = len(self.prompt) - cached_tokens
        self.phase = "queued" if self.lane == "batch" else "prefill"

    def push_token(self, token: int, logprobs: mx.array | None, *, is_eos: bool) -> bool:
        """Emit one sampled token; return True when a stop string ended the row."""
        if self.first_token_mono is None:
            self.first_token_mono = time.monotonic()
            self.phase = "decode"
        self.generated += 1
        self.generated_ids.append(token)
        if self.output.phase == "reasoning":
            self.reasoning_tokens += 1
        if is_eos:
            return False
        piece = self.text.add(token)
        lps = (
            (self._logprobs(token, logprobs),)
            if self.request.logprobs and logprobs is not None
            else ()
        )
        self._push(self.output.feed(piece.text), (token,), lps)
        return piece.stopped

    def _push(self, split: Split, tokens: tuple[int, ...], lps: tuple = ()) -> None:
        if tokens or split.text or split.reasoning or split.tool_calls or split.tool_parts:
            self.channel.push(
                Delta(
                    split.text,
                    tokens,
                    lps,
                    split.reasoning,
                    tuple(split.tool_calls),
                    tuple(split.tool_parts),
                )
            )

    def finish(
        self, reason: Literal["stop", "length"], *, stopped_by_string: bool = False
    ) -> Finished:
        """Release held text and send the final event.

        A row that made a tool call and ended on its own (not cut by length)
        finishes with ``tool_calls``.
        """
        if not stopped_by_string:
            piece = self.text.finish()
            self._push(self.output.feed(piece.text), ())
            if piece.stopped:
                reason = "stop"
        self._push(self.output.finish(), ())
        final: FinishReason = reason
        if reason == "stop" and self.output.calls:
            final = "tool_calls"
        event = Finished(
            final,
            self.usage(),
            self.timings(),
            stop_sequence=self.text.matched,
            lookup=self.lookup,
        )
        self.channel.push(event)
        return event

    def fail(self, failed: Failed) -> None:
        self.channel.push(failed)

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.generated, self.cached_tokens, self.reasoning_tokens)

    def timings(self, now: float | None = None) -> Timings:
        now = time.monotonic() if now is None else now
        admitted = self.admitted_mono
        first = self.first_token_mono
        return Timings(
            queue_s=(admitted if admitted is not None else now) - self.received_mono,
            prefill_s=(first - admitted) if first is not None and admitted is not None else None,
            decode_s=(now - first) if first is not None else None,
            ttft_s=(first - self.received_mono) if first is not None else None,
            total_s=now - self.received_mono,
        )

    def tokens_per_s(self, now: float) -> float:
        if self.first_token_mono is None or self.generated < 2:
            return 0.0
        elapsed = now - self.first_token_mono
        return (self.generated - 1) / elapsed if elapsed > 0 else 0.0

    def _logprobs(self, token: int, logprobs: mx.array) -> TokenLogprob:
        top: tuple[TopLogprob, ...] = ()
        n = min(self.request.top_logprobs, logprobs.shape[-1])
        if n > 0:
            ids = mx.argpartition(-logprobs, kth=n - 1)[:n]
            values = logprobs[ids]
            order = mx.argsort(-values)
            # 1-d arrays: tolist() gives lists, item() a float (the stubs say any scalar).
            top_ids = cast("list[int]", ids[order].tolist())
            top_values = cast("list[float]", values[order].tolist())
            top = tuple(self._top(i, lp) for i, lp in zip(top_ids, top_values, strict=True))
        chosen = self._top(token, cast(float, logprobs[token].item()))
        return TokenLogprob(chosen.token, token, chosen.logprob, chosen.bytes, top)

    def _top(self, token: int, logprob: float) -> TopLogprob:
        text = self.tokenizer.decode([token])
        return TopLogprob(token=text, id=token, logprob=logprob, bytes=tuple(text.encode()))
