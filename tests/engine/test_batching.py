"""The batched lane under load, on a real tiny model: widths, KV budget, drain,
cancellation, stop strings and per-row failure containment."""

from __future__ import annotations

import asyncio

import pytest

from mlxd.engine.constraints import json_constraint
from mlxd.engine.messages import Failed, Finished, SamplingParams
from tests.support.engine import (
    consume,
    make_engine,
    run_all,
    running_engine,
    settled,
    token_request,
)

PROMPT = list(range(10, 22))


def prompt(i: int, n: int = 12) -> list[int]:
    return [(10 + 7 * i + k) % 400 + 20 for k in range(n)]


async def wait_until(engine, predicate, timeout=30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        snap = engine.snapshot()
        if predicate(snap):
            return snap
        await asyncio.sleep(0.005)
    raise TimeoutError(f"condition not met; last snapshot: {engine.snapshot().batch}")


@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models("llama")


def test_never_more_rows_than_the_batch_size_and_all_complete(llama):
    with running_engine(llama, batch={"size": 2}) as engine:
        outs = run_all(engine, [token_request(f"r{i}", prompt(i), 40) for i in range(7)])
        snap = settled(engine)
    assert all(o.ok and o.accepted.lane == "batch" for o in outs)
    assert all(len(o.tokens) == 40 for o in outs)
    assert snap.batch.max_active_rows_seen == 2
    c = snap.counters
    assert c["submitted"] == 7 and c["requests"]["batch"]["completed"] == 7


def test_real_kv_bytes_stay_within_a_small_budget_while_requests_queue(llama):
    # llama tiny: 1024 B per token per row. A 12 + 40 token row alone projects 256
    # slots; in a shared batch 52 + 255 (less than a step of spare capacity) each.
    budget = 2 * 307 * 1024 + 1000
    with running_engine(
        llama, batch={"size": 8, "kv_budget": budget, "decode_allowance": 64}
    ) as engine:

        async def main():
            tasks = [
                asyncio.create_task(consume(engine, token_request(f"k{i}", prompt(i), 40)))
                for i in range(6)
            ]
            snap = await wait_until(engine, lambda s: s.batch.pending_rows > 0)
            assert {p.waiting_for for p in snap.pending} == {"budget"}
            return await asyncio.gather(*tasks)

        outs = asyncio.run(main())
        snap = settled(engine)
    assert all(o.ok for o in outs)
    assert snap.batch.max_active_rows_seen == 2
    assert 0 < snap.batch.max_kv_bytes_seen <= budget


def test_fifo_a_blocked_head_is_not_overtaken(llama):
    # The running row (12 + 300 tokens) with "small" (12 + 5): 2 x (312 + 255) = 1134
    # slots; with "big" (600 + 20): 2 x (620 + 255) = 1750.
    budget = 1200 * 1024
    with running_engine(
        llama, batch={"size": 8, "kv_budget": budget, "decode_allowance": 400}
    ) as engine:

        async def main():
            first = asyncio.create_task(consume(engine, token_request("running", prompt(0), 300)))
            await wait_until(engine, lambda s: s.batch.active_rows == 1)
            big = asyncio.create_task(consume(engine, token_request("big", prompt(1, 600), 20)))
            await wait_until(engine, lambda s: s.batch.pending_rows == 1)
            small = asyncio.create_task(consume(engine, token_request("small", prompt(2), 5)))
            snap = await wait_until(engine, lambda s: s.batch.pending_rows == 2)
            assert [p.id for p in snap.pending] == ["big", "small"]
            assert [r.id for r in snap.rows] == ["running"]
            return await asyncio.gather(first, big, small)

        outs = asyncio.run(main())
    assert all(o.ok for o in outs)


def test_a_request_that_can_never_fit_is_refused_at_once(llama):
    with running_engine(llama, batch={"kv_budget": 300 * 1024}) as engine:
        (out,) = run_all(engine, [token_request("huge", prompt(0, 400), 10)])
    assert isinstance(out.accepted, Failed)
    assert (out.accepted.status, out.accepted.code) == (400, "context_over_budget")
    message = out.accepted.message
    assert "[batch] kv_budget (300 KiB)" in message  # the key that binds, and the budget
    assert "512 KiB of KV cache" in message  # the projection: 2 steps of 256 x 1 KiB


def test_full_queue_answers_429_with_retry_after(llama):
    with running_engine(llama, batch={"size": 1}, limits={"max_queued": 2}) as engine:
        outs = run_all(engine, [token_request(f"q{i}", prompt(i), 30) for i in range(5)])
    refused = [o.accepted for o in outs if isinstance(o.accepted, Failed)]
    assert refused and all(f.status == 429 and f.code == "queue_full" for f in refused)
    assert all(f.retry_after and f.retry_after >= 1 for f in refused)
    assert sum(o.ok for o in outs) == 5 - len(refused) >= 2


def test_seeded_request_during_batch_load_drains_once_and_reproduces(llama):
    sampling = SamplingParams(temperature=0.9, seed=42)
    with running_engine(llama, batch={"size": 4}) as engine:
        (alone,) = run_all(engine, [token_request("alone", prompt(9), 30, sampling=sampling)])

        async def main():
            batch = [
                asyncio.create_task(consume(engine, token_request(f"b{i}", prompt(i), 120)))
                for i in range(3)
            ]
            await wait_until(engine, lambda s: sum(r.phase == "decode" for r in s.rows) == 3)
            seeded = await consume(
                engine, token_request("seeded", prompt(9), 30, sampling=sampling)
            )
            late = await asyncio.gather(*batch)
            return seeded, late

        seeded, late = asyncio.run(main())
        snap = settled(engine)
    assert (seeded.accepted.lane, seeded.accepted.reason) == ("serial", "seed")
    assert seeded.tokens == alone.tokens
    assert all(o.ok for o in late)
    assert len(snap.drains) == 1
    drain = snap.drains[0]
    assert (drain.reason, drain.request_id, drain.rows_at_start) == ("seed", "seeded", 3)
    assert drain.ended_at is not None and drain.paused_s >= drain.serial_wait_s > 0


def test_batch_is_not_starved_by_an_endless_serial_stream(llama):
    seeded = SamplingParams(temperature=0.5, seed=1)
    with running_engine(llama, batch={"size": 4}) as engine:

        async def main():
            order: list[str] = []

            async def run(req):
                out = await consume(engine, req)
                order.append(req.id)
                return out

            serial = [
                asyncio.create_task(run(token_request(f"s{i}", prompt(i), 15, sampling=seeded)))
                for i in range(4)
            ]
            await asyncio.sleep(0)
            batch = [
                asyncio.create_task(run(token_request(f"b{i}", prompt(i), 15))) for i in range(2)
            ]
            await asyncio.gather(*serial, *batch)
            return order

        order = asyncio.run(main())
    last_batch = max(order.index("b0"), order.index("b1"))
    assert last_batch < order.index("s3"), f"batch rows waited for the whole serial stream: {order}"


def test_cancelled_rows_leave_at_the_next_step(llama):
    with running_engine(llama, batch={"size": 4}) as engine:

        async def main():
            keep = asyncio.create_task(consume(engine, token_request("keep", prompt(0), 150)))
            gone = await asyncio.gather(
                *(
                    consume(engine, token_request(f"gone{i}", prompt(i + 1), 500), cancel_after=3)
                    for i in range(2)
                )
            )
            snap = await wait_until(engine, lambda s: len(s.rows) == 1)
            return gone, await keep, snap

        gone, keep, snap = asyncio.run(main())
        final = settled(engine)
    assert [len(g.tokens) for g in gone] == [3, 3]
    assert [r.id for r in snap.rows] == ["keep"]
    assert keep.ok and len(keep.tokens) == 150
    assert final.counters["requests"]["batch"]["cancelled"] == 2


def test_stop_string_removes_only_its_row_and_never_leaks(llama):
    with running_engine(llama, batch={"size": 4}) as engine:
        (plain,) = run_all(engine, [token_request("plain", prompt(3), 40)])
        clean = [
            d.text for d in plain.deltas[10:] if len(d.text.strip()) >= 2 and d.text.isprintable()
        ]
        assert clean, "the tiny model should produce some plain-text tokens"
        stop = clean[0]
        cut, sibling = run_all(
            engine,
            [
                token_request("cut", prompt(3), 40, stop=(stop,)),
                token_request("sibling", prompt(4), 40),
            ],
        )
    assert cut.ok and cut.end.finish_reason == "stop"
    assert cut.text == plain.text[: plain.text.index(stop)]
    assert stop not in cut.text
    assert sibling.ok and len(sibling.tokens) == 40


def test_a_row_whose_logits_processor_raises_fails_alone(llama):
    with running_engine(llama, batch={"size": 4}, faults=True) as engine:
        outs = run_all(
            engine,
            [
                token_request("ok1", prompt(1), 30),
                token_request("bad", prompt(2), 30, fault="logits_processor@5"),
                token_request("ok2", prompt(3), 30),
            ],
        )
        (after,) = run_all(engine, [token_request("after", prompt(4), 10)])
        snap = settled(engine)
    ok1, bad, ok2 = outs
    assert ok1.ok and ok2.ok and len(ok1.tokens) == len(ok2.tokens) == 30
    assert isinstance(bad.end, Failed) and bad.end.status == 500
    assert "injected logits processor failure" in bad.end.message
    assert len(bad.tokens) < 30
    assert after.ok
    assert snap.counters["requests"]["batch"]["failed"] == 1


@pytest.mark.parametrize("lane", ["batch", "serial"])
def test_a_grammar_failing_mid_generation_fails_its_row_with_the_schemas_400(llama, lane):
    # 600 optional properties, past the width limit the HTTP side checks: at
    # "{" llguidance's row holds 2,407 Earley items (its limit is 2,000).
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}
    constraint = json_constraint(wide, strict=False, param="response_format")
    with running_engine(llama, batch={"size": 4}, lanes={"constrained": lane}) as engine:
        bad, ok = run_all(
            engine,
            [
                token_request("bad", prompt(2), 30, constraint=constraint),
                token_request("ok", prompt(3), 30),
            ],
        )
        snap = settled(engine)
    assert isinstance(bad.end, Failed), bad.end
    assert (bad.end.status, bad.end.code) == (400, "schema_too_complex"), bad.end
    assert "Structured output limits" in bad.end.message
    assert ok.ok and len(ok.tokens) == 30
    assert snap.counters["engine_errors"] == 0


def test_a_failing_batched_step_fails_that_batch_and_the_engine_recovers(llama):
    with running_engine(llama, batch={"size": 4}, faults=True) as engine:
        outs = run_all(
            engine,
            [
                token_request("victim", prompt(1), 30),
                token_request("breaker", prompt(2), 30, fault="bad_logits@3"),
            ],
        )
        (after,) = run_all(engine, [token_request("after", prompt(4), 10)])
        snap = settled(engine)
    assert all(isinstance(o.end, Failed) and o.end.status == 500 for o in outs)
    assert all("batched forward failed" in o.end.message for o in outs)
    assert after.ok and len(after.tokens) == 10
    assert snap.counters["engine_errors"] == 1
    assert "batched step failed" in snap.last_error


def test_model_swap_drains_and_serves_the_new_model(tiny_models):
    from mlxd.config import ModelSettings

    engine = make_engine(tiny_models("llama"), batch={"size": 4})

    def with_model(path: str):
        return engine.settings.model_copy(update={"model": ModelSettings(path=path)})

    try:
        old_id = engine.info.id

        async def main():
            running = [
                asyncio.create_task(consume(engine, token_request(f"old{i}", prompt(i), 80)))
                for i in range(2)
            ]
            await wait_until(engine, lambda s: len(s.rows) == 2)
            swap = asyncio.wrap_future(engine.load(with_model(str(tiny_models("llama_b")))))
            await wait_until(engine, lambda s: s.batch.admission_paused == "model_swap")
            queued = asyncio.create_task(consume(engine, token_request("queued", prompt(5), 10)))
            info = await swap
            return await asyncio.gather(*running), await queued, info

        old, queued, info = asyncio.run(main())
        assert all(o.ok and len(o.tokens) == 80 for o in old)
        assert info.id != old_id and engine.info.id == info.id
        assert (
            queued.ok and queued.accepted.model == old_id
        )  # accepted before the swap, served after
        drains = engine.snapshot().drains
        assert [d.reason for d in drains] == ["model_swap"] and drains[0].rows_at_start == 2

        future = engine.load(with_model("/nonexistent/model"))
        with pytest.raises(Exception, match="not a directory"):
            future.result(30)
        (still,) = run_all(engine, [token_request("still", prompt(6), 5)])
        assert still.ok and engine.info.id == info.id
    finally:
        engine.stop()


def test_finished_event_carries_real_timings(llama):
    with running_engine(llama, batch={"size": 2}) as engine:
        outs = run_all(engine, [token_request(f"t{i}", prompt(i), 20) for i in range(3)])
    for o in outs:
        assert isinstance(o.end, Finished)
        t = o.end.timings
        assert t.ttft_s is not None and t.ttft_s > 0
        assert t.prefill_s is not None and t.prefill_s > 0
        assert t.decode_s is not None and t.decode_s > 0
        assert t.total_s >= t.ttft_s >= t.queue_s >= 0


def test_serial_rows_cancel_during_prefill_and_during_decode(llama):
    with running_engine(llama, batch={"size": 1, "prefill_step_size": 16}) as engine:

        async def main():
            long_prompt = token_request("prefilling", prompt(7, 3000), 50)
            handle = engine.submit(long_prompt)
            assert (await handle.accepted()).lane == "serial"
            await wait_until(
                engine, lambda s: any(r.phase == "prefill" and r.prefill_done > 0 for r in s.rows)
            )
            handle.cancel()
            decoding = await consume(
                engine, token_request("decoding", prompt(8), 500), cancel_after=5
            )
            after = await consume(engine, token_request("after", prompt(9), 5))
            return decoding, after

        decoding, after = asyncio.run(main())
        snap = settled(engine)
    assert len(decoding.tokens) == 5
    assert after.ok and len(after.tokens) == 5
    assert snap.counters["requests"]["serial"]["cancelled"] == 2
    assert snap.counters["requests"]["serial"]["completed"] == 1
