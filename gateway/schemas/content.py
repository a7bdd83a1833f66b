"""Chat message content parts at the HTTP boundary: text and images, in OpenAI's shape.

OpenAI's `image_url` part is the one form every API's images are translated into
(Anthropic's image blocks, the Responses API's `input_image`, Ollama's `images`), so the
rules live here once: an image is a URL, a `data:` URL carrying it inline or an
`http(s)` one the gateway fetches only from the hosts its admin allows
(gateway/serving/images.py decodes and bounds both). `detail` is accepted and changes
nothing: the model's own image processor decides the resolution.

`message_content` is what a backend's `render` is handed: the text as one string when a
message has no image (as before images), else the parts in order, each image as
{"type": "image", "url": ...} until the gateway replaces it with its decoded
{"type": "image", "image": ImageInput}.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from gateway.schemas.base import Refused
from gateway.schemas.base import StrictBody as _Body

PARTS = ("text", "image_url")


class ImageUrl(_Body):
    url: Annotated[str, Field(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(_Body):
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageUrl | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data: Any) -> Any:
        """A part kvgate does not take is named by its type (before its other fields are
        refused as unknown); `"image_url": "data:..."` (vLLM takes the URL alone too) is
        `{"url": ...}`."""
        if not isinstance(data, dict):
            return data  # not an object: pydantic says so
        kind = data.get("type")
        if isinstance(kind, str) and kind not in PARTS:
            raise Refused(
                f"content parts of type {kind[:100]!r} are not supported; "
                f"kvgate takes {', '.join(PARTS)}",
                "type",
            )
        if isinstance(data.get("image_url"), str):
            return data | {"image_url": {"url": data["image_url"]}}
        return data

    @model_validator(mode="after")
    def _check(self) -> ContentPart:
        mine, other = ("text", "image_url") if self.type == "text" else ("image_url", "text")
        if getattr(self, other) is not None:
            raise Refused(f"a {self.type} part has no {other}", other)
        if getattr(self, mine) is None:
            raise Refused(f"a {self.type} part needs {mine}", mine)
        return self


def image_part(url: str) -> dict[str, Any]:
    """An image as the OpenAI part another API's translation writes."""
    return {"type": "image_url", "image_url": {"url": url}}


def has_image(content: str | list[ContentPart] | None) -> bool:
    return isinstance(content, list) and any(p.type == "image_url" for p in content)


def message_content(content: str | list[ContentPart] | None) -> str | list[dict[str, Any]]:
    """The content a backend's render takes: text as one string; with images, the parts
    in order ({"type": "text", "text"} and {"type": "image", "url"})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not has_image(content):
        return "".join(p.text or "" for p in content)
    return [
        {"type": "text", "text": p.text}
        if p.type == "text"
        else {"type": "image", "url": p.image_url.url}  # type: ignore[union-attr]
        for p in content
    ]
