"""Images on every API, against a real daemon serving a tiny vision-language model.

One daemon serves ``vlm`` (the tiny llava of :mod:`tests.support.tinyvlms`, the default)
and ``text`` (the tiny llama). Through the ``openai`` and ``anthropic`` SDKs and raw
HTTP: chat ``image_url`` parts, Responses ``input_image``, Messages ``image`` blocks
give the same greedy answer for the same image; a second turn about the same image is
served from the prompt cache; every limit, every bad image and an image sent to the
text model is a 400 naming the part, in the error shape of the API it came in on.
"""

from __future__ import annotations

import base64
import io
import random
import struct
import zlib
from typing import Any

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from tests.support.daemon import toml_config
from tests.support.tinyvlms import tiny_vlm_dir

MAX_IMAGE_BYTES = 16 * 1024
MAX_PIXELS = 512 * 512
TOKENS = 8


@pytest.fixture(scope="module")
def daemon(apps, tiny_models):
    config = toml_config(
        batch={"size": 4},
        sampling={"max_tokens": TOKENS},
        prompt_cache={"disk": False},
        limits={"image_bytes": MAX_IMAGE_BYTES, "image_pixels": MAX_PIXELS, "max_images": 2},
        models={
            "vlm": {"path": str(tiny_vlm_dir("llava")), "default": True, "pin": True},
            "text": {"path": str(tiny_models("llama"))},
        },
    )
    return apps.get(config)


def encode(image: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def picture(color: tuple[int, int, int], size: tuple[int, int] = (28, 28)) -> Image.Image:
    image = Image.new("RGB", size, color)
    for x in range(0, size[0], 3):
        image.putpixel((x, x % size[1]), (255 - color[0], 128, color[2] // 2))
    return image


def noise(side: int) -> Image.Image:
    """Incompressible pixels: a PNG of ``side``² pixels takes about 3·side² bytes."""
    return Image.frombytes("RGB", (side, side), random.Random(side).randbytes(side * side * 3))


RED = encode(picture((200, 20, 20)))
BLUE = encode(picture((20, 20, 200)))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{b64(data)}"


def chat_body(url: str, text: str = "describe this", model: str = "vlm") -> dict:
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": model, "messages": [{"role": "user", "content": content}]}


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG whose header claims a huge canvas (its pixels are never sent)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    )


def openai_error(r: httpx.Response, code: str, param: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    return error["message"]


def anthropic_error(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


def test_models_say_which_model_takes_images(daemon):
    with daemon.client() as http:
        assert http.post("/v1/chat/completions", json=chat_body(data_url(RED))).status_code == 200
        models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert models["vlm"]["capabilities"]["vision"] is True
    stats = daemon.stats()
    (vlm,) = [m for m in stats["fleet"]["models"] if m["id"] == "vlm"]
    assert vlm["capabilities"]["vision"] is True
    # The vision tower's and projector's weights count in the memory budget, not only the
    # language model's: the fleet holds every tensor of the checkpoint.
    import mlx.core as mx

    tensors = mx.load(str(tiny_vlm_dir("llava") / "model.safetensors"))
    assert isinstance(tensors, dict)
    total = sum(t.nbytes for t in tensors.values())
    language = sum(t.nbytes for k, t in tensors.items() if k.startswith("language_model."))
    assert language < total
    assert models["vlm"]["weights_bytes"] == vlm["weights_bytes"] == total


def test_the_three_apis_give_the_same_answer_about_the_same_image(daemon):
    client = daemon.openai()
    chat = client.chat.completions.create(
        model="vlm",
        messages=chat_body(data_url(RED))["messages"],  # type: ignore[arg-type]
        max_tokens=TOKENS,
    )
    response = client.responses.create(
        model="vlm",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "describe this"},
                    {"type": "input_image", "image_url": data_url(RED), "detail": "auto"},
                ],
            }
        ],
        max_output_tokens=TOKENS,
    )
    claude = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0)
    image = {"type": "base64", "media_type": "image/png", "data": b64(RED)}
    anthropic_turn: Any = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "describe this"},
                {"type": "image", "source": image},
            ],
        }
    ]
    message = claude.messages.create(
        model="vlm",
        max_tokens=TOKENS,
        messages=anthropic_turn,
    )
    text = chat.choices[0].message.content
    assert text and response.output_text == text
    assert message.content[0].text == text  # type: ignore[union-attr]
    assert chat.usage is not None and response.usage is not None
    assert chat.usage.prompt_tokens == response.usage.input_tokens
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == (
        chat.usage.prompt_tokens
    )
    count = claude.messages.count_tokens(
        model="vlm",
        messages=anthropic_turn,
    )
    assert count.input_tokens == chat.usage.prompt_tokens
    with daemon.client() as http:
        metrics = http.get("/metrics").text
    assert 'mlxd_images_total{model="vlm"}' in metrics
    assert 'mlxd_vision_seconds_total{model="vlm"}' in metrics
    # Another image, another answer (the image reaches the model).
    other = client.chat.completions.create(
        model="vlm",
        messages=chat_body(data_url(BLUE))["messages"],  # type: ignore[arg-type]
        max_tokens=TOKENS,
    )
    assert other.choices[0].message.content != text


def test_streaming_with_an_image(daemon):
    stream = daemon.openai().chat.completions.create(
        model="vlm",
        messages=chat_body(data_url(BLUE), "stream it")["messages"],  # type: ignore[arg-type]
        max_tokens=TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == TOKENS


def test_a_second_turn_about_the_same_screenshot_is_served_from_the_cache(daemon):
    client = daemon.openai()
    first = client.responses.create(
        model="vlm",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what does this screenshot show?"},
                    {"type": "input_image", "image_url": data_url(BLUE)},
                ],
            }
        ],
        max_output_tokens=TOKENS,
    )
    second = client.responses.create(
        model="vlm",
        previous_response_id=first.id,
        input="and what colour is it?",
        max_output_tokens=TOKENS,
    )
    assert first.usage is not None and second.usage is not None
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens - 1, (cached, first.usage.input_tokens)


def test_an_animated_gif_and_a_jpeg_and_a_webp_are_taken(daemon):
    frames = [picture((200, 0, 0)), picture((0, 200, 0))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    gif = buf.getvalue()
    with daemon.client() as http:
        for data, media in (
            (gif, "image/gif"),
            (encode(picture((9, 99, 199)), "JPEG"), "image/jpeg"),
            (encode(picture((9, 99, 199)), "WEBP"), "image/webp"),
        ):
            r = http.post("/v1/chat/completions", json=chat_body(data_url(data, media)))
            assert r.status_code == 200, (media, r.text)


BAD_IMAGES = [
    ("data:image/png;base64,@@not base64@@", "not valid base64"),
    (data_url(RED[:70]), "cannot be"),
    (data_url(bomb_png()), "pixels"),
    (data_url(encode(noise(96))), "bytes"),
    (data_url(encode(picture((1, 2, 3)), "BMP"), "image/bmp"), "not supported"),
    (data_url(RED, "image/jpeg"), "media type"),
    ("https://example.com/cat.png", "does not fetch"),
]


@pytest.mark.parametrize("url, what", BAD_IMAGES)
def test_bad_images_are_400s_naming_the_part_on_each_api(daemon, url, what):
    param = "messages[0].content[1].image_url"
    with daemon.client() as http:
        message = openai_error(
            http.post("/v1/chat/completions", json=chat_body(url)), "invalid_image", param
        )
        assert what in message and param in message
        responses = {
            "model": "vlm",
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "x"},
                        {"type": "input_image", "image_url": url},
                    ],
                }
            ],
        }
        r = http.post("/v1/responses", json=responses)
        assert what in openai_error(r, "invalid_image", "input[0].content[1].image_url")
        if url.startswith("data:"):
            media, _, payload = url[5:].partition(";base64,")
            source = {"type": "base64", "media_type": media, "data": payload}
        else:
            source = {"type": "url", "url": url}
        block = {"type": "image", "source": source}
        body = {"model": "vlm", "max_tokens": 4, "messages": [{"role": "user", "content": [block]}]}
        message = anthropic_error(http.post("/v1/messages", json=body))
        assert what in message and "messages[0].content[0]" in message
        # The daemon still serves.
        assert http.post("/v1/chat/completions", json=chat_body(data_url(RED))).status_code == 200


def test_too_many_images_are_refused(daemon):
    url = data_url(RED)
    part = {"type": "image_url", "image_url": {"url": url}}
    body = {"model": "vlm", "messages": [{"role": "user", "content": [part, part, part]}]}
    with daemon.client() as http:
        message = openai_error(
            http.post("/v1/chat/completions", json=body),
            "too_many_images",
            "messages[0].content[2].image_url",
        )
    assert "max_images" in message


def test_a_text_model_refuses_an_image_on_each_api(daemon):
    with daemon.client() as http:
        r = http.post("/v1/chat/completions", json=chat_body(data_url(RED), model="text"))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages[0].content[1].image_url"
        assert "does not take images" in error["message"]
        block = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": b64(RED)},
        }
        body = {
            "model": "text",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": [block]}],
        }
        assert "does not take images" in anthropic_error(http.post("/v1/messages", json=body))
    with pytest.raises(openai.BadRequestError, match="does not take images"):
        daemon.openai(max_retries=0).responses.create(
            model="text",
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": data_url(RED)}],
                }
            ],
        )


@pytest.mark.browser
def test_the_dashboard_shows_an_image_row(daemon, pages, tmp_path):
    """A running image row carries its image badge; MLXD_SCREENSHOT=1 saves docs/img's shot."""
    import os
    import threading

    from tests.support import ROOT

    with daemon.client() as http:  # one finished image request, for the counters
        assert http.post("/v1/chat/completions", json=chat_body(data_url(RED))).status_code == 200
    body = chat_body(data_url(BLUE), "tell me everything about this picture")
    body.update(max_tokens=3000, stream=True)
    stop = threading.Event()

    def run() -> None:
        with daemon.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    break

    texts = [
        threading.Thread(target=run, daemon=True),
        threading.Thread(
            target=lambda: daemon.client().post(
                "/v1/chat/completions",
                json={
                    "model": "vlm",
                    "max_tokens": 2000,
                    "messages": [{"role": "user", "content": "a story"}],
                },
            ),
            daemon=True,
        ),
    ]
    for t in texts:
        t.start()
    try:
        page = pages(viewport={"width": 1280, "height": 900})
        page.goto(f"{daemon.url}/dashboard")
        badge = page.locator("#active-rows [data-field=images]").first
        badge.wait_for(timeout=20_000)
        assert badge.inner_text() == "1 image"
        # The models panel marks the vision model (and not the text one).
        assert page.locator("[data-field=vision]").count() == 1
        # Finished requests' images are counted, with the tower's time.
        assert int(page.locator("#counters [data-field=images]").inner_text()) > 0
        screenshot = os.environ.get("MLXD_SCREENSHOT") == "1"
        shot = ROOT / "docs" / "img" / "dashboard-vision.png" if screenshot else tmp_path / "v.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
    finally:
        stop.set()
        for t in texts:
            t.join(timeout=60)


@pytest.fixture(scope="module")
def fetching(apps):
    config = toml_config(
        server={"fetch_images": True},
        limits={"image_fetch_timeout": 5.0},
        model={"path": str(tiny_vlm_dir("llava")), "name": "vlm"},
    )
    return apps.get(config)


def test_with_fetch_images_on_a_private_address_is_still_refused(fetching):
    url = f"{fetching.url}/health"  # the daemon itself: loopback
    with fetching.client() as http:
        message = openai_error(
            http.post("/v1/chat/completions", json=chat_body(url)),
            "invalid_image",
            "messages[0].content[1].image_url",
        )
        assert "loopback" in message
        block = {"type": "image", "source": {"type": "url", "url": "http://169.254.169.254/"}}
        body = {"model": "vlm", "max_tokens": 4, "messages": [{"role": "user", "content": [block]}]}
        assert "link-local" in anthropic_error(http.post("/v1/messages", json=body))
        r = http.post("/v1/messages/count_tokens", json={k: body[k] for k in ("model", "messages")})
        assert "link-local" in anthropic_error(r)


def test_a_screenshot_in_a_tool_result_reaches_the_model(daemon):
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": b64(RED)},
    }

    def body(result: list, model: str = "vlm") -> dict:
        return {
            "model": model,
            "max_tokens": 4,
            "messages": [
                {"role": "user", "content": "take a screenshot"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "toolu_1", "name": "shot", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": result}
                    ],
                },
            ],
        }

    text = [{"type": "text", "text": "here it is"}]
    with daemon.client() as http:
        with_image = http.post("/v1/messages", json=body([*text, image]))
        without = http.post("/v1/messages", json=body(text))
        assert with_image.status_code == 200, with_image.text
        assert without.status_code == 200, without.text

        def prompt(r: httpx.Response) -> int:  # cached prompt tokens are reported apart
            usage = r.json()["usage"]
            return usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0)

        assert prompt(with_image) > prompt(without)
        refused = http.post("/v1/messages", json=body([*text, image], model="text"))
        message = anthropic_error(refused)
        assert "does not take images" in message and "content[0].content[1]" in message
