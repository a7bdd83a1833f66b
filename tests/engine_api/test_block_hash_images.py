"""Block hashes with images' keys: a block holding an image's placeholder tokens hashes the
image's digest (the same image a hit, another image of the same size never), the salt
still apart; blocks without placeholders hash as they always did; placeholders pair
with images in order or the prompt is refused."""

from __future__ import annotations

import pytest

from engine_api.block_hash import hash_blocks, image_key_spans
from engine_api.errors import BadRequestError

PAD = 9
BS = 4
# 6 text tokens, an image of 5 placeholders at [6, 11), 5 text tokens: blocks 0..3
TOKENS = [1, 2, 3, 4, 5, 6, PAD, PAD, PAD, PAD, PAD, 7, 8, 1, 2, 3]


def hashes(digests: list[str], salt: str | None = "t") -> list[bytes]:
    return hash_blocks(TOKENS, BS, salt, extra_keys=image_key_spans(TOKENS, PAD, digests))


def test_the_image_keys_the_blocks_that_hold_it_and_all_after():
    plain = hash_blocks(TOKENS, BS, "t")
    a, a_again, b = hashes(["aa"]), hashes(["aa"]), hashes(["bb"])
    assert a == a_again
    assert a[0] == b[0] == plain[0]  # before the image: as without images
    assert a[1] != b[1] and a[2] != b[2] and a[3] != b[3]  # block 1 holds tokens 6, 7
    assert a[1] != plain[1]


def test_the_salt_still_separates_tenants():
    assert not set(hashes(["aa"], "t")) & set(hashes(["aa"], "u"))


def test_placeholders_pair_with_images_in_order():
    two = [1, PAD, PAD, 2, PAD, 3]
    spans = image_key_spans(two, PAD, ["x", "y"])
    assert spans == [(1, 3, b"image:x"), (4, 5, b"image:y")]
    assert hash_blocks(two, 2, None, extra_keys=spans) != hash_blocks(
        two, 2, None, extra_keys=image_key_spans(two, PAD, ["y", "x"])
    )
    with pytest.raises(BadRequestError, match="2 image placeholders for 1 images"):
        image_key_spans(two, PAD, ["x"])
    assert image_key_spans([1, 2], PAD, []) == []
