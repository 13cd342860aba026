"""Reloading the TOML while the daemon runs: POST /admin/reload and SIGHUP."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import signal
import threading
import time

import httpx
import pytest

from tests.support.daemon import Daemon, free_port, toml_config


def config(model_dir, **batch):
    return toml_config(
        model={"path": str(model_dir)},
        batch={"size": 4, "prompt_concurrency": 4, **batch},
        sampling={"temperature": 0.0},
    )


@pytest.fixture(scope="module")
def daemon(daemons, tiny_models):
    # Its own: every test here reloads it.
    return daemons.get(config(tiny_models("llama")), name="reload")


class StatsPoller:
    """Polls /stats in a thread; records (time, active_rows, projected, configured, budget)."""

    def __init__(self, url: str):
        self.url = url
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                s = client.get(f"{self.url}/stats").json()
                self.samples.append(
                    {"t": time.monotonic(), **s["batch"], "ids": [r["id"] for r in s["rows"]]}
                )
                time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


async def stream(client, model, i, max_tokens):
    chunks = []
    resp = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"story number {i}"}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in resp:
        chunks.append(chunk)
    return chunks


def admissions_under_a_new_config(samples, since):
    """Samples where a row appeared that was admitted under the limits the sample shows.

    A row first seen in a sample whose predecessor already showed the same
    limits cannot have been admitted under older ones: every row admitted
    before a config applies is in every snapshot built after it.
    """
    out, seen = [], set()
    for prev, cur in itertools.pairwise(samples):
        seen |= set(prev["ids"])
        new = set(cur["ids"]) - seen
        same = (prev["configured"], prev["kv_budget_bytes"]) == (
            cur["configured"],
            cur["kv_budget_bytes"],
        )
        if new and same and cur["t"] > since:
            out.append(cur)
    return out


def test_reload_under_load_halves_then_raises_limits(daemon, tiny_models):
    model = daemon.model_id()
    budget = 8 * 512 * 1024  # eight rows of up to 512 slots of the tiny llama (1 KiB per token)
    daemon.write_config(config(tiny_models("llama"), kv_budget=budget, decode_allowance=300))
    assert daemon.reload().json()["outcome"] == "applied"
    version0 = daemon.stats()["config"]["version"]

    async def main(poller):
        client = daemon.async_openai()
        tasks = [asyncio.create_task(stream(client, model, i, 300)) for i in range(16)]
        # A full batch under the first limits (a loaded machine takes a while to fill it).
        deadline = time.monotonic() + 60
        while not any(s["active_rows"] == 4 for s in poller.samples):
            assert time.monotonic() < deadline, poller.samples[-1:]
            await asyncio.sleep(0.05)
        daemon.write_config(
            config(tiny_models("llama"), size=2, kv_budget=budget // 2, decode_allowance=300)
        )
        halved = await asyncio.to_thread(daemon.reload)
        t_halved = time.monotonic()
        # Raise again once a row was admitted under the halved limits (on a
        # busy machine the first rows take a while to finish).
        deadline = t_halved + 60
        while time.monotonic() < deadline and not any(
            s["configured"] == 2 for s in admissions_under_a_new_config(poller.samples, t_halved)
        ):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        daemon.write_config(
            config(tiny_models("llama"), size=6, kv_budget=budget, decode_allowance=300)
        )
        raised = await asyncio.to_thread(daemon.reload)
        t_raised = time.monotonic()
        return await asyncio.gather(*tasks), halved.json(), raised.json(), t_halved, t_raised

    with StatsPoller(daemon.url) as poller:
        results, halved, raised, t_halved, t_raised = asyncio.run(main(poller))
    assert halved["outcome"] == "applied" and set(halved["applied"]) == {
        "batch.size",
        "batch.kv_budget",
    }
    assert raised["outcome"] == "applied"
    for chunks in results:  # every stream intact
        text_chunks = [c for c in chunks if c.choices]
        assert text_chunks[-1].choices[0].finish_reason == "length"
        assert chunks[-1].usage.completion_tokens == 300
    assert max(s["active_rows"] for s in poller.samples if s["t"] < t_halved) == 4
    admitted = admissions_under_a_new_config(poller.samples, t_halved)
    assert any(s["configured"] == 2 for s in admitted), "rows were admitted under the halved limits"
    for s in admitted:  # each admission respects the limits in force when it happened
        assert s["active_rows"] <= s["configured"], s
        assert s["kv_projected_bytes"] <= s["kv_budget_bytes"], s
    after_raise = [
        (round(s["t"] - t_raised, 2), s["active_rows"], s["pending_rows"])
        for s in poller.samples
        if s["t"] > t_raised
    ]
    assert any(a > 4 for _, a, _ in after_raise), after_raise
    stats = daemon.stats()
    assert stats["config"]["version"] == version0 + 2
    assert stats["batch"]["configured"] == 6
    events = stats["reloads"][:2]
    assert [e["outcome"] for e in events] == ["applied", "applied"]
    assert events[0]["version"] == version0 + 2 and "batch.size" in events[0]["changed"]


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[batch]\nsize = \n", "line 4"),
        ("[batch]\nbatch_sise = 2\n", "[batch] batch_sise: unknown key"),
        ('[batch]\nsize = "two"\n', "[batch] size"),
        ("[batch]\nkv_budget = -1\n", "[batch] kv_budget"),
    ],
)
def test_invalid_config_changes_nothing(daemon, tiny_models, text, needle):
    before = daemon.stats()
    daemon.write_config(f'[model]\npath = "{tiny_models("llama")}"\n' + text)
    r = daemon.reload()
    assert r.status_code == 400
    body = r.json()
    assert needle in body["error"]["message"] and body["reload"]["outcome"] == "rejected"
    after = daemon.stats()
    assert after["config"] == before["config"]
    assert after["batch"]["configured"] == before["batch"]["configured"]
    assert after["reloads"][0]["outcome"] == "rejected" and needle in after["reloads"][0]["error"]
    # the daemon still serves
    assert daemon.openai().chat.completions.create(
        model=daemon.model_id(), messages=[{"role": "user", "content": "x"}], max_tokens=2
    )


def test_sighup_reloads_and_bad_sighup_keeps_running(daemon, tiny_models):
    daemon.write_config(config(tiny_models("llama"), size=3))
    daemon.signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while daemon.stats()["batch"]["configured"] != 3:
        assert time.monotonic() < deadline, daemon.log()
        time.sleep(0.1)
    assert daemon.stats()["reloads"][0]["trigger"] == "SIGHUP"
    daemon.write_config("[batch]\nsize = 0\n")
    daemon.signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while daemon.stats()["reloads"][0]["outcome"] != "rejected":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert daemon.stats()["batch"]["configured"] == 3
    assert daemon.proc.poll() is None


def test_host_and_port_changes_are_restart_required(tmp_path, tiny_models):
    port = free_port()
    text = toml_config(model={"path": str(tiny_models("llama"))}, server={"port": port})
    d = Daemon(tmp_path, text, port=port).start()
    try:
        d.write_config(
            toml_config(
                model={"path": str(tiny_models("llama"))},
                server={"port": port + 1, "host": "0.0.0.0"},
                batch={"size": 2},
            )
        )
        body = d.reload().json()
        assert set(body["restart_required"]) == {"server.port", "server.host"}
        assert body["applied"] == ["batch.size"]
        assert httpx.get(f"{d.url}/ready").status_code == 200  # still on the old port
        assert d.stats()["reloads"][0]["restart_required"] == ["server.host", "server.port"]
    finally:
        d.stop()


def test_model_swap_under_load_and_broken_path(tmp_path, tiny_models):
    d = Daemon(tmp_path, config(tiny_models("llama"))).start()
    try:
        old = d.model_id()

        async def main():
            client = d.async_openai()
            tasks = [asyncio.create_task(stream(client, old, i, 600)) for i in range(3)]
            while (await asyncio.to_thread(d.stats))["batch"]["active_rows"] < 3:
                await asyncio.sleep(0.02)
            d.write_config(config(tiny_models("llama_b")))
            swap = await asyncio.to_thread(d.reload)
            return await asyncio.gather(*tasks), swap.json()

        streams, swap = asyncio.run(main())
        assert swap["outcome"] == "applied" and swap["applied"] == ["model.path"]
        for chunks in streams:
            assert chunks[-1].usage.completion_tokens == 600 and chunks[0].model == old
        new = d.model_id()
        assert new != old and new.startswith("llama_b")
        reply = d.openai().chat.completions.create(
            model=new, messages=[{"role": "user", "content": "x"}], max_tokens=3
        )
        assert reply.model == new
        assert d.stats()["drains"][0]["reason"] == "model_swap"

        # A missing directory is refused before anything drains ...
        d.write_config(config("/no/such/model"))
        missing = d.reload().json()
        assert missing["reload"]["outcome"] == "rejected"
        assert "[model] path" in missing["error"]["message"]
        # ... and a directory that looks right but cannot load fails the swap.
        broken_dir = tmp_path / "broken-model"
        shutil.copytree(tiny_models("llama"), broken_dir)
        for weights in broken_dir.glob("*.safetensors"):
            weights.write_bytes(b"not safetensors")
        d.write_config(config(str(broken_dir)))
        broken = d.reload().json()
        assert broken["outcome"] == "failed" and "previous model keeps serving" in broken["error"]
        assert d.model_id() == new
        assert d.openai().chat.completions.create(
            model=new, messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        failed = d.stats()
        assert failed["last_error"].startswith("model swap failed")
        assert failed["last_error_at"] >= failed["reloads"][0]["at"] - 5
        bar = httpx.get(f"{d.url}/dashboard/status-bar").text
        assert "last error at <time" in bar and "model swap failed" in bar

        # A later good reload clears the error; its event shows old -> new values.
        d.write_config(config(tiny_models("llama_b"), size=2))
        assert d.reload().json()["outcome"] == "applied"
        cleared = d.stats()
        assert cleared["last_error"] is None and cleared["last_error_at"] is None
        assert cleared["reloads"][0]["values"] == [["batch.size", "4", "2"]]
        events = httpx.get(f"{d.url}/dashboard/event-log").text
        assert "<dt>batch.size</dt><dd>4 → 2</dd>" in events
        assert "last error" not in httpx.get(f"{d.url}/dashboard/status-bar").text
    finally:
        d.stop()


def _config_versions(d: Daemon) -> dict[str, float]:
    """``mlxd_config_version`` by model, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{d.url}/metrics", timeout=10).text
    return {
        sample.labels["model"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "mlxd_config_version"
    }


def test_moving_the_default_keeps_the_config_version_and_the_reload_log(tmp_path, tiny_models):
    """The version and the reload log are the daemon's, not the default model's engine's."""

    def registry(default: str, size: int) -> str:
        return toml_config(
            batch={"size": size},
            models={
                model_id: {
                    "path": str(tiny_models(family)),
                    "pin": True,
                    "default": model_id == default,
                }
                for model_id, family in (("a", "llama"), ("b", "llama_b"))
            },
        )

    d = Daemon(tmp_path, registry("a", 4)).start()
    try:
        assert d.stats()["config"]["version"] == 1
        d.write_config(registry("a", 2))
        assert d.reload().json()["outcome"] == "applied"
        d.write_config(registry("b", 2))
        moved = d.reload().json()
        assert moved["outcome"] == "applied" and moved["version"] == 3
        stats = d.stats()
        paths = {m["id"]: m["path"] for m in stats["fleet"]["models"]}
        assert stats["model"]["path"] == paths["b"]  # the top of /stats shows b's engine now
        assert [m["id"] for m in stats["fleet"]["models"] if m["default"]] == ["b"]
        assert stats["config"]["version"] == 3
        assert stats["config"]["source"] == str(d.config_path)
        reloads = stats["reloads"]
        assert [(r["id"], r["version"], r["outcome"]) for r in reloads] == [
            (2, 3, "applied"),
            (1, 2, "applied"),
        ]
        assert reloads[0]["changed"] == ["models.a.default", "models.b.default"]
        assert reloads[1]["values"] == [["batch.size", "4", "2"]]
        # Every loaded chat model's series carries the daemon's version.
        assert _config_versions(d) == {"a": 3, "b": 3}
        events = httpx.get(f"{d.url}/dashboard/event-log").text
        assert events.count("reload (POST /admin/reload)") == 2
        assert 'data-field="config">v3,' in httpx.get(f"{d.url}/dashboard/status-bar").text
    finally:
        d.stop()
