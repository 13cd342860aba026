"""Qwen-VL images in the engine: 3-D (mrope) positions per row, against mlx-vlm's own answers.

The tiny Qwen-VL families of :mod:`tests.support.tinyvlms` (qwen2_vl; qwen2_5_vl, windowed
vision attention; qwen3_vl and its MoE, deepstack; qwen3_5 and its MoE, hybrid linear
attention), greedy and float32. Image rows of different sizes, a two-image row, an image
in each of two turns and a text row share one batch, and each gives what mlx-vlm's
``generate_step`` gives for it; the positions the position cache hands the language model
are mlx-vlm's ``get_rope_index`` exactly, chunk by chunk and after a trim; a cached second
turn (RAM, the disk tier after a restart) gives mlx-vlm's cold answer and a preempted image
row its own; a failing vision tower fails its own row only.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlxd.config import ModelSettings
from mlxd.engine.chat.intake import tokenize_with_images
from mlxd.engine.chat.loading import load_model
from mlxd.engine.chat.vision_intake import VIRTUAL_BASE
from mlxd.engine.messages import (
    ChatPrompt,
    Delta,
    Failed,
    Finished,
    GenerationRequest,
    SamplingParams,
)
from tests.engine.test_vision import part, png
from tests.support.engine import consume, run_all, running_engine, settled
from tests.support.tinyvlms import QWEN_FAMILIES, tiny_vlm_dir

TOKENS = 8
RED = png((200, 10, 10), (56, 56), stripe=30)
BLUE = png((10, 10, 200), (112, 56), stripe=220)  # 8 image tokens: a 4x2 grid
TALL = png((10, 200, 10), (56, 112), stripe=90)  # a 2x4 grid
QUESTION = "what is in this picture?"


def ask(rid: str, *images: bytes, text: str = QUESTION, turns=(), tokens: int = TOKENS):
    content: list[dict] = [{"type": "text", "text": text}]
    parts = []
    for i, data in enumerate(images):
        content.append({"type": "image", "image": i})
        parts.append(part(data, f"messages[{len(turns)}].content[{i + 1}]"))
    messages = (*turns, {"role": "user", "content": content})
    prompt = ChatPrompt(messages, images=tuple(parts))
    return GenerationRequest(rid, prompt, tokens, sampling=SamplingParams(temperature=0.0))


def two_turns(rid: str, first: bytes, second: bytes) -> GenerationRequest:
    """An image in the first turn, another in the second."""
    messages = (
        {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image"}]},
        {"role": "assistant", "content": "a red square"},
        {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "image"}]},
    )
    images = (part(first, "messages[0].content[1]"), part(second, "messages[2].content[1]"))
    prompt = ChatPrompt(messages, images=images)
    return GenerationRequest(rid, prompt, TOKENS, sampling=SamplingParams(temperature=0.0))


def text(rid: str, words: str) -> GenerationRequest:
    return GenerationRequest(rid, ChatPrompt(({"role": "user", "content": words},)), TOKENS)


@pytest.fixture(scope="module", params=QWEN_FAMILIES)
def qwen(request):
    return tiny_vlm_dir(request.param)


@pytest.fixture(scope="module")
def loaded(qwen):
    return load_model(ModelSettings(path=str(qwen)), optimized_blas=False, generation=0)


def mlx_vlm_answer(loaded, request: GenerationRequest, tokens: int = TOKENS) -> list[int]:
    """mlx-vlm's own generate_step on the processor's ids and inputs, greedy."""
    from mlx_vlm.generate.ar import generate_step

    ids, images = tokenize_with_images(loaded, request)
    assert images is not None
    real = mx.array([[images.placeholder if t >= VIRTUAL_BASE else t for t in ids]])
    inputs = {k: mx.array(v) for k, v in images.inputs.items()}
    pixels = inputs.pop("pixel_values")
    steps = generate_step(
        real,
        loaded.model.vlm,
        pixels,
        mx.ones(real.shape),
        max_tokens=tokens,
        temperature=0.0,
        **inputs,
    )
    return [int(t) for t, _ in steps]


def test_the_position_cache_gives_mlx_vlms_positions_chunk_by_chunk_and_after_a_trim(loaded):
    from mlx_lm.models.cache import KVCache

    model = loaded.model
    ids, images = tokenize_with_images(loaded, ask("p", RED, BLUE))
    assert images is not None and images.places is not None and len(images.spans) == 2
    real = mx.array([[images.placeholder if t >= VIRTUAL_BASE else t for t in ids]])
    grid = mx.array(images.inputs["image_grid_thw"])
    expected, delta = model.language_model.get_rope_index(real, grid)
    assert int(delta.item()) < 0  # the images' positions run behind their token count
    model.register(images, ids)
    cache = KVCache()
    chunks = [model._positions(mx.array([ids[i : i + 5]]), cache) for i in range(0, len(ids), 5)]
    got = mx.concatenate(chunks, axis=-1)
    assert np.array_equal(np.asarray(got), np.asarray(expected))
    # Cut back into the second image and prefill again: the same positions.
    cut = ids.index(images.ids[images.spans[0] + 3])
    cache.trim(len(ids) - cut)
    again = model._positions(mx.array([ids[cut:]]), cache)
    assert np.array_equal(np.asarray(again), np.asarray(expected)[..., cut:])
    # The next token continues at the token count plus the rope delta.
    nxt = model._positions(mx.array([[5]]), cache)
    assert np.asarray(nxt).ravel().tolist() == [len(ids) + int(delta.item())] * 3
    model.release(images)
    # How many tokens an image of a size becomes, without its pixels: the processor's count.
    from PIL import Image

    from mlxd.engine.chat.mrope_layout import image_tokens

    processor = loaded.vision.processor
    for size in ((56, 112), (1000, 333), (3, 40), (640, 480)):
        out = processor(text=["<|image_pad|>"], images=[Image.new("RGB", size)])
        assert image_tokens(processor, *size) == np.asarray(out["input_ids"]).size, size


def test_image_rows_of_several_sizes_batched_with_text_give_mlx_vlms_answers(qwen, loaded):
    requests = [
        ask("red", RED),
        text("t", "hello there"),
        ask("blue", BLUE),
        ask("two", RED, TALL),
        two_turns("turns", RED, TALL),
    ]
    expected = {r.id: mlx_vlm_answer(loaded, r) for r in requests if r.id != "t"}
    with running_engine(qwen, batch={"size": 5}, prompt_cache={"max_entries": 0}) as engine:
        (alone,) = run_all(engine, [text("t0", "hello there")])
        together = run_all(engine, requests)
    out = {r.id: o for r, o in zip(requests, together, strict=True)}
    assert all(o.ok for o in together), [o.end for o in together]
    assert {o.accepted.lane for o in together} == {"batch"}  # type: ignore[union-attr]
    for rid, tokens in expected.items():
        assert out[rid].tokens == tokens, rid
    assert out["t"].tokens == alone.tokens
    assert expected["red"] != expected["blue"]
    # The image tokens count in the prompt: 4 for the 56x56 image, 8 for the 112x56 one.
    usage = {rid: o.end.usage.prompt_tokens for rid, o in out.items()}  # type: ignore[union-attr]
    assert usage["blue"] - usage["red"] == 4
    assert usage["red"] == len(tokenize_with_images(loaded, requests[0])[0])
    # An image the processor cannot take (aspect ratio past 200) is refused from its
    # header, before it reaches the engine ([limits] image_aspect_ratio, issue 34).
    from mlxd.engine.images import ImageError

    with pytest.raises(ImageError, match="image_aspect_ratio"):
        ask("thin", png((1, 2, 3), (402, 2)))


def second_turn(first_answer: str, image: bytes, rid: str) -> GenerationRequest:
    content = [{"type": "text", "text": QUESTION}, {"type": "image", "image": 0}]
    messages = (
        {"role": "user", "content": content},
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "and its colour?"},
    )
    prompt = ChatPrompt(messages, images=(part(image),))
    return GenerationRequest(rid, prompt, TOKENS, sampling=SamplingParams(temperature=0.0))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5"])  # KV caches; a hybrid's checkpoints
def test_a_cached_second_turn_answers_as_mlx_vlm_also_after_a_restart(family, tmp_path):
    qwen = tiny_vlm_dir(family)
    cache = {"disk_dir": str(tmp_path / "cache"), "max_entries": 8}
    with running_engine(qwen, prompt_cache=cache) as engine:
        (first,) = run_all(engine, [ask("one", BLUE)])
        (ram,) = run_all(engine, [second_turn(first.text, BLUE, "ram")])
    with running_engine(qwen, prompt_cache=cache) as engine:
        (disk,) = run_all(engine, [second_turn(first.text, BLUE, "disk")])
    loaded = load_model(ModelSettings(path=str(qwen)), optimized_blas=False, generation=0)
    cold = mlx_vlm_answer(loaded, second_turn(first.text, BLUE, "cold"))
    for hit, source in ((ram, "ram"), (disk, "disk")):
        assert isinstance(hit.end, Finished) and hit.end.lookup is not None
        assert hit.end.lookup.source == source
        assert hit.end.usage.cached_tokens >= first.end.usage.prompt_tokens - 1  # type: ignore[union-attr]
        assert hit.tokens == cold, source


def test_a_preempted_image_row_resumes_with_its_own_positions():
    # Only rows whose caches can be cut back yield (docs/batching.md): not Qwen3.5's.
    qwen = tiny_vlm_dir("qwen2_vl")
    low = replace(ask("low", BLUE, tokens=160), priority="low")
    high = replace(text("high", "hello"), priority="high")

    async def main(engine) -> list[int]:
        handle = engine.submit(low)
        await handle.accepted()
        tokens: list[int] = []
        urgent = None
        async for event in handle.events():
            if isinstance(event, Delta):
                tokens.extend(event.token_ids)
                if urgent is None and len(tokens) >= 4:  # decoding: the urgent one arrives
                    urgent = asyncio.ensure_future(consume(engine, high))
        assert urgent is not None and (await urgent).ok
        return tokens

    sections = {"batch": {"size": 1}, "scheduling": {"preempt": True}}
    with running_engine(qwen, prompt_cache={"max_entries": 0}, **sections) as engine:
        (alone,) = run_all(engine, [replace(low, id="alone")])
        tokens = asyncio.run(main(engine))
        preemptions = settled(engine).counters["preemptions"]
    assert preemptions == 1
    assert tokens == alone.tokens


def test_a_failing_vision_tower_fails_its_own_row_only(monkeypatch):
    from mlxd.engine.chat.vision import VisionLM

    qwen = tiny_vlm_dir("qwen2_vl")
    loaded = load_model(ModelSettings(path=str(qwen)), optimized_blas=False, generation=0)
    _, bad = tokenize_with_images(loaded, ask("b", BLUE))
    assert bad is not None
    encode = VisionLM._encode

    def failing(self, images, part):
        if images.key == bad.key:
            raise RuntimeError("the vision tower failed")
        return encode(self, images, part)

    with running_engine(qwen, batch={"size": 4}, prompt_cache={"max_entries": 0}) as engine:
        alone = run_all(engine, [ask("red", RED), text("t", "hello there")])
        monkeypatch.setattr(VisionLM, "_encode", failing)
        red, blue, words = run_all(
            engine, [ask("r2", RED), ask("b2", BLUE), text("t2", "hello there")]
        )
    assert isinstance(blue.end, Failed) and "vision tower failed" in blue.end.message
    assert red.ok and words.ok
    assert [red.tokens, words.tokens] == [o.tokens for o in alone]
