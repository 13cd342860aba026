"""Virtual token ids for image tokens: derived from the pixels, per image where runs allow."""

from __future__ import annotations

import numpy as np

from mlxd.engine.chat.vision_intake import VIRTUAL_BASE, _digests, _id_hash, decode_text


def ids_for(inputs, positions, count):
    return [VIRTUAL_BASE + _id_hash(d, i) for d, i in _digests(inputs, positions, count)]


def test_each_image_of_a_request_keys_its_own_tokens():
    red, blue = np.zeros((3, 4, 4), np.float32), np.ones((3, 4, 4), np.float32)
    # Two images, one run of 2 tokens each.
    both = ids_for({"pixel_values": np.stack([red, blue])}, [3, 4, 8, 9], 2)
    red_only = ids_for({"pixel_values": np.stack([red])}, [3, 4], 1)
    blue_first = ids_for({"pixel_values": np.stack([blue, red])}, [3, 4, 8, 9], 2)
    assert both[:2] == red_only  # the first image's tokens do not depend on the second
    assert blue_first[:2] == both[2:] and blue_first[2:] == both[:2]
    assert len(set(both)) == 4 and all(VIRTUAL_BASE <= t < 2 * VIRTUAL_BASE for t in both)


def test_tiled_images_share_one_key_and_still_never_match_other_pixels():
    # Idefics3-style: one image in several runs (tiles): one hash over all inputs.
    tiles = np.arange(2 * 3 * 4 * 4, dtype=np.float32).reshape(1, 2, 3, 4, 4)
    runs = [1, 2, 5, 6, 9, 10]
    first = ids_for({"pixel_values": tiles}, runs, 1)
    again = ids_for({"pixel_values": tiles.copy()}, runs, 1)
    other = ids_for({"pixel_values": tiles + 1}, runs, 1)
    assert first == again and not set(first) & set(other)


def test_extra_processor_inputs_count_in_the_key():
    pixels = np.zeros((1, 3, 4, 4), np.float32)
    plain = ids_for({"pixel_values": pixels}, [0, 1], 1)
    sized = ids_for({"pixel_values": pixels, "image_sizes": np.array([[4, 4]])}, [0, 1], 1)
    assert plain != sized


class Tokenizer:
    def decode(self, ids):
        return "".join(chr(96 + i) for i in ids)


def test_image_tokens_read_as_one_marker_per_image():
    v = VIRTUAL_BASE + 5
    assert decode_text(Tokenizer(), [1, 2, v, v + 1, 3, v]) == "ab[image]c[image]"
