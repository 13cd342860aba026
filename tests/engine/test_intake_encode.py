"""intake.encode takes the Rust backend's path: it must give the very ids of
the tokenizer's own encode and chat template, on the real tokenizers."""

from __future__ import annotations

import pytest

from mlxd.engine.chat.intake import encode

TEXTS = [
    "hello world",
    "<|im_start|>user\nhi<|im_end|>",  # special tokens written in the text
    "  leading spaces\n\ttabs  ",
    "émoji 🎉 中文",
    "1234567890" * 20,
    "",
]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_encode_equals_the_tokenizers_encode(tiny_loaded, family):
    _, tokenizer = tiny_loaded(family)
    hf = tokenizer._tokenizer
    for text in TEXTS:
        for special in (True, False):
            assert encode(tokenizer, text, special=special) == hf.encode(
                text, add_special_tokens=special
            ), (text, special)


def test_rendered_chat_encodes_like_apply_chat_template(tiny_loaded):
    _, tokenizer = tiny_loaded("llama")
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi 🎉"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "and now?"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert encode(tokenizer, text, special=False) == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True
    )
