"""The Caller a /v1 request runs as: what the API-key guard resolves, and what it answers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from mlxd.api.http.caller import CALLER_SCOPE_KEY, BatchLine, Caller, api_key_guard, caller_of
from mlxd.api.http.errors import OpenAIError
from mlxd.api.http.keys import Who, key_digest
from mlxd.api.priority import effective
from mlxd.config import Settings

KEYS = {"keys": {"team": {"key": "sk-team", "priority": "high", "models": ["a*"]}}}
LINE = BatchLine("batch_1", "c0")


def _guard(settings: Settings, scope: dict[str, Any], headers: dict[str, str]) -> Caller:
    connection = SimpleNamespace(
        scope=scope,
        headers=headers,
        app=SimpleNamespace(state=SimpleNamespace(mlxd=SimpleNamespace(settings=settings))),
    )
    api_key_guard(connection, None)  # type: ignore[arg-type]
    return caller_of(scope)


def test_a_client_without_keys_configured_is_anonymous_at_normal() -> None:
    caller = _guard(Settings(), {}, {"authorization": "Bearer anything"})
    assert caller == Caller()
    assert (caller.key, caller.priority, caller.owner) == (None, "normal", None)
    assert caller.spends_quota and caller.stores_responses and caller.may_use("any")


def test_a_key_is_resolved_once_with_its_name_class_models_and_owner() -> None:
    scope: dict[str, Any] = {}
    caller = _guard(Settings.model_validate(KEYS), scope, {"x-api-key": "sk-team"})
    assert scope[CALLER_SCOPE_KEY] is caller
    assert (caller.key, caller.priority, caller.owner) == ("team", "high", key_digest("sk-team"))
    assert caller.may_use("abc") and not caller.may_use("b")
    assert not caller.is_batch_line and caller.spends_quota


def test_a_missing_or_wrong_key_is_401() -> None:
    for headers in ({}, {"authorization": "Bearer nope"}):
        with pytest.raises(OpenAIError) as refused:
            _guard(Settings.model_validate(KEYS), {}, headers)
        assert refused.value.status == 401


def test_a_bearer_key_is_the_key_when_sent_beside_x_api_key() -> None:
    two = {"keys": {**KEYS["keys"], "other": {"key": "sk-other"}}}
    settings = Settings.model_validate(two)
    with pytest.raises(OpenAIError) as refused:
        _guard(settings, {}, {"authorization": "Bearer nope", "x-api-key": "sk-team"})
    assert refused.value.status == 401
    both = {"authorization": "Bearer sk-other", "x-api-key": "sk-team"}
    assert _guard(settings, {}, both).key == "other"
    stale = {"authorization": "Bearer sk-team", "x-api-key": "sk-ant-stale"}
    assert _guard(settings, {}, stale).key == "team"


def test_a_401_with_an_unread_body_closes_the_connection() -> None:
    with pytest.raises(OpenAIError) as refused:
        _guard(Settings.model_validate(KEYS), {}, {"content-length": "100"})
    assert refused.value.headers == {"Connection": "close"}
    with pytest.raises(OpenAIError) as refused:
        _guard(Settings.model_validate(KEYS), {}, {})
    assert refused.value.headers == {}


def test_a_batch_line_runs_as_its_owner_in_the_batch_class_outside_quotas() -> None:
    who = Who("team", "high")
    placed = Caller(who, LINE)
    caller = _guard(Settings.model_validate(KEYS), {CALLER_SCOPE_KEY: placed}, {})
    assert caller is placed
    assert (caller.key, caller.priority, caller.is_batch_line) == ("team", "batch", True)
    assert not caller.spends_quota and not caller.stores_responses
    assert effective("normal", caller.priority, "high") == "batch"


def test_a_batch_line_whose_key_is_gone_is_401() -> None:
    with pytest.raises(OpenAIError) as refused:
        _guard(Settings.model_validate(KEYS), {CALLER_SCOPE_KEY: Caller(None, LINE)}, {})
    assert refused.value.status == 401


def test_a_client_cannot_pass_a_caller_in_a_header_or_a_look_alike_value() -> None:
    assert caller_of({CALLER_SCOPE_KEY: {"who": "team"}}) == Caller()
    assert caller_of(None) == Caller()


def test_a_request_asks_at_most_its_keys_class() -> None:
    assert effective("normal", Caller(Who("k", "low")).priority, "high") == "low"
    assert effective("normal", Caller(Who("k", "high")).priority, "low") == "low"
    assert effective("normal", Caller().priority, None) == "normal"
