"""Pulling from the hub (mlxd/hub): the real huggingface_hub against the local fake hub.

In process: a pull, a second pull that moves nothing, resuming an
interrupted pull, the cache lookup a ``repo =`` entry makes, and the one-line
errors (missing repo, gated repo, missing revision).
"""

from __future__ import annotations

import importlib
import threading
from pathlib import Path

import pytest

from mlxd.hub import Cancelled, HubError, HubPlace, NotPulled, local_snapshot, pull
from tests.support.fakehub import FakeHub, running_hub

download = importlib.import_module("mlxd.hub.download")


@pytest.fixture
def hub(tiny_models):
    with running_hub() as hub:
        hub.add_dir("org/tiny", tiny_models("llama"))
        yield hub


@pytest.fixture
def place(hub: FakeHub, tmp_path: Path) -> HubPlace:
    return HubPlace(hub.url, tmp_path / "hf-cache")


def test_pull_then_a_second_pull_transfers_nothing(hub: FakeHub, place: HubPlace):
    with pytest.raises(NotPulled, match=r"run `mlxd pull org/tiny`"):
        local_snapshot("org/tiny", place=place)
    seen = []
    path = pull("org/tiny", place=place, on_progress=seen.append)
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    assert path.is_relative_to(place.cache_dir)  # the shared cache's own layout
    total = sum(len(b) for b in hub.repos["org/tiny"].files.values())
    assert hub.bytes_served() == total
    last = seen[-1]
    assert (last.files_done, last.bytes_done) == (6, total) and last.bytes_total == total
    assert local_snapshot("org/tiny", place=place) == path

    again = pull("org/tiny", place=place)
    assert again == path
    assert hub.bytes_served() == total  # nothing moved


def test_an_interrupted_pull_resumes_where_it_stopped(
    hub: FakeHub, place: HubPlace, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(download, "PULL_CHUNK_BYTES", 64 * 1024)
    hub.throttle = 1_000_000
    size = len(hub.repos["org/tiny"].files["model.safetensors"])
    cancel = threading.Event()

    def stop_midway(p):
        if p.bytes_done > size // 4:
            cancel.set()

    with pytest.raises(Cancelled):
        pull("org/tiny", place=place, on_progress=stop_midway, cancel=cancel)
    first = hub.bytes_served(".safetensors")
    assert 0 < first < size
    with pytest.raises(NotPulled, match="not downloaded"):
        local_snapshot("org/tiny", place=place)

    hub.throttle = None
    pull("org/tiny", place=place)
    gets = hub.weight_gets()
    assert gets[0].range is None and gets[-1].range and gets[-1].range.startswith("bytes=")
    resumed_at = int(gets[-1].range.removeprefix("bytes=").rstrip("-"))
    assert resumed_at > 0
    # Only what the first pull had not written moves again.
    assert gets[-1].sent == size - resumed_at
    assert (local_snapshot("org/tiny", place=place) / "model.safetensors").stat().st_size == size


def test_a_model_another_tool_downloaded_is_found_in_place(
    hub: FakeHub, place: HubPlace, tiny_models
):
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    files = {p.name: p.read_bytes() for p in tiny_models("llama").iterdir()}
    readme = {"README.md": b"# a model card", ".gitattributes": b"*.safetensors filter=lfs"}
    hub.add_dir_files("org/card", {**files, **readme})
    # As mlx-lm downloads it (its own file patterns: no README, no .gitattributes) ...
    theirs = snapshot_download(
        "org/card",
        cache_dir=place.cache_dir,
        endpoint=hub.url,
        allow_patterns=DEFAULT_ALLOW_PATTERNS,
    )
    assert local_snapshot("org/card", place=place) == Path(theirs)
    # ... and a pull of it moves nothing, checks the checksums and fetches no README.
    served = hub.bytes_served()
    assert pull("org/card", place=place) == Path(theirs)
    assert hub.bytes_served() == served and not (Path(theirs) / "README.md").exists()


def test_errors_are_one_line_naming_the_repo(hub: FakeHub, place: HubPlace, tiny_models):
    with pytest.raises(HubError) as missing:
        pull("org/missing", place=place)
    assert str(missing.value) == (
        f"org/missing: no such repo on {hub.url} (or it is private: set HF_TOKEN to a token "
        "with access)"
    )
    with pytest.raises(HubError, match=r"^org/tiny: no revision 'v9' in this repo$"):
        pull("org/tiny", "v9", place=place)

    hub.add_dir("org/gated", tiny_models("llama"), gated_token="hf_secret")
    with pytest.raises(HubError, match=r"^org/gated: the repo is gated: .*HF_TOKEN"):
        pull("org/gated", place=place)
    assert hub.weight_gets() == []
    with_token = HubPlace(place.endpoint, place.cache_dir, token="hf_secret")
    assert (pull("org/gated", place=with_token) / "model.safetensors").is_file()
    for error in (missing.value,):
        assert "\n" not in str(error)


def wait_for(predicate, timeout: float = 20.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := predicate():
            return found
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_download_jobs_cancel_and_a_restart_shows_a_half_done_job_as_resumable(
    hub: FakeHub, place: HubPlace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from mlxd.hub.jobs import Downloads

    monkeypatch.setattr(download, "PULL_CHUNK_BYTES", 64 * 1024)
    monkeypatch.setattr("mlxd.hub.jobs.SAVE_EVERY_S", 0.0)
    hub.throttle = 500_000
    finished = []
    jobs = Downloads(tmp_path / "state", place=place, on_done=finished.append)
    job, new = jobs.start("tiny", "org/tiny", "main", fit=None, force=False)
    assert new and job["state"] == "running"
    assert jobs.start("tiny", "org/tiny", "main", fit=None, force=False) == (job, False)
    wait_for(lambda: (jobs.get(job["id"]) or {}).get("bytes_done", 0) > 100_000)

    # Another process reading the file meanwhile (a restarted daemon): interrupted, resumable.
    after = Downloads(tmp_path / "state", place=place).get(job["id"])
    assert after is not None and after["state"] == "interrupted" and after["resumable"]
    assert "pull again to resume" in after["error"]

    jobs.cancel(job["id"])
    wait_for(lambda: finished)
    cancelled = jobs.get(job["id"])
    assert cancelled is not None and cancelled["state"] == "cancelled" and cancelled["resumable"]
    assert cancelled["bytes_done"] < cancelled["bytes_total"]


def test_a_job_refuses_a_model_that_does_not_fit_before_any_weight_byte(
    hub: FakeHub, place: HubPlace, tmp_path: Path
):
    from mlxd.hub import fit_verdict
    from mlxd.hub.jobs import Downloads

    finished = []
    jobs = Downloads(None, place=place, on_done=finished.append)

    def too_small(listing):
        return fit_verdict(weights=listing.weights_bytes, kv_per_token=None, budget=1024)

    jobs.start("tiny", "org/tiny", "main", fit=too_small, force=False)
    wait_for(lambda: finished)
    job = finished[0].as_dict()
    assert job["state"] == "failed" and job["fits"] is False
    assert job["error"].startswith(
        "org/tiny: does not fit: 838 KiB of weights against a 1.0 KiB budget"
    )
    assert hub.weight_gets() == []


def test_a_full_disk_is_one_line_before_the_first_byte(
    hub: FakeHub, place: HubPlace, monkeypatch: pytest.MonkeyPatch
):
    import errno
    import shutil

    from mlxd.hub.listing import one_line

    real = shutil.disk_usage
    monkeypatch.setattr(download.shutil, "disk_usage", lambda p: real(p)._replace(free=100 * 1024))
    with pytest.raises(
        HubError, match=r"^org/tiny: the disk is full: 848 KiB still to fetch, 100 KiB free under "
    ):
        pull("org/tiny", place=place)
    assert hub.weight_gets() == []
    # A disk that fills during the download: the same kind of line.
    full = OSError(errno.ENOSPC, "No space left on device", "/cache/blobs/x.incomplete")
    assert one_line(full, "org/tiny") == (
        "org/tiny: the disk is full (/cache/blobs/x.incomplete); free space and pull again: "
        "it resumes"
    )
