"""Vision-language models in the engine: images in the batch, the prompt cache, bad images.

Two tiny families built with mlx-vlm's own classes (:mod:`tests.support.tinyvlms`): llava
(CLIP tower, full-attention llama) and gemma3 (SigLIP tower, sliding-window layers). Greedy
and float32, an image row must generate the same tokens batched beside text rows as alone;
a second turn about the same image must hit the prompt cache (and skip the vision tower),
a different image of the same size must not.
"""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from mlxd.engine.images import ImageLimits, from_base64
from mlxd.engine.messages import ChatPrompt, Failed, Finished, GenerationRequest
from tests.support.engine import run_all, running_engine, settled
from tests.support.tinyvlms import tiny_vlm_dir

LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=1 << 20, max_images=8)
MAX_TOKENS = 12


def png(color: tuple[int, int, int], size: tuple[int, int] = (28, 28), *, stripe: int = 0) -> bytes:
    image = Image.new("RGB", size, color)
    for x in range(0, size[0], 4):
        for y in range(size[1]):
            image.putpixel((x, y), (stripe, 255 - stripe, stripe // 2))
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def part(data: bytes, where: str = "messages[0].content[1]"):
    return from_base64(base64.b64encode(data).decode(), None, where, LIMITS)


def image_request(rid: str, data: bytes, text: str = "what is in this picture?", *, turns=()):
    content = [{"type": "text", "text": text}, {"type": "image", "image": 0}]
    messages = (*turns, {"role": "user", "content": content})
    return GenerationRequest(rid, ChatPrompt(messages, images=(part(data),)), MAX_TOKENS)


def text_request(rid: str, text: str) -> GenerationRequest:
    return GenerationRequest(rid, ChatPrompt(({"role": "user", "content": text},)), MAX_TOKENS)


RED = png((200, 10, 10), stripe=30)
BLUE = png((10, 10, 200), stripe=220)


@pytest.fixture(scope="module", params=["llava", "gemma3", "qwen2_vl"])
def vlm(request):
    return tiny_vlm_dir(request.param)


def test_image_rows_batched_beside_text_rows_generate_what_they_do_alone(vlm):
    with running_engine(vlm, batch={"size": 4}, prompt_cache={"max_entries": 0}) as engine:
        info = engine.info
        assert info is not None and info.vision and info.batchable
        alone = [
            run_all(engine, [r])[0]
            for r in (image_request("a", RED), image_request("b", BLUE), text_request("t", "hello"))
        ]
        together = run_all(
            engine,
            [
                image_request("a2", RED),
                text_request("t2", "hello"),
                image_request("b2", BLUE),
                text_request("t3", "the river runs past the mill"),
            ],
        )
    assert all(o.ok for o in alone + together), [o.end for o in alone + together]
    assert {o.accepted.lane for o in together} == {"batch"}  # type: ignore[union-attr]
    assert [together[0].tokens, together[2].tokens, together[1].tokens] == [
        alone[0].tokens,
        alone[1].tokens,
        alone[2].tokens,
    ]
    # The image changes the answer: two images, two different continuations.
    assert alone[0].tokens != alone[1].tokens
    # Image tokens count in the prompt.
    end = together[0].end
    assert isinstance(end, Finished) and end.usage.prompt_tokens > 4


def test_a_second_turn_about_the_same_image_reuses_its_prefill(vlm):
    with running_engine(vlm, batch={"size": 4}, prompt_cache={"disk": False}) as engine:
        (first,) = run_all(engine, [image_request("one", RED)])
        assert first.ok
        answer = first.text
        turns = (
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is in this picture?"},
                    {"type": "image", "image": 0},
                ],
            },
            {"role": "assistant", "content": answer},
        )
        again = GenerationRequest(
            "two",
            ChatPrompt(
                (*turns, {"role": "user", "content": "and its colour?"}), images=(part(RED),)
            ),
            MAX_TOKENS,
        )
        other = GenerationRequest(
            "three",
            ChatPrompt(
                (*turns, {"role": "user", "content": "and its colour?"}), images=(part(BLUE),)
            ),
            MAX_TOKENS,
        )
        tower = settled(engine).counters["vision_seconds"]
        (second,) = run_all(engine, [again])
        # The image came from the prompt cache: the vision tower did not run.
        assert settled(engine).counters["vision_seconds"] == tower > 0
        (third,) = run_all(engine, [other])
        counters = settled(engine).counters
        assert counters["vision_seconds"] > tower and counters["images"] == 3
    assert second.ok and third.ok
    assert isinstance(second.end, Finished) and isinstance(third.end, Finished)
    lookup2, lookup3 = second.end.lookup, third.end.lookup
    assert lookup2 is not None and lookup3 is not None
    # The first turn's prompt (image included) was served from the cache...
    assert second.end.usage.cached_tokens >= first.end.usage.prompt_tokens - 1  # type: ignore[union-attr]
    # ...and a different image of the same size diverges where its image tokens start.
    assert third.end.usage.cached_tokens < second.end.usage.cached_tokens
    assert lookup3.diverged_at is not None and lookup3.diverged_at < lookup2.prompt_tokens
    # The text around the divergence shows the image as a marker, not virtual token ids.
    assert lookup3.after.startswith("[image]"), lookup3.after


@pytest.mark.parametrize(
    "data, what",
    [
        (png((1, 2, 3))[:60], "cannot be"),
        (b"GIF89a" + b"\x00" * 20, "not an image mlxd can read"),
    ],
)
def test_an_image_that_does_not_decode_is_refused_naming_its_part(vlm, data, what):
    from mlxd.engine.images import ImageError

    try:
        image = part(data)
    except ImageError as exc:  # the header is already unreadable: the HTTP side's 400
        assert what in str(exc)
        return
    request = GenerationRequest(
        "bad",
        ChatPrompt(
            ({"role": "user", "content": [{"type": "image", "image": 0}]},), images=(image,)
        ),
        4,
    )
    with running_engine(vlm) as engine:
        (out,) = run_all(engine, [request])
    assert isinstance(out.accepted, Failed) and out.accepted.status == 400
    assert out.accepted.param == "messages[0].content[1]"
    assert what in out.accepted.message


def test_a_text_model_refuses_an_image(tiny_models):
    with running_engine(tiny_models("llama")) as engine:
        (out,) = run_all(engine, [image_request("x", RED)])
    assert isinstance(out.accepted, Failed) and out.accepted.status == 400
    assert out.accepted.param == "messages[0].content[1]"
    assert "does not take images" in out.accepted.message


def test_without_mlx_vlm_a_vision_model_fails_with_the_install_command(vlm, monkeypatch):
    import sys

    from mlxd.config import ModelSettings
    from mlxd.engine.chat.loading import ModelLoadError, load_model

    monkeypatch.setitem(sys.modules, "mlx_vlm.utils", None)  # the import fails, as uninstalled
    with pytest.raises(ModelLoadError, match=r"pip install 'mlxd\[embeddings\]'"):
        load_model(ModelSettings(path=str(vlm)), optimized_blas=False, generation=0)


def test_which_directories_load_as_vision_models(tmp_path, vlm):
    import json
    import shutil

    from mlxd.config import ModelSettings
    from mlxd.engine.chat.loading import ModelLoadError, load_model
    from mlxd.engine.chat.mrope_layout import is_mrope
    from mlxd.engine.chat.vision_loading import wants_vision

    auto, on, off = ModelSettings(), ModelSettings(vision=True), ModelSettings(vision=False)
    assert wants_vision(auto, vlm) and wants_vision(on, vlm) and not wants_vision(off, vlm)
    # A text-only conversion that kept the vision_config but no processor: text.
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(vlm / "config.json", bare / "config.json")
    assert not wants_vision(auto, bare) and wants_vision(on, bare)
    # Multimodal rotary positions in a family mlxd has no positions for: asked for, a clear
    # refusal (detected: served as text).
    mrope = tmp_path / "mrope"
    shutil.copytree(vlm, mrope)
    config = json.loads((mrope / "config.json").read_text())
    if is_mrope(config):  # a Qwen-VL family: served (tests/engine/test_mrope.py)
        return
    config["text_config"]["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 1, 1]}
    (mrope / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="mrope"):
        load_model(ModelSettings(path=str(mrope), vision=True), optimized_blas=False, generation=0)


def test_an_image_row_in_the_serial_lane_generates_what_it_does_in_the_batch(vlm):
    from dataclasses import replace

    from mlxd.engine.messages import SamplingParams

    with running_engine(vlm, batch={"size": 4}, prompt_cache={"max_entries": 0}) as engine:
        (batched,) = run_all(engine, [image_request("b", RED)])
        serial_request = replace(image_request("s", RED), sampling=SamplingParams(seed=3))
        (serial,) = run_all(engine, [serial_request])
    assert batched.ok and serial.ok
    assert serial.accepted.lane == "serial" and batched.accepted.lane == "batch"  # type: ignore[union-attr]
    assert serial.tokens == batched.tokens


def test_an_image_prompt_survives_a_restart_in_the_disk_tier(vlm, tmp_path):
    cache = {"disk_dir": str(tmp_path / "cache"), "max_entries": 8}
    with running_engine(vlm, prompt_cache=cache) as engine:
        (first,) = run_all(engine, [image_request("one", RED)])
    assert first.ok and isinstance(first.end, Finished)
    turns = (
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is in this picture?"},
                {"type": "image", "image": 0},
            ],
        },
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "and then?"},
    )
    with running_engine(vlm, prompt_cache=cache) as engine:
        (again,) = run_all(
            engine, [GenerationRequest("two", ChatPrompt(turns, images=(part(RED),)), 4)]
        )
        (other,) = run_all(
            engine, [GenerationRequest("three", ChatPrompt(turns, images=(part(BLUE),)), 4)]
        )
        counters = settled(engine).counters
    assert isinstance(again.end, Finished) and isinstance(other.end, Finished)
    assert again.end.lookup is not None and again.end.lookup.source == "disk"
    assert again.end.usage.cached_tokens >= first.end.usage.prompt_tokens - 1
    # Another image of the same size: never the stored one.
    assert other.end.usage.cached_tokens < again.end.usage.cached_tokens
    assert counters["images"] == 2


def test_a_text_model_swapped_for_a_vision_model_takes_images(tiny_models, vlm):
    from mlxd.config import ModelSettings
    from tests.support.engine import make_engine

    engine = make_engine(tiny_models("llama"), batch={"size": 4})
    try:
        (refused,) = run_all(engine, [image_request("before", RED)])
        assert isinstance(refused.accepted, Failed) and refused.accepted.status == 400
        settings = engine.settings.model_copy(update={"model": ModelSettings(path=str(vlm))})
        info = engine.load(settings).result(120)
        assert info.vision and engine.info is not None and engine.info.vision
        (after,) = run_all(engine, [image_request("after", RED)])
        assert after.ok and len(after.tokens) == MAX_TOKENS
        back = engine.settings.model_copy(
            update={"model": ModelSettings(path=str(tiny_models("llama")))}
        )
        assert not engine.load(back).result(120).vision
        (again,) = run_all(engine, [image_request("again", RED)])
        assert (
            isinstance(again.accepted, Failed) and "does not take images" in again.accepted.message
        )
    finally:
        engine.stop()


def two_images(rid: str, first: bytes, second: bytes) -> GenerationRequest:
    content = [
        {"type": "text", "text": "compare"},
        {"type": "image", "image": 0},
        {"type": "text", "text": "with"},
        {"type": "image", "image": 1},
    ]
    images = (part(first), part(second, "messages[0].content[3]"))
    return GenerationRequest(
        rid, ChatPrompt(({"role": "user", "content": content},), images=images), 8
    )


def test_each_image_goes_through_the_tower_when_its_chunk_comes(vlm):
    # 16-token chunks put the two images in different prefill chunks: the second image is
    # encoded when its chunk runs, beside a text row; the answer is what one chunk gives.
    small = {"size": 4, "prefill_step_size": 16}
    with running_engine(vlm, batch=small, prompt_cache={"max_entries": 0}) as engine:
        chunked = run_all(engine, [two_images("c", RED, BLUE), text_request("t", "hello")])
    with running_engine(vlm, batch={"size": 4}, prompt_cache={"disk": False}) as engine:
        (whole,) = run_all(engine, [two_images("w", RED, BLUE)])
        (swapped,) = run_all(engine, [two_images("s", RED, png((0, 200, 0), stripe=90))])
        counters = settled(engine).counters
    assert chunked[0].ok and whole.ok and swapped.ok
    assert isinstance(whole.end, Finished) and whole.end.usage.prompt_tokens > 16
    assert chunked[0].tokens == whole.tokens
    # The first image's tokens are keyed by its own pixels: with another second image the
    # prompt leaves the stored one only at the second image (a sliding-window cache resumes
    # from a checkpoint, so only the divergence is common to both families).
    assert isinstance(swapped.end, Finished) and swapped.end.lookup is not None
    diverged = swapped.end.lookup.diverged_at
    assert diverged is not None and diverged > whole.end.usage.prompt_tokens // 2
    assert swapped.end.lookup.after.startswith("[image]")
    assert counters["images"] == 4


def test_joining_runs_the_tower_for_the_first_needed_image_only(vlm):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.config import ModelSettings
    from mlxd.engine.chat.intake import tokenize_with_images
    from mlxd.engine.chat.loading import load_model

    loaded = load_model(ModelSettings(path=str(vlm)), optimized_blas=False, generation=0)
    ids, images = tokenize_with_images(loaded, two_images("x", RED, BLUE))
    assert images is not None and len(images.spans) == 2
    model = loaded.model
    # The prompt cache already holds the first image: only the second is needed.
    second = list(images.ids[images.spans[0] :])
    assert model.register(images, second) > 0
    assert images.features[0] is None and images.features[1] is not None
    # A forward pass that reaches the first image's tokens runs the tower for it then.
    mx.eval(model(mx.array([ids]), cache=make_prompt_cache(model)))
    assert images.features[0] is not None and images.seconds > 0
    assert model.release(images) > 0 and model.holding == 0


def test_an_image_row_generates_what_mlx_vlm_generates(vlm):
    """Fidelity: mlx-vlm's own generate_step on the same prompt ids and pixels, greedy."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step

    from mlxd.config import ModelSettings
    from mlxd.engine.chat.intake import tokenize_with_images
    from mlxd.engine.chat.loading import load_model
    from mlxd.engine.chat.vision_intake import VIRTUAL_BASE

    loaded = load_model(ModelSettings(path=str(vlm)), optimized_blas=False, generation=0)
    ids, images = tokenize_with_images(loaded, image_request("x", RED))
    assert images is not None
    # mlx-vlm sees the processor's own ids: every image token as the image token id.
    real = mx.array([[images.placeholder if t >= VIRTUAL_BASE else t for t in ids]])
    inputs = {k: mx.array(v) for k, v in images.inputs.items()}
    pixels = inputs.pop("pixel_values")  # the rest: Qwen-VL's image_grid_thw
    steps = generate_step(
        real,
        loaded.model.vlm,
        pixels,
        mx.ones(real.shape),
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        **inputs,
    )
    expected = [int(token) for token, _ in steps]
    with running_engine(vlm, batch={"size": 4}, prompt_cache={"max_entries": 0}) as engine:
        got = run_all(engine, [image_request("a", RED), text_request("t", "hello there")])
    assert got[0].ok and got[0].tokens == expected
