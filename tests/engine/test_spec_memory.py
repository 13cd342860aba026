"""What speculation holds in memory, and the KV budget capping its depth.

A verify step's transient bytes (``speculative/verify_bytes.py``: every
position's logits and, on a recurrent model, every position's state) are
predicted from the batch's own arrays and compared with the peak MLX
allocates during the step (``mx.get_peak_memory`` over the active memory
before it). On the recurrent families the prediction must be within
0.75x-2x of the measured peak (measured: 0.83-0.98x on Qwen3-Next and
Qwen3.5, 1.0-1.3x on Falcon-H1, 1.5-1.9x on Mamba-2, whose commit holds one
copy of the states, not two); the rest of the peak is the forward's
activations, which the prediction does not count. On an attention-only tiny
model the activations outweigh a 512-token vocabulary's logits, so there the
logits part is checked against the forward's logits array alone.

A draft model's and an MTP head's per-row caches count in the batch's KV
bytes, show in ``/stats`` ``batch.spec_cache_bytes`` and leave with their
rows; a tight KV budget caps the depth so a verify step fits the room it
leaves, down to 0, with output equal to speculation off.
"""

from __future__ import annotations

from contextlib import ExitStack
from unittest import mock

import mlx.core as mx
import pytest

from mlxd.engine.chat.batch import BatchLane
from mlxd.engine.chat.scheduler import Scheduler
from mlxd.engine.chat.speculative import speculator
from mlxd.engine.chat.speculative.rollback import leaves
from mlxd.engine.chat.speculative.verify_bytes import LOGIT_COPIES, verify_bytes
from tests.engine.test_speculative import full_depth
from tests.support.engine import run_all, running_engine, settled, token_request
from tests.support.tinymtp import tiny_mtp_dir

TEXTS = [
    "one two three one two three one two three one two",
    "the river the river the river the river",
    "a b c a b c a b c a b c",
    "x y x y x y x y",
]
LOOKUP = {"mode": "prompt_lookup", "max_draft_tokens": 4, "ngram_min": 1}
BATCH = {"size": 4, "prompt_concurrency": 4}


def requests(tokenizer, tag: str):
    return [token_request(f"{tag}{i}", tokenizer.encode(t), 24) for i, t in enumerate(TEXTS)]


def run(model_dir, tokenizer, tag, spec, batch=BATCH, patches=()):
    """Greedy outputs of the four requests in one engine, and its snapshot after."""
    with ExitStack() as stack:
        stack.enter_context(full_depth(True))  # every step asks for max_draft_tokens
        for patch in patches:
            stack.enter_context(patch)
        with running_engine(model_dir, batch=batch, speculative=spec) as engine:
            outs = run_all(engine, requests(tokenizer, tag))
            snap = settled(engine)
    return [o.tokens for o in outs], snap


@pytest.mark.parametrize("family", ["qwen3_next", "mamba2", "llama"])
def test_a_verify_steps_predicted_bytes_match_what_it_allocates(family, tiny_models, tiny_loaded):
    _, tokenizer = tiny_loaded(family)
    real = speculator.verify
    seen: list[tuple[int, int, int, int]] = []

    def measuring(batch, pending, drafts, forward=None, lane_rows=None):
        width = 1 + max(len(d) for d in drafts)
        need = verify_bytes(batch)
        model = forward or batch.model
        logits: list[int] = []

        def keeping(inputs, cache):
            out = model(inputs, cache=cache)
            logits.append(out.nbytes)
            return out

        mx.eval([c.state for c in leaves(batch.prompt_cache)])
        active = mx.get_active_memory()
        mx.reset_peak_memory()
        out = real(batch, pending, drafts, keeping, lane_rows)
        mx.eval([c.state for c in leaves(batch.prompt_cache)])  # the commit's copies too
        peak = mx.get_peak_memory() - active
        rows = len(pending)
        predicted_logits = rows * width * need.logits
        seen.append((need.transient(rows, width - 1), peak, predicted_logits, logits[0]))
        return out

    run(
        tiny_models(family),
        tokenizer,
        "m",
        LOOKUP,
        patches=[mock.patch.object(speculator, "verify", measuring)],
    )
    assert seen, "no verify step ran"
    for predicted, peak, predicted_logits, logits in seen:
        assert predicted_logits == LOGIT_COPIES * logits
        if family != "llama":
            assert 0.75 * peak <= predicted <= 2.0 * peak, (predicted, peak)


@pytest.mark.parametrize("mode", ["draft", "mtp"])
def test_draft_and_mtp_caches_count_in_the_kv_bytes_and_show_in_stats(
    mode, tiny_models, tiny_loaded
):
    if mode == "draft":
        model_dir = tiny_models("llama")
        _, tokenizer = tiny_loaded("llama")
        spec = {"mode": "draft", "draft_model": str(model_dir), "max_draft_tokens": 2}
    else:  # an MTP head that predicts its target (tests/support/tinymtp.py)
        from mlx_lm.tokenizer_utils import load

        model_dir = tiny_mtp_dir("glm4_moe", echo=True)
        tokenizer = load(model_dir)
        spec = {"mode": "mtp", "max_draft_tokens": 2}
    steps: list[tuple[int, int, int]] = []
    noted: set[int] = set()
    step, note = BatchLane.step, Scheduler.update_from_output

    def stepping(self):
        out = step(self)
        assert self.speculator is not None
        steps.append((self.nbytes, self._gen.prompt_cache_nbytes, self.speculator.cache_bytes()))
        return out

    def noting(self, kv_bytes, *, after_step):
        noted.add(kv_bytes)
        return note(self, kv_bytes, after_step=after_step)

    patches = [
        mock.patch.object(BatchLane, "step", stepping),
        mock.patch.object(Scheduler, "update_from_output", noting),
    ]
    _, snap = run(model_dir, tokenizer, "d", spec, patches=patches)
    drafting = [s for s in steps if s[2] > 0]
    assert drafting, "the draft caches never held anything"
    for lane_bytes, target_bytes, draft_bytes in drafting:
        assert lane_bytes == target_bytes + draft_bytes
        assert lane_bytes in noted  # the KV bytes the scheduler holds against the budget
    assert snap.counters["spec_drafted_tokens"] > 0
    # The rows have ended: their draft caches went with them.
    assert snap.batch.spec_cache_bytes == 0
    assert steps[-1] == (0, 0, 0)


def test_a_tight_kv_budget_caps_a_hybrid_models_depth_down_to_zero(tiny_models, tiny_loaded):
    model_dir = tiny_models("qwen3_next")
    _, tokenizer = tiny_loaded("qwen3_next")
    off, _ = run(model_dir, tokenizer, "o", {"mode": "off"})

    held: list[int] = []
    room = Scheduler.spec_room

    def recording(self, lanes):
        free = room(self, lanes)
        held.append(self.budget.admission_budget(0) - free)
        return free

    fits: list[tuple[int, int, int, int, int]] = []
    fit = speculator.fit_depth

    def fitting(depth, free, need):
        out = fit(depth, free, need)
        fits.append((depth, out, need(out) if out else 0, free, need(1)))
        return out

    patches = [
        mock.patch.object(Scheduler, "spec_room", recording),
        mock.patch.object(speculator, "fit_depth", fitting),
    ]
    wide, wide_snap = run(model_dir, tokenizer, "w", LOOKUP, patches=patches)
    assert all(depth == out == 4 for depth, out, *_ in fits)  # depth 4 everywhere otherwise
    assert wide_snap.counters["spec_drafted_tokens"] > 0
    # Room for the four rows' KV as projected, and less than a depth-1 step of four rows.
    need_one = max(f[4] for f in fits)
    budget = max(held) + need_one // 2
    fits.clear()
    tight, snap = run(
        model_dir, tokenizer, "t", LOOKUP, batch={**BATCH, "kv_budget": budget}, patches=patches
    )
    assert tight == off == wide
    assert fits
    for _, _, needed, free, _ in fits:
        assert needed <= free
    assert any(out == 0 for _, out, *_ in fits), fits
    assert snap.counters["finished"] == len(TEXTS)
