"""decide(): which lane a request takes, and why (pure)."""

from __future__ import annotations

import itertools

import pytest

from mlxd.config import LaneSettings
from mlxd.engine.messages import GenerationRequest, PenaltyParams, SamplingParams, TextPrompt
from mlxd.engine.policy.lanes import Capabilities, LaneDecision, decide

OK = Capabilities(True)


def request(*, seed=None, logprobs=False, penalties=False, bias=False) -> GenerationRequest:
    return GenerationRequest(
        id="r",
        prompt=TextPrompt("x"),
        max_tokens=4,
        sampling=SamplingParams(seed=seed),
        penalties=PenaltyParams(
            repetition_penalty=1.2 if penalties else None, logit_bias=((5, 1.0),) if bias else ()
        ),
        logprobs=logprobs,
    )


def test_plain_request_batches_even_alone():
    assert decide(request(), 8, LaneSettings(), OK) == LaneDecision("batch", "batchable")


def test_size_one_is_serial_mode_for_everything():
    for kw in ({}, {"seed": 1}, {"logprobs": True}):
        assert decide(request(**kw), 1, LaneSettings(), OK) == LaneDecision("serial", "mode")


def test_capability_gate_beats_features():
    caps = Capabilities(False, "caches without batch support: QuantizedKVCache")
    assert decide(request(), 4, LaneSettings(), caps) == LaneDecision("serial", "capability")


def test_seed_is_always_serial_even_when_policy_batches_everything():
    policy = LaneSettings(logprobs="batch", penalties="batch", logit_bias="batch")
    assert decide(request(seed=0), 4, policy, OK) == LaneDecision("serial", "seed")


@pytest.mark.parametrize(
    ("feature", "kw"),
    [
        ("logprobs", {"logprobs": True}),
        ("penalties", {"penalties": True}),
        ("logit_bias", {"bias": True}),
    ],
)
def test_operator_decides_per_feature(feature, kw):
    assert decide(request(**kw), 4, LaneSettings(**{feature: "batch"}), OK).lane == "batch"
    assert decide(request(**kw), 4, LaneSettings(**{feature: "serial"}), OK) == LaneDecision(
        "serial", feature
    )


def test_policy_for_one_feature_does_not_affect_others():
    policy = LaneSettings(logprobs="serial")
    assert decide(request(penalties=True), 4, policy, OK).lane == "batch"
    assert decide(request(), 4, policy, OK).lane == "batch"


def test_penalties_at_neutral_values_are_not_penalties():
    neutral = GenerationRequest(
        id="r",
        prompt=TextPrompt("x"),
        max_tokens=4,
        penalties=PenaltyParams(
            repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0
        ),
    )
    assert decide(neutral, 4, LaneSettings(penalties="serial"), OK).lane == "batch"


def test_header_values():
    assert LaneDecision("batch", "batchable").header == "batch"
    assert LaneDecision("serial", "seed").header == "serial; reason=seed"


def test_every_combination_gives_a_known_reason():
    reasons = {"mode", "capability", "seed", "logprobs", "penalties", "logit_bias", "batchable"}
    for size, batchable, seed, lp, pen, bias, pol in itertools.product(
        (1, 4),
        (True, False),
        (None, 7),
        (False, True),
        (False, True),
        (False, True),
        ("batch", "serial"),
    ):
        policy = LaneSettings(logprobs=pol, penalties=pol, logit_bias=pol)
        d = decide(
            request(seed=seed, logprobs=lp, penalties=pen, bias=bias),
            size,
            policy,
            Capabilities(batchable),
        )
        assert d.reason in reasons
        assert (d.lane == "batch") == (d.reason == "batchable")
        if size == 1:
            assert d.reason == "mode"


def test_images_follow_their_policy():
    from mlxd.engine.images import ImagePart
    from mlxd.engine.messages import ChatPrompt

    image = ImagePart(b"x", "PNG", 1, 1, "messages[0].content[0]")
    content = [{"type": "image", "image": 0}]
    with_image = GenerationRequest(
        "r", ChatPrompt(({"role": "user", "content": content},), images=(image,)), 4
    )
    assert decide(with_image, 4, LaneSettings(), OK) == LaneDecision("batch", "batchable")
    serial = LaneSettings(images="serial")
    assert decide(with_image, 4, serial, OK) == LaneDecision("serial", "images")
    assert decide(request(), 4, serial, OK).lane == "batch"  # text requests are untouched
