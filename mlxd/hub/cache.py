"""Where models come from and where they land: the hub and the shared Hugging Face cache.

A ``repo =`` entry is read from the cache ``huggingface_hub`` uses
(``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``):
a model downloaded by ``hf download``, mlx-lm or ``mlxd pull`` is found
there, in place, without a copy. Looking is local only; it never fetches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The files of a repo that make a model, as mlx-lm fetches them (mlx_lm.utils
# DEFAULT_ALLOW_PATTERNS, copied: importing mlx-lm loads MLX). A snapshot mlx-lm
# downloaded is complete by these; READMEs, .gitattributes, PyTorch or GGUF
# copies of the weights are never fetched.
ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]


@dataclass(frozen=True)
class HubPlace:
    """The hub to ask and the cache to use; None leaves each to ``huggingface_hub``'s settings.

    The daemon and the CLI use the defaults (the ``HF_*`` variables as the
    library reads them); tests name a fake hub and a cache of their own.
    """

    endpoint: str | None = None
    cache_dir: Path | None = None
    token: str | None = None


def pull_hint(repo: str, revision: str = "main") -> str:
    """The command that downloads ``repo``."""
    return f"mlxd pull {repo}" + (f" --revision {revision}" if revision != "main" else "")


class NotPulled(Exception):
    """The repo (at that revision) is not complete in the cache."""

    def __init__(self, repo: str, revision: str, why: str = ""):
        self.repo, self.revision = repo, revision
        at = f" (revision {revision})" if revision != "main" else ""
        detail = f" ({why})" if why else ""
        super().__init__(
            f"the model {repo}{at} is not downloaded{detail}: run `{pull_hint(repo, revision)}`, "
            "or press Download on the dashboard's models panel"
        )


def local_snapshot(repo: str, revision: str = "main", place: HubPlace | None = None) -> Path:
    """The snapshot directory of ``repo`` at ``revision`` in the cache; raises NotPulled.

    Complete only: a snapshot the cache knows to miss files (an interrupted
    download) is not pulled yet.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    place = place or HubPlace()
    try:
        found = snapshot_download(
            repo,
            revision=revision,
            cache_dir=place.cache_dir,
            local_files_only=True,
            allow_patterns=ALLOW_PATTERNS,
        )
    except IncompleteSnapshotError:
        raise NotPulled(repo, revision, "an earlier download was interrupted") from None
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise NotPulled(repo, revision) from None
    path = Path(found)
    if not (path / "config.json").is_file():
        raise NotPulled(repo, revision, "its snapshot has no config.json")
    return path


def repo_dir(repo: str, revision: str, place: HubPlace | None = None) -> Path | None:
    """The snapshot directory when ``repo`` is pulled, else None (never raises)."""
    try:
        return local_snapshot(repo, revision, place)
    except NotPulled:
        return None
