"""Lane choice: which requests batch and which run alone.

``decide`` is pure: a request's features, the operator's ``[lanes]`` policy
and what the model can do go in, a lane and the reason come out. The reason is
returned to the client (``X-Mlxd-Lane: serial; reason=seed``) and counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxd.config import LaneSettings
from mlxd.engine.messages import ChatPrompt, GenerationRequest, Lane


@dataclass(frozen=True)
class Capabilities:
    """What the loaded model's caches allow.

    ``batchable`` is False when any layer cache lacks the batch operations
    (``merge`` into a batch cache, then ``extend``/``filter``/``extract``), or
    the model is not autoregressive text.
    """

    batchable: bool
    why_not: str = ""


@dataclass(frozen=True)
class LaneDecision:
    lane: Lane
    reason: str

    @property
    def header(self) -> str:
        """The ``X-Mlxd-Lane`` header value."""
        if self.lane == "batch":
            return "batch"
        return f"serial; reason={self.reason}"


def decide(
    request: GenerationRequest,
    batch_size: int,
    policy: LaneSettings,
    capabilities: Capabilities,
) -> LaneDecision:
    """Pick the lane for one request.

    The order is the order of precedence: serial mode, then what the model
    cannot do, then reproducibility, then the operator's per-feature policy.
    Load never enters the decision (batch size is a mode, not a fallback).
    """
    if batch_size <= 1:
        return LaneDecision("serial", "mode")
    if not capabilities.batchable:
        return LaneDecision("serial", "capability")
    if request.sampling.seed is not None:
        return LaneDecision("serial", "seed")
    if request.logprobs and policy.logprobs == "serial":
        return LaneDecision("serial", "logprobs")
    if request.penalties.has_penalties and policy.penalties == "serial":
        return LaneDecision("serial", "penalties")
    if request.penalties.logit_bias and policy.logit_bias == "serial":
        return LaneDecision("serial", "logit_bias")
    if request.constraint is not None and policy.constrained == "serial":
        return LaneDecision("serial", "constrained")
    prompt = request.prompt
    if isinstance(prompt, ChatPrompt) and prompt.images and policy.images == "serial":
        return LaneDecision("serial", "images")
    return LaneDecision("batch", "batchable")
