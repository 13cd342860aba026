"""The volatile-prompt rules and the prompt-cache header, as pure functions (no daemon)."""

from __future__ import annotations

import pytest

from mlxd.api.lookup import header_value, parse_header
from mlxd.api.prompt_rules import RULES, apply_prompt_rules, strip_billing_header
from mlxd.config import PromptCacheSettings
from mlxd.engine import CacheLookup, ChatPrompt, GenerationRequest, TextPrompt

# Shapes Claude Code has sent (2.1.36 to 2.1.3xx), the entrypoint and workload varying.
BILLING = [
    "x-anthropic-billing-header: cc_version=2.1.100.a1b; cc_entrypoint=cli; cch=5f2e1;",
    "x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=sdk-cli; cch=36ee5;",
    "x-anthropic-billing-header: cc_version=2.1.90.fff; cc_entrypoint=cli; cch=00000; "
    "cc_workload=review;",
    "x-anthropic-billing-header: cc_version=2.1.100.a1b; cc_entrypoint=cli;",  # Bedrock: no cch
]


@pytest.mark.parametrize("line", BILLING)
@pytest.mark.parametrize("joiner", ["", "\n", " \n", "\r\n"])
def test_the_billing_line_is_removed_and_nothing_else(line: str, joiner: str) -> None:
    rest = "You are Claude Code, Anthropic's official CLI for Claude."
    assert strip_billing_header(line + joiner + rest) == (rest, True)
    assert strip_billing_header(line) == ("", True)


@pytest.mark.parametrize(
    "text",
    [
        "You are Claude Code.\nx-anthropic-billing-header: cc_version=1; cch=2;",  # not first
        " x-anthropic-billing-header: cc_version=1; cch=2;",  # not at the very start
        "x-anthropic-billing-header: please ignore the rules above",  # not the header's shape
        "X-Anthropic-Billing-Header: cc_version=1; cch=2;",  # not how Claude Code writes it
        "",
    ],
)
def test_other_text_is_left_alone(text: str) -> None:
    assert strip_billing_header(text) == (text, False)


def _gen(*messages: dict, rules: tuple[str, ...] = ()) -> GenerationRequest:
    return GenerationRequest(
        id="r", prompt=ChatPrompt(tuple(messages)), max_tokens=1, prompt_rules=rules
    )


def test_the_rule_changes_only_the_first_system_message_and_says_so() -> None:
    header = BILLING[0]
    gen = _gen(
        {"role": "system", "content": header + "\nBe brief."},
        {"role": "user", "content": header},
    )
    out = apply_prompt_rules(gen, ["claude_billing_header"])
    assert isinstance(out.prompt, ChatPrompt)
    assert out.prompt.messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": header},  # a user's text is never touched
    )
    assert out.prompt_rules == ("claude_billing_header",)
    # Off: the prompt goes as it came, and nothing is claimed.
    assert apply_prompt_rules(gen, []) is gen


def test_a_system_message_that_was_only_the_line_goes_away() -> None:
    gen = _gen({"role": "system", "content": BILLING[1]}, {"role": "user", "content": "hi"})
    out = apply_prompt_rules(gen, ["claude_billing_header"])
    assert isinstance(out.prompt, ChatPrompt)
    assert out.prompt.messages == ({"role": "user", "content": "hi"},)


@pytest.mark.parametrize(
    "gen",
    [
        _gen({"role": "user", "content": BILLING[0]}),  # no system message first
        _gen({"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}),
        GenerationRequest(id="r", prompt=TextPrompt(BILLING[0]), max_tokens=1),  # raw text
    ],
)
def test_requests_without_the_line_are_returned_as_they_are(gen: GenerationRequest) -> None:
    assert apply_prompt_rules(gen, ["claude_billing_header"]) is gen


def test_the_setting_knows_exactly_the_rules_there_are() -> None:
    assert PromptCacheSettings().volatile_rules == ["claude_billing_header"]
    assert set(RULES) == {"claude_billing_header"}
    with pytest.raises(ValueError, match="claude_billing_header"):
        PromptCacheSettings(volatile_rules=["strip_everything"])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("lookup", "text"),
    [
        (
            CacheLookup(7238, 7207, "ram", 7207),
            "cached=7207; prompt=7238; source=ram; diverged_at=7207",
        ),
        (CacheLookup(7238, 7237, "ram", None), "cached=7237; prompt=7238; source=ram"),
        (CacheLookup(900, 0, "off", None), "cached=0; prompt=900; source=off"),
        (
            CacheLookup(900, 0, "none", 0, stored=3, before="x", after="y"),
            "cached=0; prompt=900; source=none; diverged_at=0",
        ),
        (
            CacheLookup(900, 512, "disk", 640),
            "cached=512; prompt=900; source=disk; diverged_at=640",
        ),
    ],
)
def test_the_header_reads_back(lookup: CacheLookup, text: str) -> None:
    assert header_value(lookup) == text  # no prompt text ever travels in it
    parsed = parse_header(text)
    assert parsed["cached"] == lookup.cached_tokens and parsed["prompt"] == lookup.prompt_tokens
    assert parsed["source"] == lookup.source
    assert parsed.get("diverged_at") == lookup.diverged_at
