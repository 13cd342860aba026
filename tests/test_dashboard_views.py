"""The dashboard's view functions on plain snapshot values (pure: no daemon needed)."""

from __future__ import annotations

from typing import Any

from mlxd.dashboard import views


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
    v = views.active_rows(_snapshot(["batch"] * 8, 4), 0.0)
    assert v["summary"] == "8 running of 4"
    assert "lowered to 4" in v["over_width"] and "8 batch rows" in v["over_width"]
    assert "finish first" in v["over_width"]


def test_a_full_batch_plus_the_serial_row_needs_no_explanation() -> None:
    v = views.active_rows(_snapshot(["batch"] * 4 + ["serial"], 4), 0.0)
    assert v["summary"] == "5 running of 4" and v["over_width"] is None
