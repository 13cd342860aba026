"""Known-volatile prompt content that defeats the prompt cache: named rules, each switchable.

A prefix cache reuses a prompt only up to its first changed token. Some
agents put a value that changes on *every request* at the very start of the
prompt, so nothing after it is ever reused. Each rule here names one such
value, removes exactly it, and nothing else; ``[prompt_cache] volatile_rules``
lists the rules in force (per model, live). A rule that changes a request is
never silent: the request carries its name to the engine
(``GenerationRequest.prompt_rules``), which counts it (``/stats``
``prompt_cache.rules``, ``/metrics`` ``mlxd_prompt_rules_applied_total``), and
the response names it (``X-Mlxd-Prompt-Rules``) as does the request's log
line (``rules=``). docs/agents.md says what each rule is for.

Rules:

- ``claude_billing_header``: Claude Code (2.1.36 and later) sends
  ``x-anthropic-billing-header: cc_version=2.1.100.a1b; cc_entrypoint=cli;
  cch=5f2e1;`` as the first block of ``system``. ``cch`` is a hash of the
  request body, new on every request, so the cache could never get past the
  first few dozen tokens. The line is billing metadata for Anthropic's API
  (which does not show it to the model either); the rule removes it when it
  starts the first system message, in the shape Claude Code sends it (a
  ``key=value;`` list), whichever API it came through (a proxy may have
  turned it into a chat system message).

:func:`strip_billing_header` works on one text, for code that handles system
blocks itself (the Messages translation may apply it per block).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

from mlxd.engine import ChatPrompt, GenerationRequest

# Rule name -> what it removes (docs/configuration.md lists the same).
RULES: dict[str, str] = {
    "claude_billing_header": (
        "Claude Code's per-request 'x-anthropic-billing-header: ...; cch=...;' line at the "
        "start of the system prompt"
    ),
}

# The header line as Claude Code writes it: the name, then `key=value;` fields
# (cc_version, cc_entrypoint, cch, cc_workload, ...), then at most one line break.
_BILLING = re.compile(r"x-anthropic-billing-header:(?:[ \t]*[A-Za-z0-9_]+=[^;\r\n]*;)+[ \t]*\r?\n?")


def strip_billing_header(text: str) -> tuple[str, bool]:
    """``text`` without a leading Claude Code billing header line, and whether it had one."""
    match = _BILLING.match(text)
    if match is None:
        return text, False
    return text[match.end() :], True


def apply_prompt_rules(gen: GenerationRequest, rules: Sequence[str]) -> GenerationRequest:
    """``gen`` with the ``rules`` in force applied to its prompt; the rules that changed
    it are listed in ``prompt_rules`` (``gen`` itself when none did)."""
    prompt = gen.prompt
    if "claude_billing_header" not in rules or not isinstance(prompt, ChatPrompt):
        return gen
    messages = list(prompt.messages)
    first = messages[0] if messages else None
    if first is None or first.get("role") not in ("system", "developer"):
        return gen
    content = first.get("content")
    if not isinstance(content, str):
        return gen
    stripped, changed = strip_billing_header(content)
    if not changed:
        return gen
    if stripped or len(messages) == 1:
        messages[0] = {**first, "content": stripped}
    else:
        del messages[0]  # the header was the whole system prompt
    applied = (*gen.prompt_rules, "claude_billing_header")
    return replace(gen, prompt=replace(prompt, messages=tuple(messages)), prompt_rules=applied)
