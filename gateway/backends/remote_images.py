"""A chat's images crossing to a kvgate worker's /tokenize and /generate, and the body
limit they need.

The gateway decodes every image itself (gateway/serving/images.py) and keeps the file the
client sent; a worker is sent that file (engine_api.images.ImageInput's wire form: size,
digest and the file in base64), never a URL. A chat sent to a worker's /tokenize keeps
OpenAI's message shape, so each image part goes as an `image_url` part whose URL is
IMAGE_REF, standing for the next of the body's `images`. The worker decodes each file as
the gateway did and checks its pixels against the size and digest sent
(gateway.serving.images.received), so no cache key it did not compute is trusted, then
puts each back in its place (`placed`). GenRequest.images crosses to /kvgate/v1/generate
the same way, as the record's field.

A worker's body limit (gateway.worker.app.worker_body_bytes) is its max_body_bytes plus
room for max_images_per_request files of max_image_bytes, in base64, and
IMAGE_RECORD_BYTES each: derived from the settings (the gateway passes its own to the
workers it starts), so bodies stay bounded.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from engine_api.errors import BadRequestError
from engine_api.images import ImageInput
from engine_api.records import GenRequest, PromptInput

IMAGE_REF = "kvgate:image"  # an image part's URL on the wire: the next of `images`
IMAGE_RECORD_BYTES = 512  # an image record's JSON besides its file (digest, size, keys)


def outgoing(prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageInput]]:
    """The chat with each {"type": "image", "image": ImageInput} part as an image_url
    part of IMAGE_REF (copies: the caller's messages are left as they were), and the
    images in order."""
    messages, images = [], []
    for m in prompt:
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.get("type") == "image":
                    images.append(p["image"])
                    p = {"type": "image_url", "image_url": {"url": IMAGE_REF}}
                parts.append(p)
            m = {**m, "content": parts}
        messages.append(m)
    return messages, images


async def json_body(body: dict[str, Any], images: list[ImageInput]) -> dict[str, Any] | bytes:
    """`body` with the images as its `images` field, encoded off the event loop (each
    file is up to megabytes of base64); `body` itself where there are none."""
    if not images:
        return body

    def encode() -> bytes:
        return json.dumps(body | {"images": [im.to_dict() for im in images]}).encode()

    return await asyncio.to_thread(encode)


async def request_body(req: GenRequest) -> dict[str, Any] | bytes:
    """A GenRequest as the body of a worker's /generate or /kv/export: with images,
    JSON bytes encoded off the event loop."""
    if not req.images:
        return req.to_dict()
    return await asyncio.to_thread(lambda: json.dumps(req.to_dict()).encode())


def placed(prompt: PromptInput, images: list[ImageInput]) -> PromptInput:
    """A worker's side: each {"type": "image", "url": IMAGE_REF} part of the rendered
    chat as the next of `images` (received and checked); BadRequestError for any other
    image URL (a worker fetches nothing) or a count that does not pair."""
    if not isinstance(prompt, list):
        if images:
            raise BadRequestError("images come with chat messages only")
        return prompt
    pending = iter(images)
    used = 0
    out = []
    for m in prompt:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.get("type") == "image":
                    if p.get("url") != IMAGE_REF or used == len(images):
                        raise BadRequestError(
                            f"a worker takes images in the body's `images`, each part's "
                            f"url {IMAGE_REF!r} ({len(images)} sent)"
                        )
                    p = {"type": "image", "image": next(pending)}
                    used += 1
                parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    if used != len(images):
        raise BadRequestError(f"{len(images)} images sent for {used} image parts")
    return out
