"""Anthropic ``role: "system"`` messages inside ``messages``, placed where templates take them.

Claude Code sends them (its mid-conversation-system beta) for any model id
that is not an older Claude id. Chat templates refuse or misplace system turns
in the middle of a conversation, so: leading ones join the system prompt, and
later ones stay where they were sent, inside the adjacent user turn as a
``<system-reminder>`` block. Never moved to the front: that would change the
prompt's start on every turn and lose the prefix cache.
"""

from __future__ import annotations


def _reminder(text: str) -> str:
    """A system message inside the conversation, as the user turn carries it."""
    return f"<system-reminder>\n{text}\n</system-reminder>"


def merge_system(out: list[dict], text: str, *, leading: bool) -> None:
    """A ``system`` message of ``messages`` where the template can take it, in place.

    Before any user or assistant message it joins the system prompt (its own
    system message when there is none). Later it stays where it was sent
    (moving it to the front would change the prompt's start and lose the
    prefix cache on every turn): it joins the user turn just before it as a
    ``<system-reminder>`` block, or opens a user turn that the next user
    message joins. Chat templates refuse or misplace system messages in the
    middle of a conversation, so none is rendered there.
    """
    if not text:
        return
    if leading:
        if out and out[-1]["role"] == "system":
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{text}"}
        else:
            out.append({"role": "system", "content": text})
        return
    last = out[-1] if out else None
    if last is not None and last["role"] == "user" and isinstance(last.get("content"), str):
        out[-1] = {**last, "content": f"{last['content']}\n\n{_reminder(text)}"}
    else:
        out.append({"role": "user", "content": _reminder(text), "mlxd_reminder": True})


def join_reminder(out: list[dict], msg: dict) -> bool:
    """A user message after a reminder that opened a user turn joins that turn."""
    last = out[-1] if out else None
    if last is None or not last.get("mlxd_reminder") or msg["role"] != "user":
        return False
    out[-1] = {"role": "user", "content": f"{last['content']}\n\n{msg['content']}"}
    return True
