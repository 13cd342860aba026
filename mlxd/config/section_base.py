"""What every config section is: a frozen pydantic model whose fields say how they reload."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Reload = Literal["live", "swap", "restart"]


def _field(default: Any, reload: Reload, description: str, **kwargs: Any) -> Any:
    return Field(default, description=description, json_schema_extra={"reload": reload}, **kwargs)


class Section(BaseModel):
    """A config section: frozen, and unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
