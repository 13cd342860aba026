"""Several models at once, the demo model among them (issue 12).

The demo model (SmolLM2) and two tiny models in one daemon: streams to
different models make progress together, a long prefill of the demo model
does not hold a tiny model's stream, and a reload that removes one model
and adds another while streams run loses nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.daemon import toml_config

pytestmark = pytest.mark.slow  # the demo model is one of the fleet

DEMO = "demo"


def registry(tiny_models, *, with_b: bool = True, with_c: bool = False) -> dict:
    models = {
        # Its own sampling defaults: it samples while the tiny models are greedy.
        DEMO: {"pin": True, "sampling": {"temperature": 0.8}},
        "a": {"path": str(tiny_models("llama")), "pin": True},
    }
    if with_b:
        models["b"] = {"path": str(tiny_models("llama_b")), "aliases": ["bee-*"]}
    if with_c:
        models["c"] = {"path": str(tiny_models("llama", seed=1))}
    return models


def config(tiny_models, **kw) -> str:
    return toml_config(
        batch={"size": 4},
        sampling={"temperature": 0.0},
        models=registry(tiny_models, **kw),
    )


@pytest.fixture(scope="module")
def daemon(daemons, tiny_models):
    # Its own: the last test reloads it with another registry.
    return daemons.get(config(tiny_models), name="fleet-demo")


async def timed_stream(
    client, model: str, prompt: str, max_tokens: int, started: asyncio.Event | None = None
) -> list[float]:
    """Arrival times of a stream's content chunks; the last item is its completion tokens.

    ``started`` is set when the first content chunk arrives."""
    times: list[float] = []
    usage = None
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content is not None:
            times.append(time.monotonic())
            if started is not None:
                started.set()
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    assert usage is not None, "the stream ended without its usage chunk"
    return [*times, usage]


async def stream_until(client, model: str, prompt: str, stop: asyncio.Event) -> list[float]:
    """Arrival times of a long stream's content chunks, read until ``stop`` is set."""
    times: list[float] = []
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=3000,
        stream=True,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content is not None:
            times.append(time.monotonic())
        if stop.is_set():
            break
    await stream.close()
    return times


# The demo stream's length: the assertions need 5 of its tokens inside the tiny stream.
DEMO_TOKENS = 30


def test_streams_to_two_models_interleave(daemon):
    """The tiny model's stream runs for as long as the demo model's (it is cut when
    the demo's ends), so the overlap is the demo stream's whole life however slow a
    loaded machine makes either model (issue 22: a fixed 400 tiny tokens finished
    before the demo's tenth on a busy 2-core machine). Were one model's engine to
    hold the other's, the demo's tokens would not arrive inside the tiny stream."""

    async def main():
        client = daemon.async_openai()
        stop = asyncio.Event()
        tiny = asyncio.create_task(stream_until(client, "a", "story", stop))
        demo = await timed_stream(client, DEMO, "Tell me about the sea.", DEMO_TOKENS)
        stop.set()
        return demo, await tiny

    demo, tiny = asyncio.run(main())
    assert 0 < demo.pop() <= DEMO_TOKENS
    assert tiny[-1] > demo[-1], "the tiny stream (3000 tokens) ended before the demo's"
    overlap_start, overlap_end = max(demo[0], tiny[0]), demo[-1]
    assert overlap_end > overlap_start, "one stream finished before the other began"
    during = [t for t in tiny if overlap_start <= t <= overlap_end]
    demo_during = [t for t in demo if overlap_start <= t <= overlap_end]
    # Both made progress in the same interval, each many times over: the demo's
    # tokens (but its first two, which may come before the tiny stream's first).
    assert len(demo_during) >= len(demo) - 2 and len(demo_during) >= 5, (len(demo), demo_during)
    assert len(during) >= 10, len(during)


def test_each_model_samples_with_its_own_defaults(daemon):
    client = daemon.openai()

    def once(model: str) -> str | None:
        return (
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Name three colours."}],
                max_tokens=24,
            )
            .choices[0]
            .message.content
        )

    def twice(model: str) -> tuple[str | None, str | None]:
        with ThreadPoolExecutor(2) as pool:
            first, second = pool.map(once, [model, model])
        return first, second

    greedy = (once("a"), once("a"))  # one after the other: no batch padding between them
    assert greedy[0] == greedy[1]  # [sampling] temperature = 0 for a
    # The demo model's four answers at once (batch size 4): they decode in one batch
    # instead of one after another; each pair is still two requests on one prompt.
    with ThreadPoolExecutor(2) as pool:
        sampled = list(pool.map(twice, [DEMO, DEMO]))
    assert any(x != y for x, y in sampled), sampled  # the demo model's own 0.8


def test_a_long_prefill_of_one_model_does_not_hold_another_models_stream(daemon):
    # About 800 tokens: two prefill chunks, seconds of work for the demo model on a CPU.
    long_prompt = " ".join(f"item {i} is blue;" for i in range(100))

    async def main():
        client = daemon.async_openai()
        running = asyncio.Event()
        tiny = asyncio.create_task(timed_stream(client, "a", "story", 800, running))
        await asyncio.wait_for(running.wait(), 120)  # the tiny stream is running
        sent = time.monotonic()
        reply = await client.chat.completions.create(
            model=DEMO, messages=[{"role": "user", "content": long_prompt}], max_tokens=1
        )
        answered = time.monotonic()
        times = await tiny
        return times[:-1], sent, answered, reply

    times, sent, answered, reply = asyncio.run(main())
    prompt_tokens = reply.usage.prompt_tokens
    step = 512  # [batch] prefill_step_size: the demo model's prefill chunk
    chunks = -(-prompt_tokens // step)
    assert prompt_tokens > step and answered - sent > 1.0, (prompt_tokens, answered - sent)
    during = [b - a for a, b in itertools.pairwise(times) if a >= sent and b <= answered]
    assert len(during) > 20, "the tiny stream stopped while the demo model prefilled"
    # The tiny model's worst gap is below one prefill chunk of the demo model.
    one_chunk = (answered - sent) / chunks
    assert max(during) < one_chunk, (max(during), one_chunk, chunks)


def _all_lent(stats: dict, n: int) -> bool:
    models = stats["fleet"]["models"]
    return sum(m["active"] for m in models) >= n and not any(m["waiting"] for m in models)


def test_reload_adds_and_removes_models_under_load_and_every_stream_completes(daemon, tiny_models):
    async def main():
        client = daemon.async_openai()
        streams = [
            asyncio.create_task(timed_stream(client, model, f"story {i}", n))
            for i, (model, n) in enumerate([("a", 300), ("b", 300), ("bee-1", 300), (DEMO, 40)])
        ]
        # Every stream has its model lent (none still waits on b's load): a reload that
        # removes a model while a request waits on its load leaves that request waiting
        # (a fleet bug, not what this test is about; see the closing note).
        while not _all_lent(await asyncio.to_thread(daemon.stats), 4):
            await asyncio.sleep(0.05)
        daemon.write_config(config(tiny_models, with_b=False, with_c=True))
        reload = (await asyncio.to_thread(daemon.reload)).json()
        return reload, await asyncio.gather(*streams)

    reload, streams = asyncio.run(main())
    assert reload["outcome"] == "applied", reload
    assert {"models.b", "models.c"} <= set(reload["applied"])
    # Every stream ran to its end, b's two too: a removed model finishes first.
    assert [times[-1] for times in streams[:3]] == [300, 300, 300]
    assert 0 < streams[3][-1] <= 40  # the demo model samples: it may stop early
    gone = httpx.post(
        f"{daemon.url}/v1/chat/completions",
        json={"model": "b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
        timeout=60,
    )
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    reply = daemon.openai().chat.completions.create(
        model="c", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )
    assert reply.model == "c"
    fleet = daemon.stats()["fleet"]
    assert [m["id"] for m in fleet["models"]] == [DEMO, "a", "c"]
    kinds = [(e["model"], e["kind"]) for e in fleet["events"]]
    assert ("b", "removed") in kinds and ("c", "added") in kinds
