"""Chat messages with images into a vision model's prompt (the gpu backend's render):
each image part becomes the model's placeholder run where the image stood among the
text: Qwen2.5-VL's <|vision_start|>, one <|image_pad|> per image token, <|vision_end|>;
Gemma 3's "\n\n<start_of_image>", its soft tokens, "<end_of_image>\n\n".

The chat template renders text: each image part is first written as the model's marker
text inside its message's text (the engine's ImageMarkers: Qwen's start, one pad, end;
Gemma's <start_of_image>, as its template writes an image), the template runs as for
any chat, the marker becomes what the model's processor makes it in the template's text
(Gemma's newlines and tokens around one pad), the tokenizer runs, and then the n-th pad
token is widened to the n-th image's token count (the processor's, from its width and
height). A pad or marker that the client wrote in its own text would pair with the
wrong image, so a count that does not match is a 400.
"""

from __future__ import annotations

from engine_api.errors import BadRequestError
from engine_api.images import ImageInput
from engine_api.records import Messages

VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
IMAGE_MARKER = VISION_START + IMAGE_PAD + VISION_END


def with_image_markers(
    messages: Messages, marker: str = IMAGE_MARKER
) -> tuple[Messages, list[ImageInput]]:
    """The messages with every content list joined into text (image parts as `marker`)
    and the images in prompt order."""
    images: list[ImageInput] = []
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        text = []
        for part in content:
            if part.get("type") == "image":
                images.append(part["image"])
                text.append(marker)
            elif part.get("type") == "text":
                text.append(part.get("text") or "")
            else:
                raise BadRequestError(f"message content part of type {part.get('type')!r}")
        out.append({**message, "content": "".join(text)})
    return out, images


def widen_placeholders(
    token_ids: list[int], pad_id: int, counts: list[int], marker: str = IMAGE_PAD
) -> list[int]:
    """Each pad token of `token_ids` as counts[n] of them, n-th for n-th; a 400 when the
    pads and the images do not pair up (`marker`: what the text must not contain)."""
    found = token_ids.count(pad_id)
    if found != len(counts):
        raise BadRequestError(
            f"the prompt has {found} image placeholders for {len(counts)} images "
            f"(its text must not contain {marker})"
        )
    out: list[int] = []
    images = iter(counts)
    for token in token_ids:
        out.extend([pad_id] * next(images) if token == pad_id else (token,))
    return out
