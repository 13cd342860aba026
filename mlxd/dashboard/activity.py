"""The running rows, the pending queue and the counters of the default chat model."""

from __future__ import annotations

from typing import Any

from mlxd.dashboard.formatting import (
    Formatted,
    bar_width,
    count,
    duration,
    human_bytes,
    percent,
    rate,
    short_id,
)

WAITING_FOR = {
    "budget": "KV budget",
    "batch_full": "batch full",
    "drain": "drain",
    "serial_lane": "its serial turn",
}


def _phase(row: dict[str, Any]) -> tuple[str, str | None]:
    if row["phase"] == "prefill" and row["prefill_total"]:
        done, total = row["prefill_done"], row["prefill_total"]
        return f"prefill {count(done)}/{count(total)}", bar_width(done, total)
    return row["phase"], None


def active_rows(s: dict[str, Any], now: float) -> Formatted:
    rows = []
    for r in s["rows"]:
        phase, progress = _phase(r)
        rows.append(
            {
                "id": r["id"],
                "short_id": short_id(r["id"]),
                "api": r["api"],
                "lane": r["lane"],
                "phase": r["phase"],
                "phase_label": phase,
                "prefill_width": progress,
                "cached": count(r["cached_tokens"]) if r["cached_tokens"] else None,
                "prompt_tokens": count(r["prompt_tokens"]),
                "tokens": f"{count(r['generated_tokens'])} / {count(r['max_tokens'])}",
                "tokens_width": bar_width(r["generated_tokens"], r["max_tokens"]),
                "tps": rate(r["tokens_per_s"]),
                "age": duration(r["age_s"]),
                "kv": human_bytes(r["kv_bytes"]),
                "projected_kv": human_bytes(r["projected_kv_bytes"]),
                "constraint": r.get("constraint"),
                "images": r.get("images") or 0,
                "image_tokens": count(r.get("image_tokens") or 0),
                "output": r.get("output") if r.get("output") not in (None, "answer") else None,
                "priority": r.get("priority", "normal"),
                "key": r.get("key"),
                "preemptions": r.get("preemptions", 0),
            }
        )
    b = s["batch"]
    batched = sum(1 for r in s["rows"] if r["lane"] == "batch")
    return {
        "rows": rows,
        "summary": f"{b['active_rows']} running of {b['configured']}",
        "over_width": (
            f"The batch width was lowered to {b['configured']}: the {batched} batch rows "
            f"already running finish first, and no new row starts until fewer than "
            f"{b['configured']} run."
            if batched > b["configured"]
            else None
        ),
        "prefilling": b["prefilling_rows"],
        "peak": b["max_active_rows_seen"],
    }


def pending_queue(s: dict[str, Any], now: float) -> Formatted:
    items = [
        {
            "id": p["id"],
            "short_id": short_id(p["id"]),
            "api": p["api"],
            "lane": p["lane"],
            "waited": duration(p["waited_s"]),
            "prompt_tokens": count(p["prompt_tokens"]),
            "projected_kv": human_bytes(p["projected_kv_bytes"]),
            "waiting_for": p["waiting_for"],
            "waiting_for_label": WAITING_FOR.get(p["waiting_for"], p["waiting_for"]),
            "priority": p.get("priority", "normal"),
            "key": p.get("key"),
            "preempted": p.get("preempted", False),
        }
        for p in s["pending"]
    ]
    return {"requests": items, "summary": f"{len(items)} waiting"}


def counters(s: dict[str, Any], now: float) -> Formatted:
    c, pc = s["counters"], s["prompt_cache"]
    outcomes = ("completed", "cancelled", "failed")
    lanes = []
    for lane in ("batch", "serial"):
        counts = c["requests"].get(lane, {})
        lanes.append(
            {
                "lane": lane,
                **{o: count(counts.get(o, 0)) for o in outcomes},
                "total": count(sum(counts.values())),
            }
        )
    lookups = pc["hits"] + pc["misses"]
    return {
        "lanes": lanes,
        "finished": count(c["finished"]),
        "submitted": count(c["submitted"]),
        "rejected": [(reason, count(n)) for reason, n in sorted(c["rejected"].items())],
        "rejected_total": count(sum(c["rejected"].values())),
        "lane_reasons": [(reason, count(n)) for reason, n in sorted(c["lane_reasons"].items())],
        # By tokens, as the prompt-cache panel counts it: a lookup that reused part
        # of its prompt is a hit by count but a miss there (issue 33).
        "hit_rate": percent(pc["cached_tokens_served"], c["prompt_tokens"]),
        "hits": count(pc["hits"]),
        "lookups": count(lookups),
        # Counted at admission, as each row's "cached" is (issue 22: the count by completed
        # requests lagged the rows on screen).
        "cached_tokens": count(pc.get("ram_tokens", 0) + pc.get("disk_tokens", 0)),
        "prompt_tokens": count(c["prompt_tokens"]),
        "generated_tokens": count(c["generated_tokens"]),
        "prefill_time": duration(c["prefill_seconds"]),
        "decode_time": duration(c["decode_seconds"]),
        "engine_errors": count(c["engine_errors"]),
        # A vision-language model's: shown once it has served images.
        "images": count(c.get("images") or 0) if c.get("images") else None,
        "vision_time": duration(c.get("vision_seconds") or 0.0),
        "speculation": speculation(s),
    }


def speculation(s: dict[str, Any]) -> dict[str, str] | None:
    """Speculative decoding's acceptance, once the model speculates or has drafted."""
    c, batch = s["counters"], s.get("batch", {})
    drafted, accepted = c.get("spec_drafted_tokens", 0), c.get("spec_accepted_tokens", 0)
    mode = batch.get("spec_mode", "off")
    if mode == "off" and not drafted:
        return None
    steps = c.get("spec_verify_steps", 0)
    return {
        "mode": mode,
        "acceptance": percent(accepted, drafted),
        "accepted": count(accepted),
        "drafted": count(drafted),
        "per_verify": f"{accepted / steps:.1f}" if steps else "0",
        "depth": str(batch.get("spec_depth", 0)),
    }
