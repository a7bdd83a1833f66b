"""Images end to end on the real engine: a gateway serving the tiny Qwen2.5-VL on the gpu
backend (CPU here), the official `openai` and `anthropic` clients sending a drawn
picture as a PNG: the model card says vision, usage counts the image's placeholder
tokens as prompt tokens, the same picture again is a prefix-cache hit through its
placeholders (the same pixels as another file format too), and another picture of the
same size is not (the blocks are keyed by what the image shows).

(The APIs' shapes, limits and refusals on the fake backend: test_images.py.)"""

from __future__ import annotations

import base64
import io

import anthropic
import openai
import pytest

from backend_gpu.image_processing import Qwen2VLImageProcessor
from gateway.backends import BackendSpec
from tests.backend_gpu.tiny_qwen2_5_vl import save_tiny_qwen2_5_vl, scene

TEXT = "Describe the picture in a few words, please, as briefly as you can manage it."


def encoded(seed: int, kind: str = "PNG") -> str:
    out = io.BytesIO()
    scene(300, 200, seed).save(out, kind)
    return f"data:image/{kind.lower()};base64," + base64.b64encode(out.getvalue()).decode()


def ask(url: str) -> list[dict]:
    parts = [{"type": "text", "text": TEXT}, {"type": "image_url", "image_url": {"url": url}}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen2_5_vl(str(tmp_path_factory.mktemp("qwen2_5_vl")))


async def test_images_through_the_gateway_are_counted_and_cached_by_content(
    make_gateway, model_dir
):
    spec = BackendSpec("vl", "gpu", model_dir, "tiny-vl", {"seed": 1})
    gw = await make_gateway([spec])
    _, key = await gw.tenant()
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    assert [m.vision for m in (await client.models.list()).data] == [True]
    n = Qwen2VLImageProcessor.from_dir(model_dir).num_tokens(300, 200)

    async def usage(url: str):
        reply = await client.chat.completions.create(
            model="tiny-vl", messages=ask(url), max_tokens=2, temperature=0
        )
        return reply.usage

    first = await usage(encoded(1))
    assert first.prompt_tokens_details.image_tokens == n and first.prompt_tokens > n
    again = await usage(encoded(1, "BMP"))  # the same pixels in another file
    other = await usage(encoded(7))  # another picture, the same size
    assert again.prompt_tokens == other.prompt_tokens == first.prompt_tokens
    # the repeat hits every full block but the last; the other picture only the blocks
    # before its placeholders, whose tokens are the same ids as the first's
    assert again.prompt_tokens_details.cached_tokens >= first.prompt_tokens - 16
    assert other.prompt_tokens_details.cached_tokens < again.prompt_tokens_details.cached_tokens
    # Anthropic's client, the same picture: counted, cached, and its image_tokens said
    claude = anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)
    block = {"type": "base64", "media_type": "image/png", "data": encoded(1).split(",")[1]}
    content = [{"type": "text", "text": TEXT}, {"type": "image", "source": block}]
    reply = await claude.messages.create(
        model="tiny-vl", max_tokens=2, messages=[{"role": "user", "content": content}]
    )
    assert reply.usage.image_tokens == n and reply.usage.cache_read_input_tokens > n
