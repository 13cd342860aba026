"""Issue 19's bar on real daemons: agents' turns hit the prompt cache on every family and API.

On a KVCache model (llama) and a hybrid one (qwen3_5: linear attention, whose
cache cannot be rewound), with a system prompt of a few thousand tokens:
turn 2 of a conversation reuses at least 95% of turn 1's prompt, and a new
conversation with the same system prompt reuses at least 90% of its own
prompt, through chat completions, Responses (``previous_response_id``) and
Messages, each read from the API's own usage fields; after a restart with
the disk tier on, turn 2 still reuses at least 90%.
"""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.support.daemon import Daemon, toml_config
from tests.support.inprocess import AppInProcess

FAMILIES = ["llama", "qwen3_5"]
MAX_TOKENS = 8

_PARAGRAPH = (
    "You are a careful coding agent working in a repository. Read the files you need, "
    "explain each change before you make it, run the tests after every edit, and keep "
    "your answers short. Tools: read_file(path), write_file(path, text), run(cmd). "
)


def system_prompt(salt: str) -> str:
    """About 2,500 tokens of instructions, different per test (no test feeds another)."""
    return f"[{salt}] " + " ".join(f"Rule {i}: {_PARAGRAPH}" for i in range(28))


def config(path: str) -> dict:
    return {"model": {"path": path, "name": "tiny"}, "batch": {"size": 4}}


@pytest.fixture(scope="module", params=FAMILIES)
def daemon(request, apps, tiny_models) -> Daemon:
    return apps.get(config(str(tiny_models(request.param))))


def chat(client, messages: list[dict]) -> tuple[str, int, int]:
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    usage = r.usage
    return r.choices[0].message.content or "", usage.prompt_tokens, cached(usage)


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_chat_turn_two_and_a_new_conversation_hit(daemon):
    client = daemon.openai(max_retries=0)
    system = {"role": "system", "content": system_prompt("chat")}
    first = [system, {"role": "user", "content": "List the files in src/."}]
    answer, prompt1, _ = chat(client, first)
    assert prompt1 > 2000
    turn2 = [
        *first,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Now open src/main.py."},
    ]
    _, _, hit2 = chat(client, turn2)
    assert hit2 >= 0.95 * prompt1, (hit2, prompt1)
    _, prompt3, hit3 = chat(client, [system, {"role": "user", "content": "Run the tests."}])
    assert hit3 >= 0.90 * prompt3, (hit3, prompt3)


def test_responses_turn_two_and_a_new_conversation_hit(daemon):
    client = daemon.openai(max_retries=0)
    instructions = system_prompt("responses")
    first = client.responses.create(
        model="tiny", instructions=instructions, input="List the files.", max_output_tokens=8
    )
    prompt1 = first.usage.input_tokens
    second = client.responses.create(
        model="tiny",
        instructions=instructions,
        previous_response_id=first.id,
        input="Now open the first one.",
        max_output_tokens=8,
    )
    hit2 = second.usage.input_tokens_details.cached_tokens
    assert hit2 >= 0.95 * prompt1, (hit2, prompt1)
    third = client.responses.create(
        model="tiny", instructions=instructions, input="Run the tests.", max_output_tokens=8
    )
    hit3, prompt3 = third.usage.input_tokens_details.cached_tokens, third.usage.input_tokens
    assert hit3 >= 0.90 * prompt3, (hit3, prompt3)


def test_messages_turn_two_and_a_new_conversation_hit(daemon):
    client = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0)
    system = system_prompt("messages")
    first_turn = [{"role": "user", "content": "List the files."}]
    first = client.messages.create(
        model="tiny", system=system, messages=first_turn, max_tokens=MAX_TOKENS
    )
    u1 = first.usage
    prompt1 = u1.input_tokens + (u1.cache_read_input_tokens or 0)
    answer = "".join(b.text for b in first.content if b.type == "text") or "ok"
    turn2 = [
        *first_turn,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Now open the first one."},
    ]
    second = client.messages.create(
        model="tiny", system=system, messages=turn2, max_tokens=MAX_TOKENS
    )
    hit2 = second.usage.cache_read_input_tokens or 0
    assert hit2 >= 0.95 * prompt1, (hit2, prompt1)
    third = client.messages.create(
        model="tiny",
        system=system,
        messages=[{"role": "user", "content": "Run the tests."}],
        max_tokens=MAX_TOKENS,
    )
    u3 = third.usage
    hit3 = u3.cache_read_input_tokens or 0
    assert hit3 >= 0.90 * (u3.input_tokens + hit3), u3


@pytest.mark.parametrize("family", FAMILIES)
def test_turn_two_hits_after_a_restart_from_the_disk_tier(family, tmp_path, tiny_models):
    daemon = AppInProcess(tmp_path, toml_config(**config(str(tiny_models(family)))))
    daemon.start()
    try:
        client = daemon.openai(max_retries=0)
        system = {"role": "system", "content": system_prompt("restart")}
        first = [system, {"role": "user", "content": "List the files in src/."}]
        answer, prompt1, _ = chat(client, first)
        daemon.stop()
        daemon.start()
        client = daemon.openai(max_retries=0)
        turn2 = [
            *first,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "Now open src/main.py."},
        ]
        _, _, hit2 = chat(client, turn2)
        stats = httpx.get(f"{daemon.url}/stats").json()["prompt_cache"]
    finally:
        daemon.stop()
    assert hit2 >= 0.90 * prompt1, (hit2, prompt1)
    assert stats["disk_tokens"] == hit2 and stats["disk_state"] == "on"
    assert list((tmp_path / "state" / "prompt-cache").rglob("*.safetensors"))
