"""A Qwen-VL image (3-D rotary positions) on every API gives mlx-vlm's own answer.

One in-process daemon serves the tiny qwen2_vl of :mod:`tests.support.tinyvlms`. An image
on chat completions, Responses and Messages gives, token for token, what mlx-vlm's
``generate_step`` gives for the same prompt and pixels; its image tokens are in the
prompt's count.
"""

from __future__ import annotations

import base64
from typing import Any

import anthropic
import pytest

from tests.engine.test_mrope import BLUE, ask, mlx_vlm_answer
from tests.support.daemon import toml_config
from tests.support.tinyvlms import tiny_vlm_dir

TOKENS = 8


@pytest.fixture(scope="module")
def daemon(apps):
    config = toml_config(
        batch={"size": 4},
        sampling={"max_tokens": TOKENS, "temperature": 0.0},
        prompt_cache={"disk": False},
        models={"qwen": {"path": str(tiny_vlm_dir("qwen2_vl")), "default": True}},
    )
    return apps.get(config)


def test_an_image_on_every_api_gives_mlx_vlms_answer(daemon):
    from mlxd.config import ModelSettings
    from mlxd.engine.chat.intake import tokenize_with_images
    from mlxd.engine.chat.loading import load_model

    loaded = load_model(
        ModelSettings(path=str(tiny_vlm_dir("qwen2_vl"))), optimized_blas=False, generation=0
    )
    expected = loaded.tokenizer.decode(mlx_vlm_answer(loaded, ask("x", BLUE, text="describe")))
    data = base64.b64encode(BLUE).decode()
    url = f"data:image/png;base64,{data}"
    client = daemon.openai()
    chat = client.chat.completions.create(
        model="qwen",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "describe"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        max_tokens=TOKENS,
    )
    response = client.responses.create(
        model="qwen",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "describe"},
                    {"type": "input_image", "image_url": url, "detail": "auto"},
                ],
            }
        ],
        max_output_tokens=TOKENS,
    )
    claude = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0)
    turn: Any = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "describe"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": data},
                },
            ],
        }
    ]
    message = claude.messages.create(model="qwen", max_tokens=TOKENS, messages=turn)
    assert chat.choices[0].message.content == expected
    assert response.output_text == expected
    assert message.content[0].text == expected  # type: ignore[union-attr]
    # The prompt's count holds the 112x56 image's 8 tokens, as the engine tokenizes it.
    ids, images = tokenize_with_images(loaded, ask("x", BLUE, text="describe"))
    assert images is not None and len(images.ids) == 8
    assert chat.usage is not None and chat.usage.prompt_tokens == len(ids)
    assert response.usage is not None and response.usage.input_tokens == len(ids)


def test_a_video_part_is_a_clear_400_naming_it(daemon):
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    body = {
        "model": "qwen",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, video]}],
    }
    with daemon.client() as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[0].content[1]" and "Video input" in error["message"]
