"""A Batch API line runs as the key that created its batch (issues 23 and 24).

The key's ``models`` list applies to each line as to a direct call (403
``model_not_allowed`` in the error file); its rate quotas do not (the lines
run only in idle time, in the ``batch`` class): a key allowed one request a
minute still gets every line of its batch answered.
"""

from __future__ import annotations

import io
import json
import re
import time
from typing import Any

import httpx
import openai
import pytest

from tests.support.daemon import toml_config

LIMITED = "sk-batch-limited"


@pytest.fixture(scope="module")
def daemon(apps, tiny_models):
    config = toml_config(
        models={
            "chat": {"path": str(tiny_models("llama")), "default": True},
            "other": {"path": str(tiny_models("llama_b"))},
        },
        keys={"limited": {"key": LIMITED, "models": ["chat"], "requests_per_minute": 1}},
        batch={"size": 4},
    )
    return apps.get(config, name="batch-keys")


def line(custom_id: str, model: str) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def test_lines_run_as_the_batch_owner_key_its_models_but_not_its_quotas(daemon):
    client: openai.OpenAI = daemon.openai(api_key=LIMITED)
    lines = [line("a", "chat"), line("b", "chat"), line("forbidden", "other"), line("c", "chat")]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 180
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
    assert batch.status == "completed", batch
    out = [
        json.loads(x)
        for x in client.files.content(batch.output_file_id or "").text.split("\n")
        if x
    ]
    err = [
        json.loads(x) for x in client.files.content(batch.error_file_id or "").text.split("\n") if x
    ]
    # Three lines past a one-request-a-minute quota: all answered.
    assert [o["custom_id"] for o in out] == ["a", "b", "c"]
    assert all(o["response"]["status_code"] == 200 for o in out)
    # The key's models list: the direct call's 403.
    assert [e["custom_id"] for e in err] == ["forbidden"]
    assert err[0]["response"]["status_code"] == 403
    assert err[0]["response"]["body"]["error"]["code"] == "model_not_allowed"
    # Issue 33 item 8: the lines show their key's name in the log and /metrics.
    deadline = time.monotonic() + 10
    while daemon.log().count("key=limited priority=batch") < 3:  # written after each answer
        assert time.monotonic() < deadline, daemon.log()[-3000:]
        time.sleep(0.05)
    metrics = httpx.get(f"{daemon.url}/metrics").text
    assert 'mlxd_key_requests_total{key="limited"} 3.0' in metrics, metrics
    tokens = re.search(r'mlxd_key_tokens_total\{key="limited"\} ([\d.]+)', metrics)
    assert tokens and float(tokens.group(1)) > 0
    direct = client.with_options(max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        direct.chat.completions.create(**lines[2]["body"])
    # The lines were not counted against the key's quota: its one request is still free.
    assert direct.chat.completions.create(**lines[0]["body"]).choices
    with pytest.raises(openai.RateLimitError):
        direct.chat.completions.create(**lines[0]["body"])
    # The model the key may not use was never loaded for the batch.
    models = {m["id"]: m["state"] for m in daemon.stats()["fleet"]["models"]}
    assert models["other"] != "loaded", models
