"""Images in every API, through a real gateway on a real socket with the official
`openai`, `anthropic` and `ollama` clients as callers: each API's image form reaches the
backend as decoded pixels in prompt order, its placeholder tokens are prompt tokens
(usage says how many; a tenant's token quota sees them before admission), and a model
without vision, too many images, too large an image, one that does not decode and a
remote URL with no allowed hosts are each a 400 that says so.

The vision model here is the fake backend's `vision` test double: it counts an image's
placeholders (one per 32x32 tile) and never looks at its pixels, so these tests check
the APIs' shapes and the gateway's rules, not what a model sees (the engine's tests do).
"""

from __future__ import annotations

import base64
import io

import anthropic
import ollama
import openai
import pytest
from PIL import Image

from gateway.backends import BackendSpec
from tests.conftest import ADMIN_KEY
from tests.gateway.test_url_only_upstreams import BareUpstream

BACKENDS = [
    BackendSpec("vl", "fake", "", "fake-vl", {"vision": True}),
    BackendSpec("text", "fake", "", "fake-model", {}),
]
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TILES = 2 * 1  # a 64x32 image: two 32x32 tiles, two placeholder tokens on the fake


def png(width: int = 64, height: int = 32, shade: int = 0) -> bytes:
    image = Image.new("RGB", (width, height), (200, shade, 10))
    image.putpixel((1, 1), (0, 0, 255))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def data_url(raw: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(raw).decode()


def image_chat(url: str, model: str = "fake-vl", **fields) -> dict:
    parts = [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
    ]
    return {"model": model, "messages": [{"role": "user", "content": parts}], **fields}


@pytest.fixture
async def gw(make_gateway):
    return await make_gateway(BACKENDS, max_images_per_request=2, max_image_pixels=256 * 256)


async def test_openai_chat_and_responses_take_images_and_count_them(gw):
    _, key = await gw.tenant()
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    text_only = await client.chat.completions.create(
        model="fake-vl", messages=[{"role": "user", "content": "what is this"}], max_tokens=3
    )
    body = image_chat(data_url(png()), max_tokens=3)
    reply = await client.chat.completions.create(**body)
    usage = reply.usage
    assert usage.prompt_tokens_details.image_tokens == TILES
    assert usage.prompt_tokens == text_only.usage.prompt_tokens + TILES  # prompt tokens too
    assert text_only.usage.prompt_tokens_details.image_tokens == 0
    # streamed, with the image URL alone as a string (vLLM's form) and two images
    two = body["messages"][0]["content"] + [{"type": "image_url", "image_url": data_url(png())}]
    stream = await client.chat.completions.create(
        model="fake-vl",
        messages=[{"role": "user", "content": two}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    last = [c async for c in stream][-1]
    assert last.usage.prompt_tokens_details.image_tokens == 2 * TILES
    # the Responses API's input_image
    response = await client.responses.create(
        model="fake-vl",
        max_output_tokens=3,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "what is this"},
                    {"type": "input_image", "image_url": data_url(png()), "detail": "auto"},
                ],
            }
        ],
    )
    assert response.usage.input_tokens_details.image_tokens == TILES
    # /v1/models says which model takes images
    models = {m.id: m for m in (await client.models.list()).data}
    assert models["fake-vl"].vision is True and models["fake-model"].vision is False
    # and Prometheus counts them: one image, two, one
    async with gw.http.get(gw.url + "/metrics", headers=ADMIN) as r:
        metrics = await r.text()
    assert f'kvgate:image_tokens_total{{model="fake-vl",tenant="acme"}} {4.0 * TILES}' in metrics


async def test_a_text_model_refuses_images_in_every_api(gw):
    _, key = await gw.tenant()
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="`fake-model` does not take images"):
        await client.chat.completions.create(**image_chat(data_url(png()), "fake-model"))
    claude = anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)
    block = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png()).decode()}
    content = [{"type": "image", "source": block}, {"type": "text", "text": "what is this"}]
    with pytest.raises(anthropic.BadRequestError, match="does not take images"):
        await claude.messages.create(
            model="fake-model", max_tokens=3, messages=[{"role": "user", "content": content}]
        )
    # and the same message on the vision model: Anthropic's usage carries image_tokens
    reply = await claude.messages.create(
        model="fake-vl", max_tokens=3, messages=[{"role": "user", "content": content}]
    )
    assert reply.usage.image_tokens == TILES
    counted = await claude.messages.count_tokens(
        model="fake-vl", messages=[{"role": "user", "content": content}]
    )
    assert counted.input_tokens == reply.usage.input_tokens  # the placeholders counted too
    r = await gw.post(
        "/v1/messages",
        key,
        {"model": "fake-model", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status == 200  # text on a text model, as ever


async def test_ollama_images_and_capabilities(gw):
    _, key = await gw.tenant()
    client = ollama.AsyncClient(host=gw.url, headers={"Authorization": f"Bearer {key}"})
    reply = await client.chat(
        model="fake-vl",
        messages=[{"role": "user", "content": "what is this", "images": [png()]}],
        options={"num_predict": 3},
    )
    plain = await client.chat(
        model="fake-vl",
        messages=[{"role": "user", "content": "what is this"}],
        options={"num_predict": 3},
    )
    assert reply.prompt_eval_count == plain.prompt_eval_count + TILES
    generated = await client.generate(
        model="fake-vl", prompt="what is this", images=[png()], options={"num_predict": 3}
    )
    assert generated.prompt_eval_count > TILES
    with pytest.raises(ollama.ResponseError, match="does not take images"):
        await client.chat(
            model="fake-model", messages=[{"role": "user", "content": "x", "images": [png()]}]
        )
    assert "vision" in (await client.show("fake-vl")).capabilities
    assert "vision" not in (await client.show("fake-model")).capabilities


@pytest.mark.parametrize(
    ("url", "said"),
    [
        (data_url(b"not an image at all"), "does not decode as PNG, JPEG"),
        (data_url(png(257, 256)), "257x256 pixels; at most 65536 are taken (max_image_pixels)"),
        ("data:image/png;base64,!!!!", "not valid base64"),
        ("data:text/plain;base64,aGk=", "is not an image"),
        ("https://example.com/cat.png", "fetches no image URLs"),
        ("ftp://example.com/cat.png", "must be a data: URL, or http(s)"),
    ],
)
async def test_each_bad_image_is_a_400_that_says_why(gw, url, said):
    _, key = await gw.tenant()
    r = await gw.post("/v1/chat/completions", key, image_chat(url, max_tokens=3))
    body = await r.json()
    assert r.status == 400, body
    assert said in body["error"]["message"]


async def test_limits_on_count_and_bytes_and_the_quota_sees_image_tokens(make_gateway):
    gw = await make_gateway(BACKENDS, max_images_per_request=2, max_image_bytes=2000)
    _, key = await gw.tenant()
    three = image_chat(data_url(png()), max_tokens=3)
    three["messages"][0]["content"] *= 3
    r = await gw.post("/v1/chat/completions", key, three)
    assert r.status == 400
    assert "3 images; at most 2 are taken (max_images_per_request)" in await r.text()
    noisy = Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48)
    out = io.BytesIO()
    noisy.save(out, "BMP")  # ~12 KB, over the 2000 bytes
    r = await gw.post("/v1/chat/completions", key, image_chat(data_url(out.getvalue(), "bmp")))
    assert r.status == 400
    assert "over 2000 bytes (max_image_bytes)" in await r.text()
    # 16 placeholder tokens (128x128) on a tenant whose minute holds 20 tokens: the
    # prompt's text and max_tokens fit alone, not with the image's tokens
    _, small = await gw.tenant("small", tpm=20)
    fits = {"model": "fake-vl", "messages": [{"role": "user", "content": "what"}]}
    assert (await gw.post("/v1/chat/completions", small, fits | {"max_tokens": 4})).status == 200
    big = image_chat(data_url(png(128, 128)), max_tokens=4)
    r = await gw.post("/v1/chat/completions", small, big)
    assert r.status in (400, 429), await r.text()
    assert "tpm" in await r.text()


async def test_every_form_is_checked_where_it_stands(gw):
    _, key = await gw.tenant()
    url = data_url(png())
    refused = [  # (path, body, what the 400 says)
        (
            "/v1/messages",
            {
                "model": "fake-vl",
                "max_tokens": 3,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "url", "url": "https://a.b/c"}}
                        ],
                    }
                ],
            },
            "fetches no image URLs",
        ),
        (
            "/api/generate",
            {"model": "fake-vl", "prompt": "x", "raw": True, "images": [url.split(",")[1]]},
            "do not go with raw",
        ),
        (
            "/v1/responses",
            {
                "model": "fake-vl",
                "input": [
                    {"role": "system", "content": [{"type": "input_image", "image_url": url}]}
                ],
            },
            "belong in user messages",
        ),
        (
            "/v1/chat/completions",
            {
                "model": "fake-vl",
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": image_chat(url)["messages"][0]["content"]},
                    {"role": "user", "content": "y"},
                ],
            },
            "only allowed in user messages",
        ),
    ]
    for path, body, said in refused:
        r = await gw.post(path, key, body)
        text = await r.text()
        assert r.status == 400 and said in text, (path, text)
    # /tokenize counts an image's placeholders with the text
    plain = {"model": "fake-vl", "messages": [{"role": "user", "content": "what is this"}]}
    r = await gw.post("/tokenize", key, plain)
    alone = (await r.json())["count"]
    r = await gw.post("/tokenize", key, image_chat(url))
    assert (await r.json())["count"] == alone + TILES


async def test_a_remote_upstream_without_vision_is_sent_no_images(make_gateway):
    """A third-party upstream's card says vision only where its entry does (its images:
    test_images_remote.py; a kvgate worker's says it itself: test_images_workers.py):
    an image is refused at the gateway, naming the entry, and never reaches it."""
    async with BareUpstream() as up:
        front = await make_gateway([BackendSpec("up", "remote", "gemma", "", {"url": up.url})])
        _, key = await front.tenant()
        body = image_chat(data_url(png()), "gemma", max_tokens=2)
        r = await front.post("/v1/chat/completions", key, body)
        assert r.status == 400
        said = (await r.json())["error"]["message"]
        assert said == (
            "The model `gemma` does not take images: remote backend 'up' is not marked as "
            "taking them (its options.vision)."
        )
        text = {"model": "gemma", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert (await front.post("/v1/chat/completions", key, text)).status == 200
        assert [b["messages"][-1]["content"] for b in up.bodies] == ["hi"]
