"""The dashboard's region formatters on plain snapshot values (pure: no daemon needed)."""

from __future__ import annotations

from typing import Any

from mlxd.dashboard import activity
from mlxd.dashboard.who_panel import who_panel


def _rows(lanes: list[str]) -> list[dict[str, Any]]:
    return [
        {
            "id": f"chatcmpl-{i}", "api": "chat", "lane": lane, "phase": "decode",
            "prefill_done": 0, "prefill_total": 0, "cached_tokens": 0, "prompt_tokens": 10,
            "generated_tokens": 5, "max_tokens": 50, "tokens_per_s": 3.0, "age_s": 1.0,
            "kv_bytes": 1024, "projected_kv_bytes": 2048,
        }
        for i, lane in enumerate(lanes)
    ]  # fmt: skip


def _snapshot(lanes: list[str], configured: int) -> dict[str, Any]:
    batch = {"active_rows": len(lanes), "configured": configured, "prefilling_rows": 0}
    return {"rows": _rows(lanes), "batch": batch | {"max_active_rows_seen": 8}}


def test_more_rows_than_the_width_explains_itself() -> None:
    v = activity.active_rows(_snapshot(["batch"] * 8, 4), 0.0)
    assert v["summary"] == "8 running of 4"
    assert "lowered to 4" in v["over_width"] and "8 batch rows" in v["over_width"]
    assert "finish first" in v["over_width"]


def test_a_full_batch_plus_the_serial_row_needs_no_explanation() -> None:
    v = activity.active_rows(_snapshot(["batch"] * 4 + ["serial"], 4), 0.0)
    assert v["summary"] == "5 running of 4" and v["over_width"] is None


# ---------------------------------------------------------------- the models panel


def _fleet() -> dict[str, Any]:
    from mlxd.engine.fleet.values import FleetEvent, FleetStatus, ModelState

    mib = 1024 * 1024

    def model(model_id: str, state: str, **kw: Any) -> ModelState:
        fields = {
            "id": model_id, "kind": "chat", "path": f"/m/{model_id}", "aliases": (),
            "state": state, "default": False, "pinned": False, "keep_alive": "forever",
            "weights_bytes": 0, "reserved_bytes": 0, "kv_bytes": 0, "prompt_cache_bytes": 0,
            "active": 0, "waiting": 0, "wait_reason": None, "last_used": None,
            "loaded_at": None, "load_seconds": None, "error": None, "capabilities": {},
            "engine": {},
        }  # fmt: skip
        return ModelState(**{**fields, **kw})

    view = FleetStatus(
        budget_bytes=64 * mib,
        used_bytes=24 * mib,
        models=(
            model(
                "org/a", "loaded", default=True, pinned=True, weights_bytes=16 * mib,
                reserved_bytes=20 * mib, kv_bytes=4 * mib, prompt_cache_bytes=1 * mib,
                last_used=90.0, loaded_at=10.0, load_seconds=1.5, keep_alive=1800.0,
                engine={"rows": 2, "pending": 3, "tokens_per_s": 12.25},
            ),
            model("b", "failed", error="weights are <corrupt>", waiting=1, wait_reason="memory"),
        ),
        events=(
            FleetEvent(10.0, "org/a", "loaded", "1.5 s"),
            FleetEvent(50.0, "b", "load_failed", "weights are <corrupt>"),
        ),
        memory_queue=("b",),
    )  # fmt: skip
    return view.as_dict()


def test_models_panel_shows_each_model_against_the_budget() -> None:
    from mlxd.dashboard.models_panel import models_panel

    v = models_panel({"fleet": _fleet(), "actions": "tok"}, 100.0)
    a, b = v["models"]
    assert v["summary"] == "1 of 2 loaded"
    assert (v["budget"], v["used"], v["used_pct"], v["free"]) == (
        "64.0 MiB", "24.0 MiB", "38%", "40.0 MiB"
    )  # fmt: skip
    assert (a["id"], a["state"], a["pinned"], a["default"]) == ("org/a", "loaded", True, True)
    # Weights, KV, the prompt cache held and the rest of its 4 MiB cap, against 64 MiB.
    assert [(s["kind"], s["width"]) for s in a["segments"]] == [
        ("weights", "25.0%"), ("kv", "6.2%"), ("cache", "1.6%"), ("cache_cap", "4.7%")
    ]  # fmt: skip
    assert a["total"] == "24.0 MiB" and a["cache_cap"] == "4.0 MiB"
    assert (a["rows"], a["queue"], a["tokens_per_s"]) == ("2", "3", "12.2")
    # Requests hold it: "in use", not when the last one began (issue 22).
    assert a["last_used"] == "in use now (2 requests)" and a["keep_alive"] == "30 m"
    assert a["actions"] == {"load": False, "unload": False, "pin": False, "unpin": True}
    # A failed model: no engine numbers, its error, a load button.
    assert (b["rows"], b["queue"], b["error"]) == ("—", "—", "weights are <corrupt>")
    assert b["actions"]["load"] and not b["actions"]["unload"] and b["segments"] == []
    assert (b["waiting"], b["wait_reason"], b["last_used"]) == ("1", "memory", "never")
    # The total gauge stacks every model's segments; events newest first.
    assert v["segments"] == a["segments"] and v["memory_queue"] == "b"
    assert [(e["model"], e["title"]) for e in v["events"]] == [
        ("b", "load failed"), ("org/a", "loaded")
    ]  # fmt: skip
    assert v["csrf"] == "tok"
    assert models_panel({"fleet": _fleet(), "actions": None}, 100.0)["csrf"] is None


# ---------------------------------------------------------------- the who panel


def _key(name: str, **kw: Any) -> dict[str, Any]:
    base = {
        "name": name, "priority": "normal", "models": [], "requests_per_minute": 0,
        "tokens_per_minute": 0, "max_concurrent": 0, "running": 0, "waiting": 0,
        "in_flight": 0, "requests_last_minute": 0, "tokens_last_minute": 0, "refused": 0,
        "requests_total": 0, "tokens_total": 0, "preemptions": 0,
    }  # fmt: skip
    return base | kw


def test_who_panel_shows_each_key_against_its_quota() -> None:
    keys = [
        _key("kids", priority="low", tokens_per_minute=1000, tokens_last_minute=250, refused=2),
        _key("me", priority="high", running=1, waiting=2, preemptions=0, models=["qwen*"]),
    ]
    v = who_panel({"keys": keys, "counters": {"preemptions": 3}}, 0.0)
    kids, me = v["who"]
    assert (kids["tokens"], kids["tokens_width"], kids["refused"]) == ("250 / 1,000", "25.0%", "2")
    assert (me["tokens"], me["tokens_width"], me["models"]) == ("0", None, "qwen*")
    assert (me["running"], me["waiting"], me["priority"]) == ("1", "2", "high")
    assert v["summary"] == "2 API keys" and v["preemptions"] == "3"


def test_who_panel_without_keys_says_v1_is_open() -> None:
    v = who_panel({"keys": [], "counters": {}}, 0.0)
    assert v["who"] == [] and v["preemptions"] is None and "open" in v["summary"]


def test_running_and_waiting_rows_carry_their_key_priority_and_preemption() -> None:
    rows = _rows(["serial"])
    rows[0] |= {"priority": "low", "key": "indexer", "preemptions": 2}
    r = activity.active_rows({"rows": rows, "batch": _snapshot([], 1)["batch"]}, 0.0)["rows"][0]
    assert (r["priority"], r["key"], r["preemptions"]) == ("low", "indexer", 2)


def test_long_latencies_read_in_seconds() -> None:
    """Issue 22: 46,456 ms is 46.5 s to a person; short ones stay in ms."""
    from mlxd.dashboard.charts import ms

    assert (ms(0.042), ms(1.25), ms(9.9994), ms(46.456), ms(None)) == (
        "42 ms", "1,250 ms", "9,999 ms", "46.5 s", "—"
    )  # fmt: skip


# ---------------------------------------------------------------- issue 33: no contradictions


def _status_state(fleet_state: str, **kw: Any) -> dict[str, Any]:
    fleet = {
        "models": [
            {"id": "demo", "kind": "chat", "default": True, "state": fleet_state},
            {"id": "minilm", "kind": "embedding", "default": True, "state": "unloaded"},
        ]
    }
    return {
        "model": {"name": None, "status": "loading", "error": None, "family": None, "context": 0},
        "batch": {"configured": 8, "batched": False},
        "runtime": {},
        "config": {"version": 1, "applied_at": 100.0, "source": "mlxd.toml"},
        "mode": "batch",
        "state": "ready",
        "stalled": False,
        "uptime_s": 5.0,
        "last_error": None,
        "fleet": fleet,
        **kw,
    }


def test_an_unloaded_default_model_is_named_and_not_called_serial() -> None:
    from mlxd.dashboard.status import status_bar

    v = status_bar(_status_state("unloaded"), now=1000.0)
    assert v["model"] == "demo" and v["model_status"] == "unloaded"
    assert "cannot batch" not in v["mode"] and "(no model)" not in v["model"]
    assert v["mode"] == "batch 8 (model unloaded: loads on its first request)"
    # Loaded and unable to batch: that is still said.
    loaded = _status_state("loaded", model={**_status_state("x")["model"], "name": "demo"})
    assert "cannot batch" in status_bar(loaded, now=1000.0)["mode"]


def test_uptime_is_the_daemons_age_not_the_default_engines() -> None:
    from mlxd.dashboard.status import status_bar

    v = status_bar(_status_state("unloaded", daemon_started_at=1000.0 - 7200), now=1000.0)
    assert v["uptime"].startswith("2") and "h" in v["uptime"], v["uptime"]


def test_counters_and_the_prompt_cache_panel_give_one_hit_ratio() -> None:
    from mlxd.dashboard.activity import counters
    from mlxd.dashboard.prompt_cache_panel import prompt_cache_panel

    pc = {
        "hits": 10, "misses": 0, "cached_tokens_served": 720, "entries": 1, "max_entries": 8,
        "bytes": 0, "max_bytes": 1, "lookups": [],
    }  # fmt: skip
    c = {
        "requests": {}, "finished": 10, "submitted": 10, "rejected": {}, "lane_reasons": {},
        "prompt_tokens": 1000, "generated_tokens": 5, "prefill_seconds": 1.0,
        "decode_seconds": 1.0, "engine_errors": 0,
    }  # fmt: skip
    s = {"prompt_cache": pc, "counters": c, "model": {"name": "demo"}}
    assert counters(s, 0.0)["hit_rate"] == prompt_cache_panel(s, 0.0)["hit_ratio"]


def test_quick_controls_cover_the_budget_preemption_pin_and_keep_alive(tmp_path) -> None:
    from mlxd.config import load_settings
    from mlxd.dashboard.quick import quick_controls, quick_edit, quick_values

    text = (
        '# my config\n[memory]\nbudget = "auto"  # all of it\n\n'
        '[models.demo]\npin = true\n\n[models."qwen2.5"]\npath = "/m/q"\nkeep_alive = "30m"\n'
    )
    path = tmp_path / "mlxd.toml"
    path.write_text(text, encoding="utf-8")
    shown = quick_values(load_settings(path))
    assert shown["memory.budget"] == "auto" and shown["scheduling.preempt"] == "false"
    assert shown["models.demo.pin"] == "true" and shown["models.qwen2.5.keep_alive"] == "1800s"
    keys = {c["key"]: c for c in quick_controls(shown)}
    assert keys["models.qwen2.5.pin"]["label"] == "qwen2.5: pin"
    assert keys["scheduling.preempt"]["kind"] == "choice"
    form = {
        **shown,
        "memory.budget": "24GiB",
        "scheduling.preempt": "true",
        "models.demo.pin": "false",
        "models.qwen2.5.keep_alive": "2h",
    }
    edited, changed = quick_edit(text, form, shown)
    assert set(changed) == {
        "memory.budget",
        "scheduling.preempt",
        "models.demo.pin",
        "models.qwen2.5.keep_alive",
    }
    assert '# my config\n[memory]\nbudget = "24GiB"  # all of it\n' in edited
    path.write_text(edited, encoding="utf-8")
    after = load_settings(path)
    assert after.scheduling.preempt is True and after.models["demo"].pin is False
    assert quick_values(after)["models.qwen2.5.keep_alive"] == "7200s"


def test_speculation_shows_its_acceptance_once_on_and_nothing_while_off() -> None:
    off = {"counters": {"spec_drafted_tokens": 0}, "batch": {"spec_mode": "off"}}
    assert activity.speculation(off) is None
    counters = {"spec_drafted_tokens": 400, "spec_accepted_tokens": 300, "spec_verify_steps": 120}
    batch = {"spec_mode": "prompt_lookup", "spec_depth": 3}
    v = activity.speculation({"counters": counters, "batch": batch})
    assert v == {
        "mode": "prompt_lookup",
        "acceptance": "75%",
        "accepted": "300",
        "drafted": "400",
        "per_verify": "2.5",
        "depth": "3",
    }


# ---------------------------------------------------------------- the memory panel


def test_memory_panel_says_when_the_kv_cache_is_quantized() -> None:
    from mlxd.dashboard import status

    batch = {"kv_bytes": 2048, "kv_budget_bytes": 4096}
    snap = {"model": {"name": "m", "weights_bytes": 1, "dtype": "float32"}, "batch": batch}
    assert status.memory(snap, 0.0)["kv_bits"] == ""
    snap["batch"] = batch | {"kv_bits": 8, "kv_bytes_per_token": 288}
    assert status.memory(snap, 0.0)["kv_bits"] == "8-bit KV, 288 B/token"
    # What quantizing saves, against the same cache in the model's dtype.
    snap["batch"] = batch | {
        "kv_bits": 8,
        "kv_bytes_per_token": 288,
        "kv_unquantized_bytes_per_token": 1024,
    }
    assert status.memory(snap, 0.0)["kv_bits"] == (
        "8-bit KV, 288 B/token (1024 unquantized: 72% saved)"
    )
