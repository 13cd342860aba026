"""A hub repo and revision as a config names them (``[model] repo``, ``revision``)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

# What the Hugging Face hub accepts as a repo id and a revision (huggingface_hub's own check).
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,127}$")


def check_repo(value: str) -> str:
    if not _REPO_ID.match(value) or ".." in value:
        raise ValueError(
            f"{value[:80]!r} is not a Hugging Face repo id: write it as 'org/name' "
            "(letters, digits, '-', '_', '.')"
        )
    return value


def check_revision(value: str) -> str:
    if not _REVISION.match(value) or ".." in value:
        raise ValueError(f"{value[:80]!r} is not a branch, tag or commit name")
    return value


RepoId = Annotated[str, AfterValidator(check_repo)]
Revision = Annotated[str, AfterValidator(check_revision)]
