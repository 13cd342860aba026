"""How much a request lets a thinking model think: efforts and budgets from each API.

OpenAI's ``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses),
Anthropic's ``thinking`` (``budget_tokens``) and ``output_config.effort``
become two things: template kwargs (``none`` and ``disabled`` turn thinking
off where the template has the switch) and a token budget
(``[reasoning] effort_budgets``, or ``budget_tokens`` itself) that the
engine enforces in the row's logits slot (``engine/chat/reasoning_budget``).
"""

from __future__ import annotations

from typing import Any

from mlxd.api.params import bad
from mlxd.config import Settings

# What the engine takes: the template switch, and the budget (None: no cap).
Thinking = tuple[tuple[tuple[str, object], ...], int | None]

_OFF: tuple[tuple[str, object], ...] = (("enable_thinking", False),)
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# A budget larger than any context: refused as a value, not clamped silently.
_MAX_BUDGET = 10_000_000


def effort(value: Any, settings: Settings, param: str) -> Thinking:
    """An effort name: ``none`` turns thinking off; the others map to their budget."""
    if value is None:
        return (), None
    if value not in _EFFORTS:
        raise bad(param, f"Unknown effort {value!r}: use {', '.join(_EFFORTS)}.")
    if value == "none":
        return _OFF, None
    return (), settings.reasoning.effort_budgets.get(value)


def anthropic(
    thinking: dict[str, Any] | None, output_config: dict[str, Any] | None, settings: Settings
) -> Thinking:
    """Messages' ``thinking`` (its ``budget_tokens`` wins) and ``output_config.effort``."""
    kwargs: tuple[tuple[str, object], ...] = ()
    budget = None
    if thinking is not None:
        kind = thinking.get("type")
        if kind not in ("enabled", "adaptive", "disabled"):
            raise bad(
                "thinking.type",
                f"Unknown thinking type {kind!r}: use enabled, adaptive or disabled.",
            )
        kwargs = (("enable_thinking", kind != "disabled"),)
        if kind == "disabled":
            return kwargs, None
        raw = thinking.get("budget_tokens")
        if raw is not None:
            if not isinstance(raw, int) or isinstance(raw, bool) or not 1 <= raw <= _MAX_BUDGET:
                raise bad(
                    "thinking.budget_tokens", "thinking.budget_tokens must be a positive integer."
                )
            budget = raw
    level = (output_config or {}).get("effort")
    if budget is None and level is not None:
        if level not in ("low", "medium", "high", "max"):
            raise bad(
                "output_config.effort",
                f"Unknown effort {level!r}: use low, medium, high or max.",
            )
        budget = settings.reasoning.effort_budgets.get(level)
    return kwargs, budget
