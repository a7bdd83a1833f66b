"""An image crosses the worker wire as its size, digest and file (base64), never its
pixels, in order; a malformed one (a size that is not positive, no file, bytes that are
not base64, the pixels themselves) is refused as a bad request naming the field. The
receiver's decoding and its digest check are the gateway's (tests/gateway/
test_images_workers.py)."""

from __future__ import annotations

import json

import pytest

from engine_api.errors import BadRequestError
from engine_api.images import ImageInput, image_digest, image_input
from engine_api.records import GenChunk, GenRequest, Usage
from engine_api.sampling import SamplingParams


def over_json(record):
    return type(record).from_dict(json.loads(json.dumps(record.to_dict())))


def test_a_request_with_images_crosses_json_as_their_files_in_order():
    a = image_input(2, 1, bytes(range(6)), b"file a")
    b = image_input(1, 2, bytes(range(6)), b"file b")
    req = GenRequest("r", "m", [1, 2, 3], SamplingParams(), images=[a, b])
    wire = req.to_dict()
    assert [sorted(i) for i in wire["images"]] == [["data", "digest", "height", "width"]] * 2
    back = over_json(req)
    assert back.prompt_token_ids == req.prompt_token_ids and back.sampling == req.sampling
    sent = [(i.digest, i.width, i.height, i.data, i.rgb) for i in back.images]
    assert sent == [(a.digest, 2, 1, b"file a", b""), (b.digest, 1, 2, b"file b", b"")]
    assert a.digest != b.digest  # same bytes, another shape: another picture
    with pytest.raises(ValueError, match="crosses the wire as its file"):
        image_input(2, 1, bytes(6)).to_dict()  # pixels alone never cross


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
        ({"data": "not base64!"}, "data must be a base64 string"),
        ({"data": 7}, "data must be a base64 string"),
        ({"data": ""}, "must carry its file"),
        ({"width": 0}, "positive"),
        ({"rgb": "AAAAAAAA"}, "unknown WireImage field"),
        ({"extra": 1}, "unknown WireImage field"),
    ],
)
def test_a_malformed_image_is_a_bad_request(change, named):
    image = image_input(2, 1, bytes(6), b"a file")
    wire = GenRequest("r", "m", [1], SamplingParams(), images=[image])
    data = wire.to_dict()
    data["images"][0].update(change)
    with pytest.raises(BadRequestError, match=named):
        GenRequest.from_dict(json.loads(json.dumps(data)))


def test_an_image_is_never_printed_whole():
    image = image_input(100, 100, bytes(30_000))
    assert len(repr(image)) < 60
    assert isinstance(image, ImageInput)
