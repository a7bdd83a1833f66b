"""An image crosses the worker wire as the same record (its pixels as base64), and a
malformed one (pixels that do not fill its size, a digest that is not theirs, bytes that
are not base64) is refused as a bad request naming the field."""

from __future__ import annotations

import json

import pytest

from engine_api.errors import BadRequestError
from engine_api.images import ImageInput, image_digest, image_input
from engine_api.records import GenChunk, GenRequest, Usage
from engine_api.sampling import SamplingParams


def over_json(record):
    return type(record).from_dict(json.loads(json.dumps(record.to_dict())))


def test_a_request_with_images_crosses_json_unchanged_in_order():
    a = image_input(2, 1, bytes(range(6)))
    b = image_input(1, 2, bytes(range(6)))
    req = GenRequest("r", "m", [1, 2, 3], SamplingParams(), images=[a, b])
    back = over_json(req)
    assert back == req
    assert [i.digest for i in back.images] == [a.digest, b.digest]
    assert a.digest != b.digest  # same bytes, another shape: another picture


def test_the_digest_covers_size_and_pixels():
    px = bytes(12)
    assert image_digest(2, 2, px) == image_input(2, 2, px).digest
    assert image_digest(2, 2, px) != image_digest(4, 1, px)
    assert image_digest(2, 2, px) != image_digest(2, 2, bytes(11) + b"\x01")


def test_usage_carries_image_tokens():
    chunk = GenChunk([1], "x", "stop", Usage(10, 1, image_tokens=4))
    assert over_json(chunk).usage.image_tokens == 4


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"rgb": "not base64!"}, "rgb must be a base64 string"),
        ({"rgb": 7}, "rgb must be a base64 string"),
        ({"width": 3}, "3x1x3 bytes"),
        ({"width": 0}, "positive"),
        ({"digest": "0" * 64}, "digest does not match"),
        ({"extra": 1}, "unknown ImageInput field"),
    ],
)
def test_a_malformed_image_is_a_bad_request(change, named):
    wire = GenRequest("r", "m", [1], SamplingParams(), images=[image_input(2, 1, bytes(6))])
    data = wire.to_dict()
    data["images"][0].update(change)
    with pytest.raises(BadRequestError, match=named):
        GenRequest.from_dict(json.loads(json.dumps(data)))


def test_an_image_is_never_printed_whole():
    image = image_input(100, 100, bytes(30_000))
    assert len(repr(image)) < 60
    assert isinstance(image, ImageInput)
