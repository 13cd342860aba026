#!/usr/bin/env python
"""Image requests: mlxd against ``mlx_vlm.server`` on the same vision-language model.

**Waves** (both servers, one after the other, never together): for each concurrency C
(1, 2, 4, 8 by default) C streaming chat requests start together, each with its own
image (distinct pixels, so no prompt-cache hit) and the same short text, greedy,
``--max-tokens`` each. Reported per C and server: median and worst time to first token
(TTFT, request sent to first content chunk), and throughput (completion tokens of the
wave / wall time of the wave, prefill included). A warm-up wave runs first (mlx_vlm.server
loads its model on the first request).

**Stall** (mlxd only): one long text stream decodes; once it is past its first tokens,
``--joiners`` requests join it, first text-only requests whose prompts are as long as
the image requests' (their prefill chunk is today's yardstick), then image requests.
Reported: the longest gap between two chunks of the text stream while they join. The
vision tower runs between two steps, once per image set, so the image column should
stay near the text column (the gap of one prefill chunk).

**Joining** (both servers): one long text stream decodes; once it has streamed a few
chunks, C image requests join it. Reported per C: the joiners' median and worst TTFT,
and every stream's tokens per second from the join until the last joiner ends.

Usage: ``python benchmarks/vision.py [--model DIR | --family qwen2_vl] [--concurrency
1,2,4,8] [--max-tokens 32] [--image-size 28] [--repeats 3] [--no-peer]``. Without
``--model`` it uses the tests' tiny random-weight ``--family`` (default gemma3; built
locally; mlx_vlm.server's llava path fails on transformers 5 with this processor). A
Markdown table goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import itertools
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from servebench.processes import Server, free_port  # noqa: E402

logger = logging.getLogger("vision-bench")


def image_url(seed: int, size: int) -> str:
    """A PNG data URL whose pixels differ per ``seed``."""
    from PIL import Image

    image = Image.new("RGB", (size, size), ((seed * 37) % 256, (seed * 91) % 256, 128))
    for x in range(size):
        image.putpixel((x, (x * seed) % size), (255, (seed * 13) % 256, 0))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_body(model: str, max_tokens: int, url: str | None, text: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    if url is not None:
        content.append({"type": "image_url", "image_url": {"url": url}})
    return {
        "model": model,
        "messages": [{"role": "user", "content": content if url else text}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream(
    client: Any, base: str, body: dict[str, Any], chunks: list[float] | None = None
) -> dict[str, Any]:
    """One streaming request: when it was sent, its chunks' arrival times, its tokens."""
    sent = time.perf_counter()
    chunks = [] if chunks is None else chunks
    tokens = None
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            usage = event.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                tokens = usage["completion_tokens"]
            if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                chunks.append(time.perf_counter())
    return {"sent": sent, "chunks": chunks, "tokens": tokens}


async def wave(base: str, model: str, c: int, args: argparse.Namespace, seed: int):
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        bodies = [
            chat_body(model, args.max_tokens, image_url(seed + i, args.image_size), "describe it")
            for i in range(c)
        ]
        started = time.perf_counter()
        results = await asyncio.gather(*(stream(client, base, b) for b in bodies))
        wall = time.perf_counter() - started
    ttfts = [r["chunks"][0] - r["sent"] for r in results if r["chunks"]]
    # Completion tokens from the usage chunk (text chunks where a server sends none).
    tokens = sum(r["tokens"] if r["tokens"] is not None else len(r["chunks"]) for r in results)
    return {
        "ttft_median": statistics.median(ttfts) if ttfts else None,
        "ttft_max": max(ttfts) if ttfts else None,
        "tps": tokens / wall,
        "tokens": tokens,
    }


async def join(base: str, model: str, c: int, args: argparse.Namespace, seed: int):
    """C image requests joining a decoding text stream: their TTFT and the tokens per second
    of every stream (the text one's too) from when they join until the last one ends."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        chunks: list[float] = []
        long_body = chat_body(model, args.stall_tokens, None, "tell a long story")
        task = asyncio.create_task(stream(client, base, long_body, chunks))
        while len(chunks) < 4 and not task.done():  # decoding before they join
            await asyncio.sleep(0.01)
        bodies = [
            chat_body(model, args.max_tokens, image_url(seed + i, args.image_size), "describe it")
            for i in range(c)
        ]
        joined = time.perf_counter()
        results = await asyncio.gather(*(stream(client, base, b) for b in bodies))
        done = time.perf_counter()
        if task.done():
            raise RuntimeError("the text stream ended before the joiners: raise --stall-tokens")
        task.cancel()  # closing the stream cancels its row
        with contextlib.suppress(asyncio.CancelledError):
            await task
    ttfts = [r["chunks"][0] - r["sent"] for r in results if r["chunks"]]
    tokens = sum(r["tokens"] if r["tokens"] is not None else len(r["chunks"]) for r in results)
    tokens += sum(1 for t in chunks if joined <= t <= done)
    return {
        "ttft_median": statistics.median(ttfts) if ttfts else None,
        "ttft_max": max(ttfts) if ttfts else None,
        "tps": tokens / (done - joined),
        "tokens": tokens,
    }


def waves(base: str, model: str, args: argparse.Namespace, name: str) -> dict[Any, Any]:
    """Both kinds of wave at every concurrency, medians over the rounds."""
    out: dict[Any, Any] = {}
    for c in args.concurrency:
        rounds = range(args.repeats)
        out[c] = median_of([asyncio.run(wave(base, model, c, args, 100 * c + r)) for r in rounds])
        out[("join", c)] = median_of(
            [asyncio.run(join(base, model, c, args, 5000 + 100 * c + r)) for r in rounds]
        )
        logger.info("%s C=%d: %s; joining: %s", name, c, out[c], out[("join", c)])
    return out


async def stall(base: str, model: str, args: argparse.Namespace, images: bool, seed: int):
    """The longest gap in a decoding text stream while ``args.joiners`` requests join it."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        long_body = chat_body(model, args.stall_tokens, None, "tell a long story")
        chunks: list[float] = []
        task = asyncio.create_task(stream(client, base, long_body, chunks))
        await asyncio.sleep(args.stall_delay)
        if task.done():
            raise RuntimeError("the long stream ended before the joiners: raise --stall-tokens")
        if images:
            bodies = [
                chat_body(model, 4, image_url(seed + i, args.image_size), "describe it")
                for i in range(args.joiners)
            ]
        else:
            # As many prompt tokens as an image request: its text plus the image's tokens.
            filler = " ".join(["word"] * args.text_words)
            bodies = [chat_body(model, 4, None, f"{i} {filler}") for i in range(args.joiners)]
        joined = time.perf_counter()
        await asyncio.gather(*(stream(client, base, b) for b in bodies))
        done = time.perf_counter()
        await asyncio.sleep(0.3)
        task.cancel()  # closing the stream cancels its row
        with contextlib.suppress(asyncio.CancelledError):
            await task
    gaps = [b - a for a, b in itertools.pairwise(chunks) if b >= joined and a <= done]
    return max(gaps) if gaps else None


def run_mlxd(args: argparse.Namespace, model_dir: str, work: Path) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    config = work / "mlxd.toml"
    config.write_text(
        f'[model]\npath = "{model_dir}"\nname = "vlm"\n'
        f"[batch]\nsize = {max(args.concurrency) + args.joiners + 1}\n"
        f"prompt_concurrency = {max(args.concurrency)}\n"
        "[prompt_cache]\nmax_entries = 0\n[sampling]\nmax_tokens = 512\n"
    )
    cmd = [sys.executable, "-m", "mlxd", "serve", "--config", str(config), "--port", str(port)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out: dict[str, Any] = {}
    with Server("mlxd", cmd, env, f"{base}/ready", work / "mlxd.log", f"{base}/stats"):
        asyncio.run(wave(base, "vlm", max(args.concurrency), args, 1000))  # warm-up
        out.update(waves(base, "vlm", args, "mlxd"))
        # Alternated, so a change in the machine's load hits both alike.
        text, image = [], []
        for r in range(args.repeats):
            text.append(asyncio.run(stall(base, "vlm", args, False, 7000 + 10 * r)) or 0)
            image.append(asyncio.run(stall(base, "vlm", args, True, 8000 + 10 * r)) or 0)
        out["stall_text"], out["stall_images"] = statistics.median(text), statistics.median(image)
        logger.info("mlxd stall: text %s, images %s", out["stall_text"], out["stall_images"])
    return out


def tower_vs_chunk(model_dir: str, sizes: list[int], step: int) -> list[tuple[int, int, float]]:
    """In process: the vision tower's seconds for one image of each size, and a prefill chunk's.

    The tower runs once per image set, between two steps; a prefill chunk of
    ``step`` tokens is what a joining text prompt costs the other rows today.
    Returns (image side, image tokens, tower seconds) rows, then (0, step, chunk seconds).
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.config import ModelSettings
    from mlxd.engine.chat.intake import tokenize_with_images
    from mlxd.engine.chat.loading import load_model
    from mlxd.engine.images import ImageLimits, from_data_url
    from mlxd.engine.messages import ChatPrompt, GenerationRequest

    loaded = load_model(ModelSettings(path=model_dir), optimized_blas=False, generation=0)
    limits = ImageLimits(1 << 26, 1 << 26, 1)
    rows = []
    for side in sizes:
        image = from_data_url(image_url(side, side), "m", limits)
        content = [{"type": "text", "text": "describe"}, {"type": "image", "image": 0}]
        prompt = ChatPrompt(({"role": "user", "content": content},), images=(image,))
        _, images = tokenize_with_images(loaded, GenerationRequest("t", prompt, 1))
        assert images is not None
        times = []
        for _ in range(5):
            images.features = None
            started = time.perf_counter()
            loaded.model.register(images, list(images.ids))  # the tower for the image
            times.append(time.perf_counter() - started)
            loaded.model.release(images)
        rows.append((side, len(images.ids), statistics.median(times)))
    times = []
    for _ in range(5):
        cache = make_prompt_cache(loaded.model)
        ids = mx.array([[(i * 7) % 200 + 10 for i in range(step)]])
        started = time.perf_counter()
        mx.eval(loaded.model(ids, cache=cache))
        times.append(time.perf_counter() - started)
    rows.append((0, step, statistics.median(times)))
    return rows


def run_peer(args: argparse.Namespace, model_dir: str, work: Path) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlx_vlm.server", "--model", model_dir, "--port", str(port)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out: dict[str, Any] = {}
    with Server("mlx_vlm.server", cmd, env, f"{base}/health", work / "mlx_vlm.log"):
        asyncio.run(wave(base, model_dir, max(args.concurrency), args, 1000))  # loads the model
        out.update(waves(base, model_dir, args, "mlx_vlm.server"))
    return out


def median_of(waves: list[dict[str, Any]]) -> dict[str, Any]:
    """Each metric's median over the rounds."""
    return {
        k: statistics.median(w[k] for w in waves if w[k] is not None)
        if any(w[k] is not None for w in waves)
        else None
        for k in waves[0]
    }


def fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a vision-language model directory (default: a tiny one)")
    p.add_argument("--family", default="gemma3", help="the tests' tiny model without --model")
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--image-size", type=int, default=28)
    p.add_argument("--joiners", type=int, default=4)
    p.add_argument("--stall-tokens", type=int, default=3000)
    p.add_argument("--stall-delay", type=float, default=1.0)
    p.add_argument("--text-words", type=int, default=16)
    p.add_argument("--tower-sizes", default="28,224,448", help="image sides for the tower timing")
    p.add_argument("--step", type=int, default=512, help="prefill chunk (prefill_step_size)")
    p.add_argument("--repeats", type=int, default=3, help="rounds per point; medians shown")
    p.add_argument("--no-peer", action="store_true", help="skip mlx_vlm.server")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.model:
        model_dir = str(Path(args.model).expanduser())
    else:
        from tests.support.tinyvlms import tiny_vlm_dir

        model_dir = str(tiny_vlm_dir(args.family))
    tower = tower_vs_chunk(model_dir, [int(x) for x in args.tower_sizes.split(",")], args.step)
    with tempfile.TemporaryDirectory(prefix="vision-bench-") as tmp:
        work = Path(tmp)
        ours = run_mlxd(args, model_dir, work)
        peer = {} if args.no_peer else run_peer(args, model_dir, work)
    print(f"model: {model_dir}, {args.max_tokens} tokens per request, "
          f"{args.image_size}x{args.image_size} images\n")  # fmt: skip
    print("| C | mlxd TTFT median / max (ms) | mlx_vlm.server TTFT median / max (ms) "
          "| mlxd tok/s | mlx_vlm.server tok/s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for c in args.concurrency:
        a, b = ours[c], peer.get(c, {})
        print(
            f"| {c} | {fmt(a['ttft_median'], 1000)} / {fmt(a['ttft_max'], 1000)} "
            f"| {fmt(b.get('ttft_median'), 1000)} / {fmt(b.get('ttft_max'), 1000)} "
            f"| {fmt(a['tps'])} | {fmt(b.get('tps'))} |"
        )
    print(f"\n{args.stall_tokens}-token text stream decoding; C image requests join it:\n")
    print("| C | mlxd TTFT median / max (ms) | mlx_vlm.server TTFT median / max (ms) "
          "| mlxd tok/s | mlx_vlm.server tok/s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    for c in args.concurrency:
        a, b = ours[("join", c)], peer.get(("join", c), {})
        print(
            f"| {c} | {fmt(a['ttft_median'], 1000)} / {fmt(a['ttft_max'], 1000)} "
            f"| {fmt(b.get('ttft_median'), 1000)} / {fmt(b.get('ttft_max'), 1000)} "
            f"| {fmt(a['tps'])} | {fmt(b.get('tps'))} |"
        )
    print("\n| vision tower, one image | image tokens | seconds |")
    print("| --- | --- | --- |")
    for side, n, secs in tower[:-1]:
        print(f"| {side}x{side} | {n} | {fmt(secs, 1000)} ms |")
    print(f"| a prefill chunk (no image) | {tower[-1][1]} | {fmt(tower[-1][2], 1000)} ms |")
    print(
        f"\nlongest gap in a decoding text stream while {args.joiners} requests join (mlxd): "
        f"text-only joiners {fmt(ours['stall_text'], 1000)} ms, "
        f"image joiners {fmt(ours['stall_images'], 1000)} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
