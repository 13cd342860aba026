"""The HTTP client: C streaming chat completions started together, timed per chunk."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from typing import Any

from servebench.cpu import CpuWindow
from servebench.records import Stream, Wave, story_prompt

MAX_RETRIES = 3


async def stream_chat(client: Any, url: str, body: dict[str, Any]) -> Stream:
    """POST one streaming chat completion and time its chunks.

    A connection that breaks before any response arrives is retried (up to
    ``MAX_RETRIES`` times) and counted in ``Stream.retries``; the stream keeps
    its first send time, so the delay shows in its TTFT. This happens with
    ``mlx_lm.server``: its ``ThreadingHTTPServer`` listens with a backlog of
    5, so a burst of 16 new connections overflows the accept queue.
    """
    s = Stream(sent=time.perf_counter())
    for attempt in range(MAX_RETRIES + 1):
        s.retries = attempt
        responded = False
        try:
            async with client.stream("POST", url, json=body) as response:
                responded = True
                if response.status_code != 200:
                    s.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                    return s
                async for line in response.aiter_lines():
                    _take_line(s, line)
                    if s.error:
                        return s
            break
        except Exception as exc:  # reported per stream, the wave goes on
            s.error = f"{type(exc).__name__}: {exc}"
            if responded or attempt == MAX_RETRIES:
                return s
            s.error = None
    if s.end is None or not s.tokens:
        s.error = "the stream ended without finish_reason or usage"
    return s


def _take_line(s: Stream, line: str) -> None:
    """Record one server-sent-events line of a chat completion stream."""
    if not line.startswith("data:"):
        return
    payload = line[5:].strip()
    if not payload or payload == "[DONE]":
        return
    now = time.perf_counter()
    obj = json.loads(payload)
    if "error" in obj:
        s.error = str(obj["error"])[:300]
        return
    usage = obj.get("usage")
    if usage:
        s.tokens = usage.get("completion_tokens") or 0
        s.prompt_tokens = usage.get("prompt_tokens") or 0
    for choice in obj.get("choices") or []:
        text = (choice.get("delta") or {}).get("content")
        if text:
            s.chunks.append(now)
            s.text += text
            if s.first is None:
                s.first = now
        if choice.get("finish_reason"):
            s.finish_reason = choice["finish_reason"]
            s.end = now
            if s.first is None:  # the one token was EOS
                s.first = now


async def _poll_kv(client: Any, url: str, interval: float, peak: list[int]) -> None:
    # The first poll waits one interval: a /stats request that lands in the
    # same millisecond as the burst of new requests changes how mlxd groups
    # them for prefill (see README, "Results"), and the peak comes later anyway.
    while True:
        await asyncio.sleep(interval)
        with contextlib.suppress(Exception):
            batch = (await client.get(url)).json()["batch"]
            if batch["active_rows"]:
                peak[0] = max(peak[0], int(batch["kv_bytes"]))


async def _max_kv_seen(client: Any, base: str) -> int:
    with contextlib.suppress(Exception):
        return int((await client.get(f"{base}/stats")).json()["batch"]["max_kv_bytes_seen"])
    return 0


async def _wave(
    base: str, model: str, prompts: list[list[dict]], max_tokens: int, stats_interval: float | None
) -> tuple[float, list[Stream], int | None]:
    import httpx

    timeout = httpx.Timeout(None, connect=30)
    limits = httpx.Limits(
        max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4
    )
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        peak = [0]
        poller = None
        seen_before = await _max_kv_seen(client, base) if stats_interval else 0
        if stats_interval:
            poller = asyncio.create_task(_poll_kv(client, f"{base}/stats", stats_interval, peak))
        bodies = [
            {
                "model": model,
                "messages": p,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            for p in prompts
        ]
        t0 = time.perf_counter()
        streams = await asyncio.gather(
            *(stream_chat(client, f"{base}/v1/chat/completions", b) for b in bodies)
        )
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            # A wave shorter than the poll interval: the engine's own high-water
            # mark, when this wave raised it, is this wave's peak.
            seen_after = await _max_kv_seen(client, base)
            if seen_after > seen_before:
                peak[0] = max(peak[0], seen_after)
    # None: no poll landed while rows were running (a wave shorter than the interval).
    return t0, list(streams), (peak[0] or None) if stats_interval else None


def run_wave(
    system: str,
    base: str,
    model: str,
    c: int,
    args: argparse.Namespace,
    *,
    max_tokens: int,
    stats: bool,
    pid: int,
) -> Wave:
    prompts = [story_prompt(i) for i in range(c)]
    interval = args.stats_interval if stats else None
    window = CpuWindow(pid, "self")
    t0, streams, peak = asyncio.run(_wave(base, model, prompts, max_tokens, interval))
    return Wave(system, c, t0, streams, peak, window.background_cores())
