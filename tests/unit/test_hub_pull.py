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


def test_a_model_another_tool_downloaded_is_found_in_place(hub: FakeHub, place: HubPlace):
    from huggingface_hub import snapshot_download

    theirs = snapshot_download("org/tiny", cache_dir=place.cache_dir, endpoint=hub.url)
    assert local_snapshot("org/tiny", place=place) == Path(theirs)


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
