"""Downloading a repo into the shared cache: progress, cancel, resume, checksums.

``huggingface_hub`` does the work. Its ``snapshot_download`` skips files
the cache holds, checks sizes and lays out the cache (blobs, snapshot
links, refs); but since 2.x it writes each file to a temporary name it
deletes on failure, so an interrupted download starts again from zero.
The weight files, which are nearly all of a model's bytes, are therefore
fetched first with the library's own ``http_get`` into
``blobs/<etag>.incomplete`` (the name older versions resumed from), resumed
with a Range request, checked against the hub's sha256 and moved to
``blobs/<etag>``; ``snapshot_download`` then finds those blobs, links them
and fetches the small files. Around it, :func:`pull` adds what an operator
wants to see and do:

- progress: a watcher thread reads the bytes in the cache every quarter
  second (complete files, and the ``.incomplete`` blob of each file under
  way), so resumed and skipped bytes count as done and speed is what this
  pull moved;
- cancel: the progress bars ``snapshot_download`` drives are ours, and
  raise :class:`Cancelled` on their next update once cancel is set (the
  partial blob stays, so the next pull resumes);
- a free-space check before the first byte, and ``HfApi.verify_repo_checksums``
  (sha256 for LFS files, git sha1 for the others) once every file is there.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlxd.config import format_bytes
from mlxd.hub.cache import ALLOW_PATTERNS, HubPlace
from mlxd.hub.listing import (
    WEIGHT_SUFFIXES,
    HubError,
    Listing,
    fetch_listing,
    one_line,
)

WATCH_S = 0.25
SPEED_WINDOW_S = 3.0
# huggingface_hub reads a response in chunks of constants.DOWNLOAD_CHUNK_SIZE (10 MiB) and
# writes and reports each whole: progress and cancel would move in 10 MiB steps. mlxd's
# pulls use this instead (the library reads the constant at each download).
PULL_CHUNK_BYTES = 1024 * 1024


class Cancelled(Exception):
    """The pull was cancelled; what it fetched stays in the cache and the next pull resumes."""


@dataclass(frozen=True)
class Progress:
    """Where a pull stands."""

    files_done: int
    files_total: int
    bytes_done: int
    bytes_total: int
    speed: float  # bytes per second, over the last few seconds of this pull
    eta: float | None  # seconds, at that speed

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _storage(listing: Listing, place: HubPlace) -> Path:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    root = Path(place.cache_dir or constants.HF_HUB_CACHE).expanduser()
    return root / repo_folder_name(repo_id=listing.repo, repo_type="model")


def bytes_on_disk(listing: Listing, place: HubPlace) -> tuple[int, int]:
    """(files complete, bytes held) of ``listing`` in the cache, partial blobs included."""
    storage = _storage(listing, place)
    snapshot = storage / "snapshots" / listing.commit
    files = held = 0
    for name, size in listing.sizes.items():
        if (snapshot / name).is_file():
            files += 1
            held += size
            continue
        blob = storage / "blobs" / f"{listing.blobs.get(name, '')}.incomplete"
        with contextlib.suppress(OSError):
            held += min(blob.stat().st_size, size)
    return files, held


class _Watch:
    """Samples the cache and reports Progress until stopped."""

    def __init__(self, listing: Listing, place: HubPlace, report: Callable[[Progress], None]):
        self._listing, self._place, self._report = listing, place, report
        self._samples: deque[tuple[float, int]] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlxd-pull-watch", daemon=True)

    def sample(self) -> Progress:
        files, held = bytes_on_disk(self._listing, self._place)
        now = time.monotonic()
        self._samples.append((now, held))
        while len(self._samples) > 2 and now - self._samples[0][0] > SPEED_WINDOW_S:
            self._samples.popleft()
        t0, b0 = self._samples[0]
        speed = (held - b0) / (now - t0) if now > t0 else 0.0
        left = self._listing.total_bytes - held
        eta = left / speed if speed > 0 else (0.0 if left <= 0 else None)
        return Progress(
            files, len(self._listing.sizes), held, self._listing.total_bytes, speed, eta
        )

    def _run(self) -> None:
        while not self._stop.wait(WATCH_S):
            self._report(self.sample())

    def __enter__(self) -> _Watch:
        self._report(self.sample())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _bars(cancel: threading.Event | None) -> type:
    """Silent progress bars for ``snapshot_download``; Cancelled once ``cancel`` is set."""

    class Bar:
        def __init__(self, *args: Any, **kwargs: Any):
            self.n = kwargs.get("initial", 0) or 0
            self.total = kwargs.get("total") or 0
            self.format_dict: dict[str, Any] = {}

        def update(self, n: float | None = 1) -> None:
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled")
            self.n += n or 0

        def __enter__(self) -> Bar:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def close(self) -> None:
            pass

        def refresh(self) -> None:
            pass

        def __getattr__(self, name: str) -> Callable[..., None]:
            # Whatever else a tqdm has (set_description_str, set_postfix_str, ...): nothing.
            return lambda *args, **kwargs: None

    return Bar


def pull(
    repo: str,
    revision: str = "main",
    *,
    place: HubPlace | None = None,
    listing: Listing | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    cancel: threading.Event | None = None,
    verify: bool = True,
) -> Path:
    """Download ``repo`` at ``revision`` into the cache; the snapshot directory.

    Raises HubError (one line, naming the repo) or Cancelled.
    """
    from huggingface_hub import constants, snapshot_download

    constants.DOWNLOAD_CHUNK_SIZE = PULL_CHUNK_BYTES
    place = place or HubPlace()
    listing = listing or fetch_listing(repo, revision, place)
    report = on_progress or (lambda _p: None)
    watch = _Watch(listing, place, report)
    _check_space(listing, place, watch.sample())
    bars = _bars(cancel)
    try:
        with watch:
            weights = [n for n in listing.sizes if n.endswith(WEIGHT_SUFFIXES)]
            with ThreadPoolExecutor(max_workers=4, thread_name_prefix="mlxd-pull") as pool:
                for done in [pool.submit(_fetch_blob, listing, n, place, bars) for n in weights]:
                    done.result()
            found = snapshot_download(
                repo,
                # The revision as asked: the library records a branch or tag in refs/.
                revision=listing.revision,
                cache_dir=place.cache_dir,
                endpoint=place.endpoint,
                token=place.token,
                tqdm_class=bars,  # a tqdm look-alike
                max_workers=4,
                allow_patterns=ALLOW_PATTERNS,
            )
        if cancel is not None and cancel.is_set():
            raise Cancelled("cancelled")
        if verify:
            _verify(listing, place)
    except (Cancelled, HubError):
        raise
    except Exception as exc:
        raise HubError(one_line(exc, repo, revision, place.endpoint)) from exc
    finally:
        report(watch.sample())
    return Path(found)


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _fetch_blob(listing: Listing, name: str, place: HubPlace, bars: type) -> None:
    """One weight file into ``blobs/<etag>``, resuming ``blobs/<etag>.incomplete``."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(listing.repo, name, revision=listing.commit, endpoint=place.endpoint)
    meta = get_hf_file_metadata(url, token=place.token, endpoint=place.endpoint)
    etag = meta.etag or listing.blobs.get(name) or ""
    blobs = _storage(listing, place) / "blobs"
    blob = blobs / etag
    snapshot_file = _storage(listing, place) / "snapshots" / listing.commit / name
    if not etag or blob.exists() or snapshot_file.exists():
        return
    blobs.mkdir(parents=True, exist_ok=True)
    partial = blobs / f"{etag}.incomplete"
    headers = build_hf_headers(token=place.token)
    location = meta.location or url
    if location.split("/")[2] != url.split("/")[2]:
        headers.pop("authorization", None)  # a signed CDN address: no token, as the library does
    with open(partial, "ab") as f:
        http_get(
            location,
            f,
            resume_size=f.tell(),
            headers=headers,
            expected_size=meta.size,
            displayed_filename=name,
            tqdm_class=bars,
        )
    if _SHA256.match(etag) and _sha256(partial) != etag:
        partial.unlink(missing_ok=True)
        raise HubError(f"{listing.repo}: {name} does not match the hub's sha256; pull again")
    partial.replace(blob)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _check_space(listing: Listing, place: HubPlace, now: Progress) -> None:
    storage = _storage(listing, place)
    probe = next((p for p in (storage, *storage.parents) if p.exists()), None)
    if probe is None:
        return
    need = listing.total_bytes - now.bytes_done
    free = shutil.disk_usage(probe).free
    if need > free:
        raise HubError(
            f"{listing.repo}: the disk is full: {format_bytes(need)} still to fetch, "
            f"{format_bytes(free)} free under {probe}"
        )


def _verify(listing: Listing, place: HubPlace) -> None:
    from huggingface_hub import HfApi

    api = HfApi(endpoint=place.endpoint, token=place.token)
    result = api.verify_repo_checksums(
        listing.repo, revision=listing.commit, cache_dir=place.cache_dir
    )
    # Files outside ALLOW_PATTERNS (a README) are missing on purpose.
    missing = [p for p in result.missing_paths if p in listing.sizes]
    if result.mismatches or missing:
        bad = result.mismatches[0]["path"] if result.mismatches else missing[0]
        raise HubError(
            f"{listing.repo}: {bad} does not match the hub's checksum after download; "
            f"delete {_storage(listing, place)} and pull again"
        )
