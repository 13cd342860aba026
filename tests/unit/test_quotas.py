"""Per-key quotas (mlxd.api.quotas) on a fake clock: rolling minutes, concurrency, headers."""

from __future__ import annotations

import pytest

from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.keys import Who
from mlxd.api.quotas import Quotas


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def refused(quotas: Quotas, who: Who, **kw) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        quotas.take(who, **kw)
    assert caught.value.status == 429 and caught.value.code == "rate_limit_exceeded"
    return caught.value


def test_requests_per_minute_is_a_rolling_window(clock):
    q, who = Quotas(clock), Who("kids", requests_per_minute=2)
    q.take(who)()
    clock.now += 20
    q.take(who)()
    err = refused(q, who)
    assert err.headers["Retry-After"] == "40"  # the first leaves the window at +60
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    assert err.headers["x-ratelimit-limit-requests"] == "2"
    assert err.headers["x-ratelimit-reset-requests"] == "40s"
    clock.now += 40
    q.take(who)  # the first one left the window
    assert q.usage("kids").refused == 1 and q.usage("kids").requests_total == 3


def test_tokens_per_minute_counts_ended_requests(clock):
    q, who = Quotas(clock), Who("agent", tokens_per_minute=100)
    q.take(who)()
    q.spend(who, 60)
    clock.now += 10
    q.take(who)()
    q.spend(who, 50)  # 110: over, counted when known
    err = refused(q, who)
    assert err.headers["Retry-After"] == "50"  # the first 60 leave at +60
    assert err.headers["x-ratelimit-remaining-tokens"] == "0"
    clock.now += 50
    q.take(who)
    assert q.usage("agent").tokens_last_minute == 50
    assert q.usage("agent").tokens_total == 110


def test_max_concurrent_until_released(clock):
    q, who = Quotas(clock), Who("bot", max_concurrent=2)
    first, second = q.take(who), q.take(who)
    err = refused(q, who)
    assert err.headers["Retry-After"] == "1" and "concurrent" in err.message
    first()
    first()  # releasing twice gives back one place only
    third = q.take(who)
    refused(q, who)
    second()
    third()
    assert q.usage("bot").in_flight == 0


def test_anthropic_names_and_no_headers_without_limits(clock):
    q = Quotas(clock)
    who = Who("kids", requests_per_minute=5, tokens_per_minute=1000)
    q.take(who)
    h = q.headers(who, anthropic=True)
    assert h["anthropic-ratelimit-requests-limit"] == "5"
    assert h["anthropic-ratelimit-requests-remaining"] == "4"
    assert h["anthropic-ratelimit-requests-reset"].endswith("Z")
    assert h["anthropic-ratelimit-tokens-remaining"] == "1000"
    assert not any(k.startswith("x-ratelimit") for k in h)
    assert q.headers(Who("free")) == {} and q.headers(None) == {}


def test_requests_without_a_key_are_never_limited(clock):
    q = Quotas(clock)
    for _ in range(100):
        q.take(None)()


def test_counts_are_kept_by_name_across_a_changed_limit(clock):
    # A reload builds new Who values; the window stays with the name.
    q = Quotas(clock)
    q.take(Who("kids", requests_per_minute=10))
    refused(q, Who("kids", requests_per_minute=1))


@pytest.mark.parametrize(
    ("models", "allowed", "refused_"),
    [
        ((), ["anything"], []),
        (("qwen*",), ["qwen3-4b"], ["llama"]),
        (("tiny", "small-*"), ["tiny", "small-1"], ["tinyx", "big"]),
    ],
)
def test_a_keys_models(models, allowed, refused_):
    who = Who("k", models=models)
    assert all(who.may_use(m) for m in allowed)
    assert not any(who.may_use(m) for m in refused_)


def test_a_pattern_may_match_the_name_the_client_sent():
    who = Who("k", models=("qwen*",))
    assert who.may_use("models/q4", "qwen-latest") and not who.may_use("models/q4", "llama")
