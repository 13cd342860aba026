"""``[reasoning]``: how much a thinking model may think, by the effort a request asks for."""

from __future__ import annotations

from pydantic import field_validator

from mlxd.config.sections import Section, _field

# The efforts clients send (OpenAI's reasoning_effort and reasoning.effort,
# Anthropic's output_config.effort); "none" turns thinking off instead.
EFFORTS = ("minimal", "low", "medium", "high", "xhigh", "max")


class ReasoningSettings(Section):
    """Thinking budgets (docs/tools.md, "Thinking budget")."""

    effort_budgets: dict[str, int] = _field(
        {"low": 1024, "medium": 2048, "high": 8192},
        "live",
        "Most tokens a thinking model may think for, by requested effort (minimal, low, medium, "
        "high, xhigh, max); then its end-of-thinking marker is forced. An effort not listed "
        "thinks without a cap.",
    )

    @field_validator("effort_budgets")
    @classmethod
    def _check_budgets(cls, value: dict[str, int]) -> dict[str, int]:
        for effort, budget in value.items():
            if effort not in EFFORTS:
                raise ValueError(f"unknown effort {effort!r}: use {', '.join(EFFORTS)}")
            if budget < 1:
                raise ValueError(f"the {effort!r} budget must be at least 1 token")
        return value
