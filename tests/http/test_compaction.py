"""Codex's compaction: ``compaction_trigger`` items and ``POST /v1/responses/compact``.

On a tiny random-weight model (the summary is noise; what is checked is the
protocol): exactly one ``compaction`` item whose capsule later turns accept
and expand, its prefix served from the prompt cache, and a tampered capsule
refused.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.api.http.errors import OpenAIError
from mlxd.api.responses.compaction import PREFIX, Capsules
from tests.support.daemon import Daemon
from tests.support.daemons import tools_config

MODEL = "tiny-tools"
CONVERSATION = [
    {"role": "user", "content": "Create hello.txt with a greeting."},
    {"role": "assistant", "content": "Done: hello.txt says hi."},
    {"role": "user", "content": "Now add a second line."},
]
TRIGGER = {"type": "compaction_trigger"}


@pytest.fixture(scope="module")
def hermes(apps) -> Daemon:
    return apps.get(tools_config("hermes"))


def _responses(d: Daemon, **body: Any) -> httpx.Response:
    payload = {"model": MODEL, "max_output_tokens": 8, "store": False, **body}
    return httpx.post(f"{d.url}/v1/responses", json=payload, timeout=120)


def test_a_trigger_answers_one_compaction_item_from_the_cached_prefix(hermes: Daemon):
    turn = _responses(hermes, instructions="Be terse.", input=CONVERSATION).json()
    r = _responses(hermes, instructions="Be terse.", input=[*CONVERSATION, TRIGGER])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "completed"
    (item,) = body["output"]
    assert item["type"] == "compaction" and item["encrypted_content"].startswith(PREFIX)
    # The summary row's prompt is the turn's prompt plus one message: all of it is
    # cached but the turn's generation prompt (`<|im_start|>assistant\n`).
    usage = body["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= turn["usage"]["input_tokens"] - 4
    # A later turn sends the item back in place of the history.
    later = _responses(hermes, input=[item, {"role": "user", "content": "go on"}])
    assert later.status_code == 200, later.text
    assert later.json()["usage"]["input_tokens"] > 20
    # A capsule changed by hand is refused.
    capsule = item["encrypted_content"]
    flipped = capsule[:-3] + ("A" if capsule[-3] != "A" else "B") + capsule[-2:]
    for bad in (flipped, "mlxd.c1.abc", "not ours"):
        refused = _responses(hermes, input=[{**item, "encrypted_content": bad}])
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "invalid_compaction"
        assert error["param"] == "input[0].encrypted_content"


def test_a_streamed_trigger_sends_the_item_once(hermes: Daemon):
    payload = {
        "model": MODEL,
        "input": [*CONVERSATION, TRIGGER],
        "max_output_tokens": 8,
        "stream": True,
        "store": False,
    }
    with httpx.stream("POST", f"{hermes.url}/v1/responses", json=payload, timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    types = [e["type"] for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.output_item.done",
        "response.completed",
    ], types
    (item,) = events[-1]["response"]["output"]
    assert item["type"] == "compaction" and item == events[3]["item"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_the_compact_endpoint(hermes: Daemon):
    r = httpx.post(
        f"{hermes.url}/v1/responses/compact",
        json={"model": MODEL, "input": CONVERSATION, "max_output_tokens": 8},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response.compaction" and body["usage"]["output_tokens"] >= 1
    (item,) = body["output"]
    assert item["type"] == "compaction"
    again = _responses(hermes, input=[item, {"role": "user", "content": "go on"}])
    assert again.status_code == 200, again.text
    misplaced = _responses(hermes, input=[TRIGGER, *CONVERSATION])
    assert misplaced.status_code == 400 and misplaced.json()["error"]["param"] == "input[0]"


def test_a_capsule_is_bound_to_its_key_and_its_server(tmp_path: Path):
    capsules = Capsules(tmp_path)
    sealed = capsules.seal("the summary", "key-a")
    assert capsules.open(sealed, "key-a", "input[0]") == "the summary"
    assert "summary" not in sealed  # opaque: compressed and encoded
    with pytest.raises(OpenAIError):
        capsules.open(sealed, "key-b", "input[0]")
    with pytest.raises(OpenAIError):
        Capsules(tmp_path / "other").open(sealed, "key-a", "input[0]")
    assert Capsules(tmp_path).open(sealed, "key-a", "input[0]") == "the summary"
    mode = (tmp_path / "compaction.key").stat().st_mode
    assert stat.S_IMODE(mode) == 0o600
