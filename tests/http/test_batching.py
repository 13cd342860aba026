"""Continuous batching against the real daemon on a real port, with real clients."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from tests.support.daemon import toml_config

BATCH = 3


@pytest.fixture(scope="module")
def daemon(apps, tiny_models):
    text = toml_config(
        model={"path": str(tiny_models("llama"))},
        batch={"size": BATCH},
        sampling={"temperature": 0.0},
    )
    return apps.get(text, env={"MLXD_FAULT_INJECTION": "1"})


async def sse(client: httpx.AsyncClient, body: dict, *, stop_after: int | None = None) -> dict:
    """One streaming request; returns status, headers, parsed events and the raw tail."""
    events = []
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        result = {"status": r.status_code, "lane": r.headers.get("x-mlxd-lane")}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if stop_after is not None and len(events) >= stop_after:
                break  # closing the response drops the connection mid-stream
    result["events"] = events
    return result


def body(model, i, max_tokens, **kw):
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"request {i}"}],
        "max_tokens": max_tokens,
        **kw,
    }


def assert_well_formed(result, max_tokens):
    events = result["events"]
    assert result["status"] == 200
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == max_tokens
    assert len({c["id"] for c in chunks}) == 1


def test_many_concurrent_streams_complete_within_the_batch_width(daemon):
    model = daemon.model_id()

    async def main():
        async with httpx.AsyncClient(base_url=daemon.url, timeout=120) as client:
            opts = {"stream_options": {"include_usage": True}}
            return await asyncio.gather(
                *(sse(client, body(model, i, 60, **opts)) for i in range(3 * BATCH + 1))
            )

    results = asyncio.run(main())
    for r in results:
        assert r["lane"] == "batch"
        assert_well_formed(r, 60)
    stats = daemon.stats()
    assert stats["batch"]["max_active_rows_seen"] == BATCH


def test_seeded_request_during_load_drains_once_and_reproduces(daemon):
    model = daemon.model_id()
    seeded = body(model, "seeded", 30, temperature=1.0, seed=11)
    drains_before = daemon.stats()["counters"]["drains"]
    alone = httpx.post(f"{daemon.url}/v1/chat/completions", json=seeded, timeout=60).json()

    async def main():
        async with httpx.AsyncClient(base_url=daemon.url, timeout=120) as client:
            batch = [asyncio.create_task(sse(client, body(model, i, 400))) for i in range(BATCH)]
            while daemon.stats()["batch"]["active_rows"] < BATCH:
                await asyncio.sleep(0.01)
            r = await client.post("/v1/chat/completions", json=seeded)
            return r, await asyncio.gather(*batch)

    during, batch = asyncio.run(main())
    assert during.headers["x-mlxd-lane"] == "serial; reason=seed"
    assert (
        during.json()["choices"][0]["message"]["content"]
        == alone["choices"][0]["message"]["content"]
    )
    assert all(b["events"][-1] == "[DONE]" for b in batch)
    stats = daemon.stats()
    assert stats["counters"]["drains"] == drains_before + 1
    drain = stats["drains"][0]
    assert drain["reason"] == "seed" and drain["rows_at_start"] == BATCH and drain["ended_at"]


def test_killed_clients_free_their_rows(daemon):
    model = daemon.model_id()
    before = daemon.stats()["counters"]["requests"]["batch"]["cancelled"]

    async def main():
        async with httpx.AsyncClient(base_url=daemon.url, timeout=120) as client:
            await asyncio.gather(
                *(sse(client, body(model, i, 3000), stop_after=5) for i in range(BATCH))
            )

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while True:
        stats = daemon.stats()
        if (
            stats["batch"]["active_rows"] == 0
            and stats["counters"]["requests"]["batch"]["cancelled"] == before + BATCH
        ):
            break
        assert time.monotonic() < deadline, stats["batch"]
        time.sleep(0.05)


def test_a_row_whose_logits_processor_raises_fails_alone(daemon):
    model = daemon.model_id()

    async def main():
        async with httpx.AsyncClient(base_url=daemon.url, timeout=120) as client:
            return await asyncio.gather(
                sse(client, body(model, "a", 50, stream_options={"include_usage": True})),
                sse(client, body(model, "bad", 50, mlxd_fault="logits_processor@4")),
                sse(client, body(model, "b", 50, stream_options={"include_usage": True})),
            )

    good_a, bad, good_b = asyncio.run(main())
    assert_well_formed(good_a, 50)
    assert_well_formed(good_b, 50)
    error = json.loads(bad["events"][-1])["error"]
    assert (
        error["code"] == "generation_error"
        and "injected logits processor failure" in error["message"]
    )
    assert "[DONE]" not in bad["events"]


@pytest.fixture(scope="module")
def budgeted(apps, tiny_models):
    # tiny llama: 1 KiB per token per row. Each request below (a short chat prompt +
    # 100 tokens) projects 256 slots alone, and prompt + 100 + 255 in a shared batch:
    # two fit, three do not.
    budget = 2 * 400 * 1024
    text = toml_config(
        model={"path": str(tiny_models("llama"))},
        batch={"size": 8, "kv_budget": budget, "decode_allowance": 100},
        sampling={"temperature": 0.0},
    )
    return apps.get(text), budget


def test_real_kv_bytes_never_exceed_a_small_budget(budgeted):
    daemon, budget = budgeted
    model = daemon.model_id()
    seen = []

    async def main():
        async with httpx.AsyncClient(base_url=daemon.url, timeout=120) as client:
            tasks = [asyncio.create_task(sse(client, body(model, i, 100))) for i in range(6)]
            while not all(t.done() for t in tasks):
                s = (await client.get("/stats")).json()
                seen.append(
                    (
                        s["batch"]["kv_bytes"],
                        s["batch"]["active_rows"],
                        [p["waiting_for"] for p in s["pending"]],
                    )
                )
                await asyncio.sleep(0.01)
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert all(r["events"][-1] == "[DONE]" for r in results)
    assert max(kv for kv, _, _ in seen) <= budget
    assert max(rows for _, rows, _ in seen) == 2
    assert any("budget" in waiting for _, _, waiting in seen)
    assert 0 < daemon.stats()["batch"]["max_kv_bytes_seen"] <= budget


def test_a_request_that_can_never_fit_gets_400(budgeted):
    daemon, _ = budgeted
    r = httpx.post(
        f"{daemon.url}/v1/chat/completions",
        json={
            "model": daemon.model_id(),
            "messages": [{"role": "user", "content": "word " * 400}],
            "max_tokens": 50,
        },
        timeout=30,
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_over_budget"
    assert "[batch] kv_budget (800 KiB)" in err["message"]


async def sse_lines(response: httpx.Response):
    """An event stream's lines, split on line feeds only, as SSE defines them (httpx's
    ``aiter_lines`` also splits on U+2028 and U+0085, which JSON leaves unescaped and a
    random tiny model does emit)."""
    pending = ""
    async for text in response.aiter_text():
        *lines, pending = (pending + text).split("\n")
        for line in lines:
            yield line.rstrip("\r")


SOAK_WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "dogs",
    "ran",
    "over",
    "green",
    "hills",
    "and",
    "birds",
    "sang",
]


@pytest.fixture(scope="module")
def soaked(apps, tiny_models):
    # The soak (kv_budget = "64MiB" on the demo model: about 1,456 tokens of
    # KV), scaled to the tiny llama's 1 KiB per token.
    budget = 1456 * 1024
    config = toml_config(
        model={"path": str(tiny_models("llama"))},
        batch={"size": 8, "kv_budget": budget},
        sampling={"temperature": 0.7},
    )
    return apps.get(config, name="kv-soak"), budget


def test_real_kv_bytes_stay_within_the_budget_through_a_soak_with_cancels(soaked):
    """6 clients, conversations of 5-250-word turns sharing prefixes, 10% cancels, for 24
    finished turns, a cancel and 120 samples or 20 s, whichever comes first; /stats
    sampled as fast as it answers, and the engine's own per-step peak."""
    daemon, budget = soaked
    model = daemon.model_id()
    seen: list[int] = []
    counts = {"ok": 0, "cancelled": 0, "refused": 0}
    errors: list = []
    started = time.monotonic()
    stop = started + 20
    # It ends early once it has seen this much (a quiet machine gets there in seconds): the
    # assertions below need 20 turns, a cancel and 100 samples; the quota is a little more.
    # (A bigger quota only makes the run longer: when 20 s pass first, it ends there anyway.)
    enough = {"ok": 24, "cancelled": 1, "samples": 120}

    def done() -> bool:
        if time.monotonic() >= stop:
            return True
        return (
            counts["ok"] >= enough["ok"]
            and counts["cancelled"] >= enough["cancelled"]
            and len(seen) >= enough["samples"]
        )

    async def client(n: int) -> None:
        rnd = random.Random(n)
        system = {"role": "system", "content": "You answer briefly. " * rnd.choice([1, 3, 9])}
        history: list[dict] = []
        async with httpx.AsyncClient(base_url=daemon.url, timeout=120) as c:
            while not done():
                words = " ".join(rnd.choice(SOAK_WORDS) for _ in range(rnd.randint(5, 250)))
                if not history or rnd.random() < 0.4 or len(history) > 4:
                    history = [system]
                messages = [*history, {"role": "user", "content": words}]
                request = {"model": model, "messages": messages, "stream": True}
                request["max_tokens"] = rnd.randint(8, 120)
                cancel_after = rnd.randint(2, 20) if rnd.random() < 0.1 else None
                text, chunks = "", 0
                async with c.stream("POST", "/v1/chat/completions", json=request) as r:
                    if r.status_code != 200:
                        if r.status_code == 400:
                            counts["refused"] += 1  # a conversation grew past the budget
                        else:
                            errors.append((r.status_code, (await r.aread())[:200]))
                        history = []
                        continue
                    async for line in sse_lines(r):
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            errors.append(event["error"])
                            break
                        chunks += 1
                        if event["choices"]:
                            text += event["choices"][0]["delta"].get("content") or ""
                        if cancel_after is not None and chunks >= cancel_after:
                            break
                if cancel_after is not None and chunks >= cancel_after:
                    counts["cancelled"] += 1
                    history = []
                else:
                    counts["ok"] += 1
                    history = [*messages, {"role": "assistant", "content": text}]

    async def sample() -> None:
        async with httpx.AsyncClient(base_url=daemon.url, timeout=30) as c:
            while not finished.is_set():
                seen.append((await c.get("/stats")).json()["batch"]["kv_bytes"])
                await asyncio.sleep(0.005)

    finished = asyncio.Event()

    async def clients() -> None:
        await asyncio.gather(*(client(n) for n in range(6)))
        await asyncio.sleep(0.2)  # a few samples after the last turn ended
        finished.set()

    async def main() -> None:
        await asyncio.gather(sample(), clients())

    asyncio.run(main())
    stats = daemon.stats()
    assert errors == [] and counts["ok"] > 20 and counts["cancelled"] > 0, counts
    assert stats["prompt_cache"]["hits"] > 0  # the turns shared prefixes
    assert len(seen) > 100 and max(seen) <= budget, (max(seen), budget)
    assert 0 < stats["batch"]["max_kv_bytes_seen"] <= budget
    assert stats["counters"]["kv_over_budget_steps"] == 0
    assert (
        httpx.post(
            f"{daemon.url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=60,
        ).status_code
        == 200
    )


def test_a_non_streaming_client_that_goes_away_cancels_its_row(daemon):
    before = daemon.stats()["counters"]["requests"]["batch"]["cancelled"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{daemon.url}/v1/chat/completions",
            json=body(daemon.model_id(), "impatient", 3000),
            timeout=httpx.Timeout(10, read=0.5),
        )
    deadline = time.monotonic() + 10
    while True:
        stats = daemon.stats()
        cancelled = stats["counters"]["requests"]["batch"]["cancelled"]
        if cancelled == before + 1 and stats["batch"]["active_rows"] == 0:
            break
        assert time.monotonic() < deadline, stats["batch"]
        time.sleep(0.05)
