"""Models from the Hugging Face hub, on the operator's word (docs/operations.md).

The face of the package: what the CLI (``mlxd pull``), the engines' loaders
(a ``repo =`` entry read from the cache) and the admin routes (download jobs)
use. Everything goes through ``huggingface_hub`` and its shared cache
(``HF_HOME``, ``HF_HUB_CACHE``, ``HF_ENDPOINT``, ``HF_TOKEN``, offline mode as
it reads them); nothing here imports MLX or web code.
"""

from __future__ import annotations

from mlxd.hub.cache import HubPlace, NotPulled, local_snapshot, pull_hint, repo_dir
from mlxd.hub.download import Cancelled, Progress, pull
from mlxd.hub.fit import FitVerdict, fit_verdict, kv_bytes_per_token
from mlxd.hub.listing import HubError, Listing, fetch_listing

__all__ = [
    "Cancelled",
    "FitVerdict",
    "HubError",
    "HubPlace",
    "Listing",
    "NotPulled",
    "Progress",
    "fetch_listing",
    "fit_verdict",
    "kv_bytes_per_token",
    "local_snapshot",
    "pull",
    "pull_hint",
    "repo_dir",
]
