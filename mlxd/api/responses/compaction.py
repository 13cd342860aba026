"""Compaction for Codex: a conversation folded into one sealed ``compaction`` item.

Codex, treating the provider as OpenAI, ends a turn's ``input`` with a
``{"type": "compaction_trigger"}`` item (older versions ``POST
/v1/responses/compact``) and expects exactly one ``compaction`` output item
whose ``encrypted_content`` stands for the conversation so far; later turns
send that item back in ``input`` in place of the history it replaced.

mlxd answers with a **summary row**: the same prompt the conversation's last
turn had (instructions, tools, every message), so its prefix comes out of the
prompt cache, followed by one user message asking for a handoff summary. The
summary is sealed into a capsule (:class:`Capsules`): compressed, base64, and
authenticated with HMAC-SHA256 under a key kept in ``<state_dir>/compaction.key``
and the caller's API key, so a capsule from another server, another key or
edited by hand is a 400. A later turn's ``compaction`` item is expanded into a
user message carrying the summary.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import os
import threading
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

from mlxd.api.http.errors import OpenAIError
from mlxd.api.params import bad
from mlxd.api.responses.render import OnDone, ResponsesOutput
from mlxd.engine import Delta, Finished

PREFIX = "mlxd.c1."
SUMMARY_REQUEST = (
    "Write a concise handoff of the conversation above so that another assistant can "
    "continue the user's work. Do not continue the task and do not call tools. Keep the "
    "goal, the user's requirements and corrections, decisions, work done, open questions, "
    "exact file paths and identifiers, and the next steps. Return only the handoff."
)
SUMMARY_HEADER = "Summary of the earlier conversation (compacted):\n"
_KEY_FILE = "compaction.key"


class Capsules:
    """Seals summaries into opaque capsules and opens them (HMAC key under the state dir)."""

    def __init__(self, state_dir: Path):
        self._path = Path(state_dir).expanduser() / _KEY_FILE
        self._key: bytes | None = None
        self._lock = threading.Lock()

    def _secret(self) -> bytes:
        with self._lock:
            if self._key is None:
                self._key = _load_or_create(self._path)
            return self._key

    def _tag(self, payload: bytes, owner: str | None) -> bytes:
        bound = payload + b"\0" + (owner or "").encode()
        return hmac.new(self._secret(), bound, hashlib.sha256).digest()

    def seal(self, summary: str, owner: str | None) -> str:
        payload = zlib.compress(json.dumps({"v": 1, "summary": summary}).encode())
        tag = self._tag(payload, owner)
        return PREFIX + _b64(payload) + "." + _b64(tag)

    def open(self, capsule: Any, owner: str | None, where: str) -> str:
        """The summary a capsule holds; a 400 naming ``where`` when it is not one of ours."""
        refusal = OpenAIError(
            400,
            "This compaction item was not sealed by this server for this API key, or was "
            "changed (its encrypted_content does not verify); send the conversation instead.",
            code="invalid_compaction",
            param=f"{where}.encrypted_content",
        )
        if not isinstance(capsule, str) or not capsule.startswith(PREFIX):
            raise refusal
        body, _, tag = capsule[len(PREFIX) :].partition(".")
        try:
            payload, given = _unb64(body), _unb64(tag)
        except ValueError:
            raise refusal from None
        if not hmac.compare_digest(given, self._tag(payload, owner)):
            raise refusal
        try:
            state = json.loads(zlib.decompress(payload))
        except (zlib.error, ValueError):
            raise refusal from None
        if not isinstance(state, dict) or not isinstance(state.get("summary"), str):
            raise refusal
        return state["summary"]


def _load_or_create(path: Path) -> bytes:
    """The key, made once (owner-only, created atomically so two processes agree)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes()
    with os.fdopen(fd, "wb") as out:
        out.write(os.urandom(32))
    return path.read_bytes()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError) as exc:
        raise ValueError("not base64") from exc


def prepare(
    value: str | list[dict[str, Any]] | None, capsules: Capsules, owner: str | None
) -> tuple[str | list[dict[str, Any]] | None, bool]:
    """``input`` with each ``compaction`` item expanded into its summary, the trailing
    ``compaction_trigger`` turned into the summary request; and whether it was there."""
    if not isinstance(value, list):
        return value, False
    out: list[dict[str, Any]] = []
    triggered = False
    for i, item in enumerate(value):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "compaction_trigger":
            if i != len(value) - 1:
                raise bad(f"input[{i}]", "compaction_trigger must be the last input item.")
            triggered = True
        elif kind == "compaction":
            summary = capsules.open(item.get("encrypted_content"), owner, f"input[{i}]")
            out.append({"type": "message", "role": "user", "content": SUMMARY_HEADER + summary})
        else:
            out.append(item)
    if triggered:
        out.append({"type": "message", "role": "user", "content": SUMMARY_REQUEST})
    return out, triggered


def compaction_item(capsule: str) -> dict[str, Any]:
    return {"id": f"cmp_{uuid.uuid4().hex}", "type": "compaction", "encrypted_content": capsule}


class CompactionOutput(ResponsesOutput):
    """A summary row's answer: no text streams; the response holds one ``compaction`` item."""

    def __init__(
        self,
        response_id: str,
        model: str,
        echo: dict[str, Any],
        seal: Any,
        on_done: OnDone | None = None,
    ):
        super().__init__(response_id, model, echo, on_done)
        self._seal = seal
        self._summary: list[str] = []
        self._item: dict[str, Any] | None = None

    def _feed(self, delta: Delta) -> list[bytes]:
        self._summary.append(delta.text)
        return []

    def _final(self, finished: Finished) -> dict[str, Any]:
        if self._item is None:
            self._item = compaction_item(self._seal("".join(self._summary).strip()))
        body = self._response("completed", [self._item], usage=finished.usage)
        body["completed_at"] = int(time.time())
        if self.on_done is not None:
            self.on_done(body, {"role": "assistant", "content": ""})
        return body

    def stream_end(self, finished: Finished) -> list[bytes]:
        body = self._final(finished)
        item = body["output"][0]
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.output_item.done", output_index=0, item=item),
            self._event("response.completed", response=body),
        ]


class CompactOutput(CompactionOutput):
    """``POST /v1/responses/compact``'s answer: ``{"object": "response.compaction", "output"}``."""

    def response(self, finished: Finished) -> dict[str, Any]:
        body = self._final(finished)
        return {
            "id": body["id"],
            "object": "response.compaction",
            "created_at": body["created_at"],
            "output": body["output"],
            "usage": body["usage"],
        }


@functools.cache
def capsules_in(state_dir: Path) -> Capsules:
    """The one :class:`Capsules` of a state directory (its key is read once)."""
    return Capsules(state_dir)
