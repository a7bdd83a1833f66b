"""An image as an engine takes it: decoded pixels and the digest that names what they show.

The gateway decodes whatever the client sent (PNG, JPEG, a data URL, an allowed remote
URL) into row-major RGB8 pixels; the engine never sees a file format. The digest is a
sha256 over the size and the pixels, not the file's bytes, so the same picture sent as
PNG once and as a JPEG of identical pixels later is the same image to the prefix cache
and the encoder cache, and two pictures that differ in any pixel never are.

`ImageInput` also keeps the file the client sent (`data`: PNG, JPEG, ... as received),
and that is what crosses the worker wire (base64), not the pixels: a file is several
times smaller than its RGB, so a worker's body limit follows `max_image_bytes`. An image
read from the wire (`from_dict`) has its size, digest and file but no pixels yet; its
receiver decodes the file as the gateway did and checks that the pixels are the size and
the digest the sender claimed (gateway.serving.images.received), so a worker never trusts
a cache key it did not compute.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Any, Self

from engine_api.errors import BadRequestError
from engine_api.wire import Record, decode_fields


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
    # row-major RGB8: exactly width * height * 3 bytes (b"" in an image read from the
    # wire until its receiver decodes `data`)
    rgb: bytes
    # the file the client sent (PNG, JPEG, ...), as it crosses the worker wire; b"" for
    # an image made from pixels alone, which does not cross it
    data: bytes = b""

    wire_error = BadRequestError

    def to_dict(self) -> dict[str, Any]:
        """The wire form: the size, the digest and the file, not the pixels."""
        if not self.data:
            raise ValueError("an image crosses the wire as its file, and this one has none")
        wire = {"digest": self.digest, "width": self.width, "height": self.height}
        return wire | {"data": base64.b64encode(self.data).decode("ascii")}

    @classmethod
    def from_dict(cls, data: Any) -> Self:
        """The image `to_dict` gave, without pixels until its receiver decodes its file;
        its fields' types, a positive size and a file checked here."""
        wire = decode_fields(WireImage, data, BadRequestError)
        if wire["width"] <= 0 or wire["height"] <= 0:
            raise BadRequestError(
                f"image size must be positive, got {wire['width']}x{wire['height']}"
            )
        if not wire["data"]:
            raise BadRequestError("an image on the wire must carry its file (data)")
        return cls(wire["digest"], wire["width"], wire["height"], b"", wire["data"])

    def __repr__(self) -> str:  # never a megabyte of pixels in a log line
        return f"ImageInput({self.width}x{self.height}, {self.digest[:12]})"


@dataclass
class WireImage:
    """ImageInput's fields on the wire (decode_fields reads its type hints)."""

    digest: str
    width: int
    height: int
    data: bytes


def _check_size(width: int, height: int, rgb: bytes) -> None:
    if width <= 0 or height <= 0:
        raise BadRequestError(f"image size must be positive, got {width}x{height}")
    if len(rgb) != width * height * 3:
        raise BadRequestError(f"image pixels must be {width}x{height}x3 bytes, got {len(rgb)}")


def image_input(width: int, height: int, rgb: bytes, data: bytes = b"") -> ImageInput:
    """The image of these pixels (decoded from the file `data`, if given) with its digest
    computed (BadRequestError if they do not fill the size)."""
    rgb = bytes(rgb)
    _check_size(width, height, rgb)
    return ImageInput(image_digest(width, height, rgb), width, height, rgb, data)
