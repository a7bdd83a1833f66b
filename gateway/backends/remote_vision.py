"""Images to a third-party upstream whose model takes them (vLLM or SGLang serving a
vision model; the entry's `options.vision`): the chat goes to its /v1/chat/completions,
each image an OpenAI `image_url` part holding a data URL, as LiteLLM and the `openai`
client send them to vLLM.

The gateway has decoded and bounded every image already (gateway/serving/images.py) and
kept the client's file. A PNG, JPEG or WebP goes as it came, unless its EXIF turns it
(the gateway decoded it upright; vLLM's loader would not turn it). Any other (a GIF, of
which the gateway took the first frame; a BMP; a turned photo; an image made from
pixels) goes as a PNG of the pixels the gateway decoded, bounded by max_image_pixels as
they are.

Before admission the chat is a text-bound prompt (remote_text.image_chat_bound) whose
image parts are references by digest, so the prefix router tells two pictures apart, and
whose length reserves options.image_tokens per image; the data URLs take their places
when the request is sent, off the event loop. The upstream's usage (its prompt_tokens
count its images) is taken within that bound, as for any text-bound prompt.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from typing import Any

import aiohttp
from PIL import Image

from engine_api.errors import BadRequestError
from engine_api.images import ImageInput
from engine_api.records import GenRequest, PromptInput
from gateway.backends.remote_http import UpstreamClient
from gateway.backends.remote_images import IMAGE_REF
from gateway.backends.remote_openai import completion_body
from gateway.backends.remote_text import carried, chat_body, image_chat_bound

REFERENCE = IMAGE_REF + "#"  # an image part's URL before it is sent: REFERENCE + its digest
AS_SENT = ("PNG", "JPEG", "WEBP")  # files that go as they came
EXIF_ORIENTATION = 0x0112


def image_chat(
    prompt: PromptInput, tools: list[dict] | None, kwargs: dict | None, image_tokens: int
) -> list[int]:
    """The text-bound prompt of a chat with images (each part a reference by digest),
    with `image_tokens` slots per image."""
    messages, count = [], 0
    for m in prompt:
        content = m.get("content")  # type: ignore[union-attr]
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.get("type") == "image":
                    count += 1
                    p = {"type": "image_url", "image_url": {"url": REFERENCE + p["image"].digest}}
                parts.append(p)
            m = {**m, "content": parts}  # type: ignore[dict-item]
        messages.append(m)
    return image_chat_bound(messages, tools, kwargs, count * image_tokens)  # type: ignore[arg-type]


async def open_image_chat(
    client: UpstreamClient, req: GenRequest, model: str
) -> aiohttp.ClientResponse:
    """The 200 response of the streamed /chat/completions request of an image chat."""
    messages, kwargs = carried(req.prompt_token_ids)
    body = chat_body(completion_body(req, model, ""), messages, kwargs)  # type: ignore[arg-type]
    data = await asyncio.to_thread(_with_images, body, req.images)  # megabytes of base64
    return await client.post_ok(client.endpoint.base + "/chat/completions", data)


def _with_images(body: dict[str, Any], images: list[ImageInput]) -> bytes:
    """The body as JSON, each image reference its image's data URL, in order; a
    BadRequestError where the references and the images do not pair."""
    pending = iter(images)
    for m in body["messages"]:
        for part in m["content"] if isinstance(m.get("content"), list) else []:
            url = part.get("image_url", {}).get("url") if part.get("type") == "image_url" else None
            if isinstance(url, str) and url.startswith(REFERENCE):
                image = next(pending, None)
                if image is None or url != REFERENCE + image.digest:
                    raise BadRequestError("the prompt's images do not pair with the request's")
                part["image_url"] = {"url": data_url(image)}
    if next(pending, None) is not None:
        raise BadRequestError("the request has more images than its prompt shows")
    return json.dumps(body, ensure_ascii=False).encode()


def data_url(image: ImageInput) -> str:
    """The image as a data URL: the client's file where the upstream reads it as the
    gateway did, else a PNG of the gateway's pixels."""
    kind = _as_sent(image.data)
    data = image.data
    if kind is None:
        kind, data = "png", _png(image)
    return f"data:image/{kind};base64," + base64.b64encode(data).decode("ascii")


def _as_sent(data: bytes) -> str | None:
    """The file's format where it may go as it is (from its header), else None."""
    if not data:
        return None
    try:
        with Image.open(io.BytesIO(data), formats=AS_SENT) as image:
            if image.getexif().get(EXIF_ORIENTATION, 1) != 1:
                return None
            return str(image.format).lower()
    except Exception:  # decoded by the gateway already: read again as a PNG of its pixels
        return None


def _png(image: ImageInput) -> bytes:
    out = io.BytesIO()
    Image.frombytes("RGB", (image.width, image.height), image.rgb).save(out, "PNG")
    return out.getvalue()
