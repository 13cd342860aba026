"""What a repo holds, asked of the hub before anything large is fetched; its errors in one line.

:func:`fetch_listing` reads the file listing (``HfApi.model_info`` with file
metadata: every file's size) and ``config.json`` (a few KiB, through the
cache), which is all the fit check needs. :func:`one_line` turns whatever
``huggingface_hub`` or the disk raised into one sentence naming the repo.
"""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass
from typing import Any

from mlxd.hub.cache import ALLOW_PATTERNS, HubPlace

WEIGHT_SUFFIXES = (".safetensors",)


class HubError(Exception):
    """A pull that cannot go on, in one line for people (the CLI prints it; a job shows it)."""


@dataclass(frozen=True)
class Listing:
    """A repo at one commit: its files' sizes and its config.json."""

    repo: str
    revision: str
    commit: str
    sizes: dict[str, int]
    config: dict[str, Any]
    # Each file's blob name in the cache: its LFS sha256, else its git blob id.
    blobs: dict[str, str]

    @property
    def weights_bytes(self) -> int:
        return sum(n for name, n in self.sizes.items() if name.endswith(WEIGHT_SUFFIXES))

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes.values())


def fetch_listing(repo: str, revision: str = "main", place: HubPlace | None = None) -> Listing:
    """The repo's listing and config.json; raises HubError (one line)."""
    from huggingface_hub import HfApi, hf_hub_download

    place = place or HubPlace()
    try:
        api = HfApi(endpoint=place.endpoint, token=place.token)
        info = api.model_info(repo, revision=revision, files_metadata=True)
        from huggingface_hub.utils import filter_repo_objects

        wanted = set(
            filter_repo_objects(
                [s.rfilename for s in info.siblings or ()], allow_patterns=ALLOW_PATTERNS
            )
        )
        siblings = [s for s in info.siblings or () if s.rfilename in wanted]
        sizes = {s.rfilename: int(s.size or 0) for s in siblings}
        blobs = {s.rfilename: (s.lfs.sha256 if s.lfs else s.blob_id) or "" for s in siblings}
        if "config.json" not in sizes:
            raise HubError(f"{repo}: the repo has no config.json; is it a model mlx-lm can load?")
        config_path = hf_hub_download(
            repo,
            "config.json",
            revision=info.sha or revision,
            cache_dir=place.cache_dir,
            endpoint=place.endpoint,
            token=place.token,
        )
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except HubError:
        raise
    except Exception as exc:
        raise HubError(one_line(exc, repo, revision, place.endpoint)) from exc
    if not isinstance(config, dict):
        raise HubError(f"{repo}: config.json is not a JSON object")
    return Listing(repo, revision, info.sha or revision, sizes, config, blobs)


def one_line(
    exc: BaseException, repo: str, revision: str = "main", endpoint: str | None = None
) -> str:
    """What went wrong, in one sentence that names the repo."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = endpoint or constants.ENDPOINT
    if isinstance(exc, GatedRepoError):
        return (
            f"{repo}: the repo is gated: accept its terms on the hub, then set HF_TOKEN "
            "(or `hf auth login`) to a token with access"
        )
    if isinstance(exc, RevisionNotFoundError):
        return f"{repo}: no revision {revision!r} in this repo"
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"{repo}: no such repo on {endpoint} (or it is private: set HF_TOKEN to a token "
            "with access)"
        )
    if (
        isinstance(exc, (OfflineModeIsEnabled, LocalEntryNotFoundError))
        or constants.is_offline_mode()
    ):
        return f"{repo}: cannot reach the hub (offline mode, HF_HUB_OFFLINE, is on, or no network)"
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        where = exc.filename or "the Hugging Face cache"
        return f"{repo}: the disk is full ({where}); free space and pull again: it resumes"
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        return f"{repo}: the hub answered HTTP {status}"
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if type(exc).__module__.startswith(("httpx", "httpcore")):
        return f"{repo}: cannot reach {endpoint} ({text})"
    if "not enough free disk space" in str(exc).lower():
        return f"{repo}: not enough free disk space for the download ({text})"
    return f"{repo}: {type(exc).__name__}: {text}"
