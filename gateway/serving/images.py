"""Images in chat requests: from what a client sent to the pixels an engine takes.

Every API's images arrive as {"type": "image", "url": ...} parts of the chat messages
(gateway.schemas.content). Before anything is rendered, `chat_images` refuses them for a
model whose card does not say `vision` (a clear 400, before any byte is decoded or
fetched), counts them against `max_images_per_request`, reads each one (a base64 `data:`
URL, or an http(s) URL from an allowed host: gateway.serving.image_fetch) within
`max_image_bytes`, checks its size from its header against `max_image_pixels` before
decoding it, and decodes it off the event loop to RGB pixels (engine_api.ImageInput,
named by the digest of its pixels). Each refusal is a 400 that names the limit or says
what was wrong; nothing is decoded that was not bounded first.

The parts come back as {"type": "image", "image": ImageInput}, in a copy of the messages
(a body's own dicts are left as they were), with the images in prompt order:
GenRequest.images. Each keeps the file it was decoded from: a kvgate worker is sent the
file, and `received` is the worker's side, which decodes it the same way, within the
worker's own limits, and refuses pixels that are not the size and digest sent.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageOps

from engine_api.images import ImageInput, image_input
from engine_api.records import ModelCard, PromptInput
from gateway.config import Settings
from gateway.http.errors import ApiError
from gateway.serving.image_fetch import FetchRefused, fetch_image

# what Pillow may read: the formats clients send, none of its rarer (and riskier) plugins
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int
    max_images: int
    allowed_hosts: frozenset[str]
    fetch_timeout_s: float

    @classmethod
    def of(cls, settings: Settings) -> ImageLimits:
        return cls(
            settings.max_image_bytes,
            settings.max_image_pixels,
            settings.max_images_per_request,
            frozenset(settings.allowed_image_hosts),
            settings.image_fetch_timeout_s,
        )


def _image_parts(prompt: PromptInput) -> list[dict[str, Any]]:
    if not isinstance(prompt, list):
        return []
    return [
        part
        for m in prompt
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for part in m["content"]
        if part.get("type") == "image"
    ]


async def chat_images(
    limits: ImageLimits,
    card: ModelCard,
    messages: PromptInput,
    serving: Mapping[str, Sequence[object]] | None = None,
) -> tuple[PromptInput, list[ImageInput]]:
    """`messages` with each image decoded, and the images in order; the messages as
    they are where they hold none. An ApiError (400) for a model without vision (naming
    the entry that could take them, of its replicas in `serving`: a remote upstream's),
    too many images, or an image that is too large, not fetched or does not decode."""
    parts = _image_parts(messages)
    if not parts:
        return messages, []
    if not card.vision:
        whys = (getattr(b, "image_refusal", None) for b in (serving or {}).get(card.id, ()))
        why = next((f": {w}" for w in whys if w), "")
        raise ApiError(400, f"The model `{card.id}` does not take images{why}.", param="messages")
    if len(parts) > limits.max_images:
        raise ApiError(
            400,
            f"The request has {len(parts)} images; at most {limits.max_images} are taken "
            "(max_images_per_request).",
            param="messages",
        )
    images = await _all_images(limits, [p["url"] for p in parts])
    decoded = iter(images)
    out = []
    for m in messages:
        content = m.get("content")  # type: ignore[union-attr]
        if isinstance(content, list):
            content = [
                {"type": "image", "image": next(decoded)} if p.get("type") == "image" else p
                for p in content
            ]
        out.append({**m, "content": content})  # type: ignore[dict-item]
    return out, images


async def _all_images(limits: ImageLimits, urls: list[str]) -> list[ImageInput]:
    """Every image read and decoded at once (Pillow's decoders let go of the GIL); the
    first refusal is the answer, and the fetches still running are cancelled."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_image(limits, u, i + 1)) for i, u in enumerate(urls)]
    except* ApiError as failed:
        raise failed.exceptions[0] from None
    return [t.result() for t in tasks]


async def _image(limits: ImageLimits, url: str, number: int) -> ImageInput:
    """One image, read and decoded off the event loop (a data: URL's base64 too: 10 MB
    of it would hold every other request for tens of milliseconds)."""
    if url.startswith("data:"):
        return await asyncio.to_thread(_inline, url, limits, number)
    try:
        raw = await fetch_image(url, limits.allowed_hosts, limits.max_bytes, limits.fetch_timeout_s)
    except FetchRefused as e:
        raise ApiError(400, f"Image {number}: {e}", param="messages") from None
    return await asyncio.to_thread(decode_image, raw, limits.max_pixels, number)


def _inline(url: str, limits: ImageLimits, number: int) -> ImageInput:
    return decode_image(_data_url(url, limits.max_bytes, number), limits.max_pixels, number)


def _data_url(url: str, max_bytes: int, number: int) -> bytes:
    """The bytes of a base64 data: URL, bounded before they are decoded."""
    head, comma, data = url.partition(",")
    params = head.removeprefix("data:").split(";")
    if not comma or params[-1] != "base64":
        raise _bad(number, "a data: URL must be base64 (data:image/png;base64,...)")
    if params[0] and not params[0].startswith("image/"):
        raise _bad(number, f"a data: URL of {params[0][:60]!r} is not an image")
    if len(data) > (max_bytes + 2) // 3 * 4:
        raise _too_big(number, max_bytes)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(number, "its data is not valid base64") from None
    if len(raw) > max_bytes:
        raise _too_big(number, max_bytes)
    return raw


def decode_image(raw: bytes, max_pixels: int, number: int = 1) -> ImageInput:
    """`raw` (PNG, JPEG, GIF's first frame, WebP, BMP) as RGB pixels, turned upright as
    its EXIF orientation says; its size is checked from its header before it is decoded."""
    try:
        with Image.open(io.BytesIO(raw), formats=FORMATS) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise ApiError(
                    400,
                    f"Image {number} is {width}x{height} pixels; at most {max_pixels} are "
                    "taken (max_image_pixels).",
                    param="messages",
                )
            rgb = ImageOps.exif_transpose(image).convert("RGB")
            return image_input(rgb.width, rgb.height, rgb.tobytes(), raw)
    except ApiError:
        raise
    except Exception:  # a client's bytes: whatever a decoder (or its EXIF) trips on is a 400
        raise _bad(number, "it does not decode as PNG, JPEG, GIF, WebP or BMP") from None


async def received(limits: ImageLimits, images: list[ImageInput]) -> list[ImageInput]:
    """A worker's side: the images of a request read from the wire (their files, no
    pixels: engine_api.images), each decoded off the event loop as the gateway decoded it,
    within this process's image limits, and refused (400) unless its pixels are the size
    and the digest it was sent with."""
    if len(images) > limits.max_images:
        raise ApiError(
            400,
            f"The request has {len(images)} images; at most {limits.max_images} are taken "
            "(max_images_per_request).",
            param="images",
        )
    return await asyncio.to_thread(
        lambda: [_check(limits, im, i + 1) for i, im in enumerate(images)]
    )


def _check(limits: ImageLimits, sent: ImageInput, number: int) -> ImageInput:
    if len(sent.data) > limits.max_bytes:
        raise _too_big(number, limits.max_bytes)
    image = decode_image(sent.data, limits.max_pixels, number)
    if (image.width, image.height) != (sent.width, sent.height):
        raise _bad(number, f"it is {image.width}x{image.height}, not {sent.width}x{sent.height}")
    if image.digest != sent.digest:
        raise _bad(number, "its digest does not match its pixels")
    return image


def _bad(number: int, why: str) -> ApiError:
    return ApiError(400, f"Image {number} could not be read: {why}.", param="messages")


def _too_big(number: int, max_bytes: int) -> ApiError:
    return ApiError(
        400, f"Image {number} is over {max_bytes} bytes (max_image_bytes).", param="messages"
    )
