"""An image as an engine takes it: decoded pixels and the digest that names what they show.

The gateway decodes whatever the client sent (PNG, JPEG, a data URL, an allowed remote
URL) into row-major RGB8 pixels; the engine never sees a file format. The digest is a
sha256 over the size and the pixels, not the file's bytes, so the same picture sent as
PNG once and as a JPEG of identical pixels later is the same image to the prefix cache
and the encoder cache, and two pictures that differ in any pixel never are.

`ImageInput` crosses the worker wire as a Record (`rgb` as base64); `from_dict` checks
that the pixels fill the size exactly and that the digest is theirs, so a worker never
trusts a cache key it did not compute.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Self

from engine_api.errors import BadRequestError
from engine_api.wire import Record


def image_digest(width: int, height: int, rgb: bytes) -> str:
    """sha256 hex over the width and height (4 bytes each, big-endian) and the pixels."""
    h = hashlib.sha256()
    h.update(width.to_bytes(4, "big"))
    h.update(height.to_bytes(4, "big"))
    h.update(rgb)
    return h.hexdigest()


@dataclass
class ImageInput(Record):
    """One image of a request, in prompt order (`GenRequest.images`)."""

    digest: str
    width: int
    height: int
    rgb: bytes  # row-major RGB8: exactly width * height * 3 bytes

    wire_error = BadRequestError

    @classmethod
    def from_dict(cls, data: Any) -> Self:
        """The image `to_dict` gave, its size and digest checked against its pixels."""
        image = super().from_dict(data)
        check_image(image)
        return image

    def __repr__(self) -> str:  # never a megabyte of pixels in a log line
        return f"ImageInput({self.width}x{self.height}, {self.digest[:12]})"


def _check_size(width: int, height: int, rgb: bytes) -> None:
    if width <= 0 or height <= 0:
        raise BadRequestError(f"image size must be positive, got {width}x{height}")
    if len(rgb) != width * height * 3:
        raise BadRequestError(f"image pixels must be {width}x{height}x3 bytes, got {len(rgb)}")


def check_image(image: ImageInput) -> None:
    """Raise BadRequestError unless the pixels fill the size and the digest is theirs."""
    _check_size(image.width, image.height, image.rgb)
    if image.digest != image_digest(image.width, image.height, image.rgb):
        raise BadRequestError("image digest does not match its pixels")


def image_input(width: int, height: int, rgb: bytes) -> ImageInput:
    """The image of these pixels with its digest computed (BadRequestError if they do
    not fill the size)."""
    rgb = bytes(rgb)
    _check_size(width, height, rgb)
    return ImageInput(image_digest(width, height, rgb), width, height, rgb)
