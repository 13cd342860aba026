#!/usr/bin/env python
"""A soak: mixed load on one daemon for a long while, its memory sampled over time.

Starts ``mlxd serve`` on a model (``--model tiny``: the tests' tiny random llama,
fast enough for many requests a second on a laptop CPU; or an mlx-lm directory,
or ``demo``) with three API keys at the three priority classes (one with a
requests-per-minute quota), ``[scheduling] preempt`` on and the Batch API, then
``--clients`` threads send, for ``--minutes``, a mix of: chat completions
(whole and streamed, one stream in ten dropped by the client mid-way), Responses
(stored, one in three continuing the previous one), Anthropic Messages (whole
and streamed), and every ``--batch-every`` seconds a small batch (one in five
cancelled, the rest read back, their files deleted), plus an upload dropped
mid-body now and then. Batch lines run in the lowest class, so interactive
requests preempt them.

Every ``--sample`` seconds it records the daemon's RSS (``/proc/<pid>/status``)
and from ``/stats`` MLX's active and cached bytes, the prompt cache's bytes and
the requests served; every ``--profile-every`` seconds ``GET /admin/memory``
(RSS, live objects by type and, with ``--tracemalloc N``, the Python heap by
allocation site, each grown since the warm-up baseline). After the load it
idles ``--idle`` seconds, then ``POST /admin/memory/trim``. Prints a per-minute
table and the sites that grew most; writes everything to ``--out`` as JSON.

Usage::

    python benchmarks/soak.py --minutes 30 --tracemalloc 1
    MALLOC_ARENA_MAX=2 python benchmarks/soak.py --minutes 15   # the allocator's share
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import logging
import os
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from servebench.processes import Server, free_port  # noqa: E402

logger = logging.getLogger("soak")
KEYS = {"alice": ("sk-soak-alice", "high"), "bob": ("sk-soak-bob", "normal")}
KEYS["carol"] = ("sk-soak-carol", "low")
WORDS = [
    "river",
    "stone",
    "cloud",
    "lamp",
    "orange",
    "violin",
    "seven",
    "quiet",
    "market",
    "ladder",
    "window",
    "signal",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, demo, or an mlx-lm model directory")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--batch-every", type=float, default=20.0)
    p.add_argument("--sample", type=float, default=15.0)
    p.add_argument("--profile-every", type=float, default=300.0)
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before the baseline")
    p.add_argument("--idle", type=float, default=60.0)
    p.add_argument("--tracemalloc", type=int, default=0, help="frames per site (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a config key for the daemon (TOML value), e.g. prompt_cache.disk_max_entries=512",
    )
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def model_dir(name: str, workdir: Path) -> str:
    if name == "tiny":
        from tests.support.tinymodels import tiny_model_dir

        return str(tiny_model_dir("llama"))
    if name == "demo":
        from servebench.processes import resolve_model

        ns = argparse.Namespace(model="demo", blas="auto", demo_dtype="auto")
        return resolve_model(ns, workdir)[0]
    return str(Path(name).expanduser().resolve())


def config(path: str, args: argparse.Namespace) -> str:
    keys = "\n".join(
        f'[keys.{name}]\nkey = "{secret}"\npriority = "{prio}"\n'
        + ("requests_per_minute = 40\n" if name == "carol" else "")
        for name, (secret, prio) in KEYS.items()
    )
    extra: dict[str, list[str]] = {}
    for item in args.set:
        name, _, value = item.partition("=")
        section, _, key = name.partition(".")
        extra.setdefault(section, []).append(f"{key} = {value}")
    sections = {
        "model": [f'path = "{path}"', 'name = "m"'],
        "batch": [f"size = {args.batch_size}"],
        "sampling": ["max_tokens = 64"],
        "scheduling": ["preempt = true"],
        "batches": [f"max_rows = {args.batch_size}"],
    }
    for section, lines in extra.items():
        sections.setdefault(section, []).extend(lines)
    body = "".join(f"[{name}]\n" + "\n".join(lines) + "\n\n" for name, lines in sections.items())
    return body + keys


def prompt(rng: random.Random) -> str:
    shared = "You are a terse assistant. " * rng.choice((0, 4, 16))
    return shared + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))


class Load:
    """The clients: each picks a request kind at random, over and over, until stopped."""

    def __init__(self, url: str, args: argparse.Namespace):
        self.url, self.args = url, args
        self.stop = threading.Event()
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def client(self, i: int) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        name = list(KEYS)[i % len(KEYS)]
        headers = {"Authorization": f"Bearer {KEYS[name][0]}"}
        previous: str | None = None
        kinds = ["chat", "chat_stream", "responses", "messages", "messages_stream"]
        with httpx.Client(base_url=self.url, headers=headers, timeout=300) as http:
            while not self.stop.is_set():
                kind = rng.choice(kinds)
                try:
                    previous = self.one(http, rng, kind, previous)
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    self.count(f"error:{type(exc).__name__}")

    def one(self, http: httpx.Client, rng: random.Random, kind: str, prev: str | None) -> Any:
        tokens = rng.randint(4, 48)
        text = prompt(rng)
        if kind.startswith("chat"):
            body = {"model": "m", "messages": [{"role": "user", "content": text}]}
            body |= {"max_tokens": tokens, "stream": kind == "chat_stream"}
            if kind == "chat":
                self.count(f"chat {http.post('/v1/chat/completions', json=body).status_code}")
                return prev
            drop = rng.random() < 0.1
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if drop and n >= 3:
                        break
            self.count("stream dropped" if drop else f"stream {r.status_code}")
            return prev
        if kind == "responses":
            body = {"model": "m", "input": text, "max_output_tokens": tokens}
            if prev and rng.random() < 0.33:
                body["previous_response_id"] = prev
            r = http.post("/v1/responses", json=body)
            self.count(f"responses {r.status_code}")
            return r.json().get("id") if r.status_code == 200 else None
        body = {"model": "m", "max_tokens": tokens, "messages": [{"role": "user", "content": text}]}
        if kind == "messages_stream":
            with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
                for _ in r.iter_lines():
                    pass
        else:
            r = http.post("/v1/messages", json=body)
        self.count(f"{kind} {r.status_code}")
        return prev

    def batches(self) -> None:
        rng = random.Random(self.args.seed + 7)
        headers = {"Authorization": f"Bearer {KEYS['bob'][0]}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=120) as http:
            while not self.stop.wait(self.args.batch_every):
                try:
                    self.batch(http, rng)
                    if rng.random() < 0.3:
                        self.dropped_upload()
                except (httpx.HTTPError, ValueError, KeyError, OSError) as exc:
                    self.count(f"batch error:{type(exc).__name__}")

    def batch(self, http: httpx.Client, rng: random.Random) -> None:
        lines = []
        for j in range(8):
            body = {"model": "m", "messages": [{"role": "user", "content": prompt(rng)}]}
            body["max_tokens"] = rng.randint(8, 48)
            lines.append({"custom_id": f"l{j}", "method": "POST", "url": "/v1/chat/completions"})
            lines[-1]["body"] = body
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        files = {"file": ("soak.jsonl", io.BytesIO(data), "application/jsonl")}
        up = http.post("/v1/files", data={"purpose": "batch"}, files=files).json()
        create = {"input_file_id": up["id"], "endpoint": "/v1/chat/completions"}
        batch = http.post("/v1/batches", json={**create, "completion_window": "1h"}).json()
        if rng.random() < 0.2:
            time.sleep(rng.random() * 2)
            http.post(f"/v1/batches/{batch['id']}/cancel", json={})
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not self.stop.is_set():
            got = http.get(f"/v1/batches/{batch['id']}").json()
            if got["status"] in ("completed", "cancelled", "failed", "expired"):
                self.count(f"batch {got['status']}")
                for f in (got.get("output_file_id"), got.get("error_file_id")):
                    if f:
                        http.get(f"/v1/files/{f}/content")
                        http.delete(f"/v1/files/{f}")
                break
            time.sleep(1)
        http.delete(f"/v1/files/{up['id']}")

    def dropped_upload(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        head = b'--b\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n\r\n'
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(
                f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\n"
                f"Authorization: Bearer {KEYS['bob'][0]}\r\n"
                "Content-Type: multipart/form-data; boundary=b\r\n"
                f"Content-Length: {len(head) + (4 << 20)}\r\n\r\n".encode()
                + head
                + b"x" * (256 << 10)
            )
        self.count("upload dropped")


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def sample(url: str, pid: int, t0: float) -> dict[str, Any]:
    stats = httpx.get(f"{url}/stats", timeout=30).json()
    memory = stats.get("memory") or {}
    counters = stats.get("counters", {})
    return {
        "t_s": round(time.monotonic() - t0, 1),
        "rss_mib": round(rss_of(pid) / 2**20, 1),
        "mlx_active_mib": round(memory.get("active_bytes", 0) / 2**20, 1),
        "mlx_cache_mib": round(memory.get("cache_bytes", 0) / 2**20, 1),
        "prompt_cache_mib": round(stats.get("prompt_cache", {}).get("bytes", 0) / 2**20, 1),
        "requests": counters.get("finished"),
        "preemptions": counters.get("preemptions"),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="mlxd-soak-"))
    path = model_dir(args.model, work)
    (work / "mlxd.toml").write_text(config(path, args))
    port = free_port()
    env = {**os.environ, "MLXD_SERVER__STATE_DIR": str(work / "state")}
    if args.tracemalloc:
        env["MLXD_TRACEMALLOC"] = str(args.tracemalloc)
    cmd = [sys.executable, "-m", "mlxd", "serve", "--config", str(work / "mlxd.toml")]
    url = f"http://127.0.0.1:{port}"
    cmd += ["--port", str(port)]
    result: dict[str, Any] = {"args": vars(args), "command": " ".join(sys.argv), "samples": []}
    result["env"] = {k: v for k, v in env.items() if k.startswith(("MALLOC_", "MLXD_TRACE"))}
    with Server("mlxd", cmd, env, f"{url}/ready", work / "mlxd.log") as server:
        assert server.proc is not None
        pid, t0 = server.proc.pid, time.monotonic()
        load = Load(url, args)
        threads = [threading.Thread(target=load.client, args=(i,)) for i in range(args.clients)]
        threads.append(threading.Thread(target=load.batches))
        for t in threads:
            t.start()
        end = t0 + args.minutes * 60
        profiles, based, next_profile = [], False, t0 + args.warmup + args.profile_every
        try:
            while time.monotonic() < end:
                time.sleep(min(args.sample, max(end - time.monotonic(), 0)))
                s = sample(url, pid, t0)
                result["samples"].append(s)
                logger.info("%s %s", s, dict(sorted(load.counts.items())))
                if not based and time.monotonic() >= t0 + args.warmup:
                    httpx.post(f"{url}/admin/memory/baseline", timeout=120)
                    based = True
                if based and time.monotonic() >= next_profile:
                    profiles.append(httpx.get(f"{url}/admin/memory?limit=15", timeout=300).json())
                    next_profile += args.profile_every
        finally:
            load.stop.set()
            for t in threads:
                t.join(timeout=330)
        result["counts"] = load.counts
        time.sleep(args.idle)
        result["idle"] = sample(url, pid, t0)
        profiles.append(httpx.get(f"{url}/admin/memory?limit=25", timeout=300).json())
        result["trim"] = httpx.post(f"{url}/admin/memory/trim", timeout=120).json()
        result["after_trim"] = sample(url, pid, t0)
        result["profiles"] = profiles
    out = Path(
        args.out or ROOT / "benchmarks" / "results" / f"soak-{dt.datetime.now():%Y%m%d-%H%M}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    report(result)
    print(f"\nwritten to {out}")
    return 0


def report(result: dict[str, Any]) -> None:
    print("| minute | RSS MiB | MLX active MiB | MLX cache MiB | prompt cache MiB |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    seen = set()
    for s in result["samples"]:
        minute = int(s["t_s"] // 60)
        if minute in seen:
            continue
        seen.add(minute)
        print(
            f"| {minute} | {s['rss_mib']} | {s['mlx_active_mib']} | {s['mlx_cache_mib']} "
            f"| {s['prompt_cache_mib']} |"
        )
    for name in ("idle", "after_trim"):
        s = result[name]
        cells = (s["rss_mib"], s["mlx_active_mib"], s["mlx_cache_mib"], s["prompt_cache_mib"])
        print(f"| {name} | " + " | ".join(str(c) for c in cells) + " |")
    print("\nrequests:", json.dumps(dict(sorted(result["counts"].items()))))
    last = result["profiles"][-1]
    print(f"\nRSS grown since the baseline: {last['rss_growth_bytes'] / 2**20:.1f} MiB")
    print(
        "object types grown:", [(o["type"], o["growth"]) for o in last["object_types_grown"][:10]]
    )
    if last.get("tracemalloc"):
        for site in last["tracemalloc"]["top"][:15]:
            grown = site["size_growth_bytes"] / 1024
            print(f"  {grown:10.1f} KiB  {site['count_growth']:8d}  {site['where']}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
