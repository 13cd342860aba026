"""Several models in one daemon under one memory budget (issue 12), tiny models only.

One daemon serves three tiny chat models in a budget that holds the pinned
one plus one other: loads on demand, LRU eviction, a pinned model that
stays, keep_alive, a wait for memory while a busy model holds it, a model
that can never fit, a model whose load fails, and routing by id and alias.
Memory is measured by MLX itself (``/stats`` ``memory.peak_bytes``, the
process's allocator peak) against the budget.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.support.daemon import Daemon, toml_config

MiB = 1024**2
CACHE = "1MiB"  # each model's prompt-cache cap, reserved in the budget


def weights(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


@pytest.fixture(scope="module")
def paths(tiny_models, tmp_path_factory):
    broken = tmp_path_factory.mktemp("broken") / "broken-model"
    shutil.copytree(tiny_models("llama"), broken)
    for file in broken.glob("*.safetensors"):
        file.write_bytes(b"these are not safetensors")
    return {
        "a": Path(tiny_models("llama")),
        "b": Path(tiny_models("llama_b")),
        "c": Path(tiny_models("llama", seed=1)),
        "broken": broken,
    }


@pytest.fixture(scope="module")
def budget(paths) -> int:
    """The pinned model, one other and room for a few rows' KV; never all three."""
    need = {k: weights(p) + MiB for k, p in paths.items() if k != "broken"}
    budget = need["a"] + max(need["b"], need["c"]) + 3 * MiB // 4
    assert budget < sum(need.values()), "the budget must not hold every model"
    return budget


@pytest.fixture(scope="module")
def daemon(daemons, paths, budget):
    config = toml_config(
        memory={"budget": budget},
        batch={"size": 4, "decode_allowance": 128},
        sampling={"temperature": 0.0},
        models={
            "a": {"path": str(paths["a"]), "pin": True, "prompt_cache": {"max_bytes": CACHE}},
            "b": {
                "path": str(paths["b"]),
                "aliases": ["gpt-*", "bee"],
                "prompt_cache": {"max_bytes": CACHE},
            },
            "c": {"path": str(paths["c"]), "prompt_cache": {"max_bytes": CACHE}},
            "huge": {"path": str(paths["a"]), "prompt_cache": {"max_bytes": "64MiB"}},
            "broken": {"path": str(paths["broken"]), "prompt_cache": {"max_bytes": CACHE}},
        },
    )
    # Its own: the tests load, unload and evict its models in file order.
    return daemons.get(config, name="fleet")


def chat(d: Daemon, model: str, max_tokens: int = 4) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(
        f"{d.url}/v1/chat/completions", json={**body, "max_tokens": max_tokens}, timeout=120
    )


def states(d: Daemon) -> dict[str, str]:
    return {m["id"]: m["state"] for m in d.stats()["fleet"]["models"]}


def events(d: Daemon) -> list[tuple[str, str]]:
    return [(e["model"], e["kind"]) for e in d.stats()["fleet"]["events"]]


def wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out")


def test_the_pinned_model_is_loaded_at_start_and_the_others_on_demand(daemon):
    assert states(daemon) == {
        "a": "loaded",
        "b": "unloaded",
        "c": "unloaded",
        "huge": "unloaded",
        "broken": "unloaded",
    }
    listed = httpx.get(f"{daemon.url}/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["a", "b", "c", "huge", "broken"]
    a = listed[0]
    assert a["pinned"] and a["default"] and a["state"] == "loaded" and a["weights_bytes"] > 0
    assert listed[1]["aliases"] == ["gpt-*", "bee"] and listed[1]["state"] == "unloaded"
    reply = chat(daemon, "b")
    assert reply.status_code == 200 and reply.json()["model"] == "b"
    assert states(daemon)["b"] == "loaded"


def test_aliases_route_unknown_names_get_404_and_no_request_opens_a_path(daemon, paths):
    assert chat(daemon, "gpt-4o-mini").json()["model"] == "b"
    assert chat(daemon, "bee").json()["model"] == "b"
    assert chat(daemon, "").json()["model"] == "a"  # no model: the default
    for name in ("nope", str(paths["c"]), "../c", "/etc/passwd", "a/../c"):
        reply = chat(daemon, name)
        assert reply.status_code == 404, name
        error = reply.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "'a', 'b', 'c'" in error["message"]
    # A path a client names is never loaded, even one that holds a real model.
    assert not any(e[0] not in ("a", "b", "c", "huge", "broken") for e in events(daemon))
    missing = httpx.get(f"{daemon.url}/v1/models/{paths['c']}")
    assert missing.status_code == 404
    assert httpx.get(f"{daemon.url}/v1/models/c").json()["id"] == "c"
    # An alias that routes is a model here too (issue 22), under its id.
    for alias in ("bee", "gpt-4o-mini"):
        found = httpx.get(f"{daemon.url}/v1/models/{alias}")
        assert found.status_code == 200 and found.json()["id"] == "b", found.text
    assert httpx.get(f"{daemon.url}/v1/models/nope").status_code == 404


def test_loading_evicts_the_least_recently_used_and_memory_stays_in_the_budget(daemon, budget):
    assert chat(daemon, "b").status_code == 200
    assert chat(daemon, "c").status_code == 200  # b was idle and unpinned: evicted
    assert states(daemon)["b"] == "unloaded" and states(daemon)["c"] == "loaded"
    assert ("b", "evicted") in events(daemon)
    assert chat(daemon, "b").status_code == 200  # and back: c goes
    assert states(daemon) | {"huge": "", "broken": ""} == {
        "a": "loaded",
        "b": "loaded",
        "c": "unloaded",
        "huge": "",
        "broken": "",
    }
    stats = daemon.stats()
    fleet = stats["fleet"]
    assert 0 < fleet["used_bytes"] <= fleet["budget_bytes"] == budget
    # MLX's own allocator: the process never held more than the budget.
    assert 0 < stats["memory"]["peak_bytes"] <= budget, (stats["memory"], budget)


def test_a_model_that_can_never_fit_gets_400_with_the_numbers(daemon, budget):
    reply = chat(daemon, "huge")
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "model_too_large"
    assert "64.0 MiB" in error["message"] and "budget" in error["message"]
    assert states(daemon)["huge"] == "unloaded"
    assert chat(daemon, "a").status_code == 200


def test_a_failed_load_is_a_503_and_an_event_and_the_others_keep_serving(daemon):
    reply = chat(daemon, "broken")
    assert reply.status_code == 503
    error = reply.json()["error"]
    assert error["code"] == "model_load_failed" and "broken" in error["message"]
    assert states(daemon)["broken"] == "failed"
    assert ("broken", "load_failed") in events(daemon)
    listed = httpx.get(f"{daemon.url}/v1/models/broken").json()
    assert listed["state"] == "failed" and listed["error"]
    for model in ("a", "b"):
        assert chat(daemon, model).status_code == 200
    assert httpx.get(f"{daemon.url}/ready").status_code == 200


def test_a_load_waits_while_a_busy_model_holds_the_memory(daemon):
    """c needs b's bytes while b streams: c waits (visibly), then b goes and c loads."""
    assert chat(daemon, "b").status_code == 200  # b loaded, c not

    async def main():
        client = daemon.async_openai()
        long = await client.chat.completions.create(
            model="b",
            messages=[{"role": "user", "content": "a long story"}],
            max_tokens=120,
            stream=True,
        )
        first = await long.__anext__()
        waiter = asyncio.create_task(
            client.chat.completions.create(
                model="c", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
        )
        seen_waiting = None
        rest = 0
        async for _ in long:
            rest += 1
            if seen_waiting is None:
                model = (await asyncio.to_thread(daemon.stats))["fleet"]
                c = next(m for m in model["models"] if m["id"] == "c")
                if c["wait_reason"]:
                    seen_waiting = (c["state"], c["wait_reason"], model["memory_queue"])
        b_done = time.monotonic()
        reply = await waiter
        return first, rest, seen_waiting, reply, b_done

    first, rest, seen, reply, _ = asyncio.run(main())
    assert first.model == "b" and rest > 50
    assert seen is not None, "c never showed that it waited for memory"
    state, reason, queue = seen
    assert state == "loading" and "waiting for memory" in reason and "b" in reason
    assert queue == ["c"]
    assert reply.model == "c"
    assert states(daemon)["b"] == "unloaded"


def _ready_over_budget(d: Daemon) -> dict | None:
    try:
        ready = httpx.get(f"{d.url}/ready", timeout=5)
    except httpx.HTTPError:
        return None  # still starting
    return ready.json() if "over-committed" in ready.json().get("reason", "") else None


def test_keep_alive_unloads_an_idle_model_and_a_request_loads_it_again(tmp_path, paths):
    config = toml_config(
        models={
            "a": {"path": str(paths["a"]), "pin": True, "prompt_cache": {"max_bytes": CACHE}},
            "b": {
                "path": str(paths["b"]),
                "keep_alive": "2s",
                "prompt_cache": {"max_bytes": CACHE},
            },
        },
    )
    d = Daemon(tmp_path, config).start()
    try:
        asked = time.monotonic()
        assert chat(d, "b").status_code == 200
        # Loaded right after its answer, unless the machine stalled past the keep_alive
        # meanwhile (whole-VM stalls of 1.6 s, once over 3 s, were seen under load) ...
        assert states(d)["b"] == "loaded" or time.monotonic() - asked > 2
        wait_for(lambda: states(d)["b"] == "unloaded", timeout=15)
        assert time.monotonic() - asked > 2  # ... and never unloaded before it
        idle = [e for e in d.stats()["fleet"]["events"] if e["kind"] == "idle"]
        assert idle and idle[0]["model"] == "b" and "keep_alive" in idle[0]["detail"]
        assert states(d)["a"] == "loaded"  # pinned: never idles out
        reply = chat(d, "b")
        assert reply.status_code == 200 and reply.json()["model"] == "b"
    finally:
        d.stop()


def test_every_api_routes_by_model_and_refuses_in_its_own_shape(daemon):
    messages = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    anthropic = httpx.post(f"{daemon.url}/v1/messages", json={"model": "nope", **messages})
    assert anthropic.status_code == 404
    body = anthropic.json()
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert "'a', 'b', 'c'" in body["error"]["message"]
    reply = httpx.post(
        f"{daemon.url}/v1/messages", json={"model": "bee", **messages}, timeout=60
    ).json()
    assert reply["model"] == "b" and reply["type"] == "message"
    counted = httpx.post(
        f"{daemon.url}/v1/messages/count_tokens",
        json={"model": "c", "messages": messages["messages"]},
        timeout=60,
    )
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    responses = httpx.post(
        f"{daemon.url}/v1/responses",
        json={"model": "gpt-5", "input": "hi", "max_output_tokens": 3},
        timeout=60,
    ).json()
    assert responses["model"] == "b" and responses["status"] in ("completed", "incomplete")
    unknown = httpx.post(f"{daemon.url}/v1/responses", json={"model": "nope", "input": "hi"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_mlxd_status_lists_every_model(daemon):
    from mlxd.control import status_lines

    lines, code = status_lines(daemon.url, daemon.stats())
    text = "\n".join(lines)
    assert "memory budget" in text
    for model in ("a", "b", "c", "huge", "broken"):
        assert f"    {model}: " in text
    assert "a: loaded, chat, default, pinned" in text
    assert code == 0  # the pinned model is loaded; the others load on demand


def test_a_live_prompt_cache_change_moves_the_models_reservation(tmp_path, paths):
    """Issue 20: the cap's reservation follows a reload; refusals name the key to change."""

    def config(cap: str) -> str:
        return toml_config(
            memory={"budget": "64MiB"},
            models={
                "a": {"path": str(paths["a"]), "pin": True, "prompt_cache": {"max_bytes": cap}}
            },
        )

    def reserved() -> int:
        return d.stats()["fleet"]["models"][0]["reserved_bytes"]

    def reload(cap: str) -> dict:
        d.write_config(config(cap))
        return d.reload().json()

    # Pinned: it loads over the budget, and the daemon says it cannot serve (issue 22).
    d = Daemon(tmp_path, config("1GiB")).start(wait_ready=False)
    try:
        ready = wait_for(lambda: _ready_over_budget(d), 120)
        assert "over-committed" in ready["reason"] and "a " in ready["reason"]
        a = reserved() - 1024 * MiB  # the weights as the load measured them
        assert 0 < a < 64 * MiB
        refused = chat(d, "a")
        assert refused.status_code == 400
        message = refused.json()["error"]["message"]
        assert refused.json()["error"]["code"] == "context_over_budget"
        assert "[models.a.prompt_cache] max_bytes" in message and "kv_budget" not in message
        assert "[memory] budget (64.0 MiB)" in message and "1.0 GiB of it" in message

        assert reload("8MiB")["outcome"] == "applied"  # shrinks at once
        assert reserved() == a + 8 * MiB
        assert httpx.get(f"{d.url}/ready").status_code == 200
        assert chat(d, "a").status_code == 200

        grown = reload("1GiB")  # does not fit: the model keeps 8 MiB, and says so
        assert grown["outcome"] == "partial"
        assert "prompt cache of a stays at 8.0 MiB" in grown["error"]
        assert "1.0 GiB does not fit in [memory] budget" in grown["error"]
        assert reserved() == a + 8 * MiB
        assert d.stats()["prompt_cache"]["max_bytes"] == 8 * MiB
        assert chat(d, "a").status_code == 200

        assert reload("16MiB")["outcome"] == "applied"  # fits: reserved
        assert reserved() == a + 16 * MiB
        assert d.stats()["prompt_cache"]["max_bytes"] == 16 * MiB
        assert chat(d, "a").status_code == 200
    finally:
        d.stop()
