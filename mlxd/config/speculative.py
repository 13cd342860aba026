"""``[speculative]``: speculative decoding in the batch (docs/batching.md#speculative-decoding)."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from mlxd.config.sections import Section, _field

SpecMode = Literal["off", "prompt_lookup", "draft", "mtp"]


class SpeculativeSettings(Section):
    """How a chat model drafts tokens and verifies them in the batch lane."""

    mode: SpecMode = _field(
        "off",
        "live",
        'What drafts tokens: "off", "prompt_lookup" (n-grams of the row\'s own prompt and '
        'output), "draft" (a small model), "mtp" (the multi-token-prediction head in the '
        "model's own checkpoint: GLM-4.5/4.7, GLM-4.7-Flash, Qwen3.5/3.6, Qwen3-Next; switching "
        "to or from it reloads the model).",
    )
    max_draft_tokens: int = _field(
        4,
        "live",
        "Most tokens drafted per row per step (the verify pass is 1 + this wide).",
        ge=1,
        le=16,
    )
    ngram_max: int = _field(
        6,
        "live",
        "prompt_lookup: the longest suffix n-gram looked up in the row's tokens.",
        ge=1,
        le=8,
    )
    ngram_min: int = _field(
        2,
        "live",
        "prompt_lookup: the shortest suffix n-gram that may propose a draft.",
        ge=1,
        le=8,
    )
    draft_model: str | None = _field(
        None,
        "swap",
        'mode = "draft": a local model directory with the same tokenizer, or a Gemma 4 '
        "assistant directory for a Gemma 4 target, loaded with its target (a change reloads "
        "the model).",
    )
    saturation_tokens: int | None = _field(
        None,
        "live",
        "The cost model's prior: tokens in one forward (rows x (1 + draft)) at which a step "
        "costs twice a one-token step (unset: 8 on a CPU, 64 on a GPU). Measured step times "
        "refine it; wide batches speculate less, or not at all.",
        ge=1,
    )

    @model_validator(mode="after")
    def _check(self) -> SpeculativeSettings:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) is above ngram_max ({self.ngram_max})")
        if self.mode == "draft" and not self.draft_model:
            raise ValueError('mode = "draft" needs draft_model (a local model directory)')
        return self
