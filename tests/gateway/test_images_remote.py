"""Images to a third-party upstream whose entry says `vision = true` (issue 52): real
upstream servers on real sockets behind a gateway (in the test's process, and a
`kvgate serve` that reads the entry from its config file), with the official `openai`,
`anthropic` and `ollama` clients as callers. Every API's image reaches the upstream's
/v1/chat/completions as an OpenAI `image_url` data URL: the client's file as it came (a
PNG, a JPEG), or a PNG of the pixels the gateway decoded where the file would read
otherwise upstream (a photo its EXIF turns, a GIF); in order, with the text around them.
Usage is the upstream's, its prompt's bound reserving `image_tokens` per image before
admission; a vLLM-shaped upstream (its /tokenize and /v1/completions for text) gets image
chats on its chat API too. An entry without `vision` refuses images naming itself (in
test_images.py), and /tokenize cannot count an image chat there."""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import sqlite3

import anthropic
import ollama
import openai
import pytest
from PIL import Image, ImageOps

from gateway.backends import BackendSpec
from gateway.backends.remote_options import RemoteOptions
from tests.conftest import start_gateway
from tests.gateway.test_images import data_url, png
from tests.gateway.test_remote_template_kwargs import TokenizingUpstream
from tests.gateway.test_url_only_upstreams import BareUpstream, url_only, wait_for_rows

IMAGE_TOKENS = 500  # the entry's bound on one image's tokens
ASK = {"type": "text", "text": "what is this"}


class VisionUpstream(BareUpstream):
    """BareUpstream (a chat API that tells nothing) serving a vision model: its prompt
    counts its images (300 tokens, 200 of them images); with `tokenizes`, vLLM's shape:
    TokenizingUpstream's /tokenize and /v1/completions beside its chat API."""

    PROMPT_TOKENS = 300
    PROMPT_DETAILS = {"image_tokens": 200}
    tokenize = TokenizingUpstream.tokenize
    completions = TokenizingUpstream.completions

    def __init__(self, tokenizes: bool = False) -> None:
        super().__init__()
        self.tokenizes = tokenizes
        self.tokenized: list[dict] = []
        self.prompts: list[list[int]] = []

    def app(self):
        app = super().app()
        if self.tokenizes:
            app.router.add_post("/tokenize", self.tokenize)
            app.router.add_post("/v1/completions", self.completions)
        return app

    def sent_images(self) -> list[str]:
        """The image URLs of the last chat it was sent, in order."""
        return [
            p["image_url"]["url"]
            for m in self.bodies[-1]["messages"]
            if isinstance(m["content"], list)
            for p in m["content"]
            if p["type"] == "image_url"
        ]


async def vision_gateway(make_gateway, up: VisionUpstream, **options):
    entry = {"url": up.url, "vision": True, "image_tokens": IMAGE_TOKENS} | options
    gw = await make_gateway([BackendSpec("up", "remote", "vl", "", entry)])
    tenant, key = await gw.tenant()
    return gw, tenant, key


def pixels(url: str) -> bytes:
    """What a data URL's image shows, upright, as RGB."""
    raw = base64.b64decode(url.split(",", 1)[1])
    with Image.open(io.BytesIO(raw)) as image:
        return ImageOps.exif_transpose(image).convert("RGB").tobytes()


def turned_jpeg() -> bytes:
    """A JPEG whose EXIF says to turn it (orientation 6: 90 degrees clockwise)."""
    image = Image.new("RGB", (48, 24), (250, 20, 20))
    image.paste((20, 20, 250), (0, 0, 24, 24))
    exif = Image.Exif()
    exif[0x0112] = 6
    out = io.BytesIO()
    image.save(out, "JPEG", exif=exif, quality=95)
    return out.getvalue()


def gif() -> bytes:
    out = io.BytesIO()
    Image.new("P", (16, 16), 3).save(out, "GIF")
    return out.getvalue()


async def test_every_api_sends_the_upstream_data_urls_and_bills_its_usage(make_gateway):
    async with VisionUpstream() as up:
        gw, tenant, key = await vision_gateway(make_gateway, up)
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        assert [m.vision for m in (await client.models.list()).data] == [True]
        first, second = png(), png(40, 30, shade=90)
        parts = [ASK, {"type": "image_url", "image_url": {"url": data_url(first), "detail": "low"}}]
        parts.append({"type": "image_url", "image_url": {"url": data_url(second)}})
        reply = await client.chat.completions.create(
            model="vl", messages=[{"role": "user", "content": parts}], max_tokens=3
        )
        assert reply.choices[0].message.content == "Hello there!"
        sent = up.bodies[-1]["messages"][0]["content"]
        assert sent[0] == ASK  # the text where it stood, the files as they came, in order
        assert up.sent_images() == [data_url(first), data_url(second)]
        assert sent[1] == {"type": "image_url", "image_url": {"url": data_url(first)}}
        # billed as the upstream counted (its images within it), as the usage row says
        usage = reply.usage
        assert (usage.prompt_tokens, usage.prompt_tokens_details.image_tokens) == (300, 200)
        row = (await gw.state.tenants.usage(tenant["id"]))["total"]
        assert (row["prompt_tokens"], row["image_tokens"]) == (300, 200)

        # a photo its EXIF turns, and a GIF: PNGs of what the gateway decoded
        for raw, kind in ((turned_jpeg(), "jpeg"), (gif(), "gif")):
            await client.chat.completions.create(
                model="vl",
                messages=[{"role": "user", "content": [ASK, _part(data_url(raw, kind))]}],
                max_tokens=1,
            )
            [url] = up.sent_images()
            assert url.startswith("data:image/png;base64,")
            assert pixels(url) == pixels(data_url(raw, kind))  # the JPEG upright

        # Anthropic's image block, the Responses API's input_image, Ollama's images
        claude = anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)
        block = {"type": "base64", "media_type": "image/png", "data": _b64(first)}
        message = await claude.messages.create(
            model="vl",
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image", "source": block}]}],
        )
        assert up.sent_images() == [data_url(first)] and message.usage.input_tokens == 300
        image = {"type": "input_image", "image_url": data_url(second)}
        response = await client.responses.create(
            model="vl", max_output_tokens=2, input=[{"role": "user", "content": [image]}]
        )
        assert up.sent_images() == [data_url(second)]
        assert response.usage.input_tokens_details.image_tokens == 200
        local = ollama.AsyncClient(host=gw.url, headers={"Authorization": f"Bearer {key}"})
        await local.chat(
            model="vl",
            messages=[{"role": "user", "content": "what is this", "images": [first]}],
            options={"num_predict": 2},
        )
        assert up.sent_images() == [data_url(first)]


async def test_a_served_gateway_reads_the_entry_from_its_config_file(tmp_path):
    """`kvgate serve` with the entry in its TOML file: the image reaches the upstream and
    the usage row in its database holds the upstream's counts, images too."""
    async with VisionUpstream() as up:
        config = url_only(up.url, "vl", vision=True, image_tokens=IMAGE_TOKENS)
        gw = await asyncio.to_thread(start_gateway, tmp_path, config=config)
        try:
            tenant, key = await asyncio.to_thread(gw.tenant_key, "acme")
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
            await client.chat.completions.create(
                model="vl",
                messages=[{"role": "user", "content": [ASK, _part(data_url(png()))]}],
                max_tokens=2,
            )
            assert up.sent_images() == [data_url(png())]
            rows = await asyncio.to_thread(wait_for_rows, tmp_path, tenant["id"], 1)
            assert rows == [(300, 2, 200)]
            db = sqlite3.connect(tmp_path / "kvgate.db")
            assert db.execute("SELECT image_tokens FROM usage_records").fetchall() == [(200,)]
        finally:
            await asyncio.to_thread(gw.stop)


async def test_the_quota_reserves_image_tokens_and_tokenize_cannot_count(make_gateway):
    async with VisionUpstream() as up:
        gw, _, _ = await vision_gateway(make_gateway, up)
        # the chat's bytes and max_tokens fit in 400 tokens a minute; with an image's
        # 500 reserved they do not: refused before anything is sent
        _, key = await gw.tenant("small", tpm=400)
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        with pytest.raises((openai.BadRequestError, openai.RateLimitError), match="tpm"):
            await client.chat.completions.create(
                model="vl",
                messages=[{"role": "user", "content": [ASK, _part(data_url(png()))]}],
                max_tokens=3,
            )
        assert up.bodies == []
        text = await client.chat.completions.create(
            model="vl", messages=[{"role": "user", "content": "what is this"}], max_tokens=3
        )
        assert text.choices[0].message.content == "Hello there!"
        body = {
            "model": "vl",
            "messages": [{"role": "user", "content": [ASK, _part(data_url(png()))]}],
        }
        r = await gw.post("/tokenize", key, body)
        assert r.status == 400 and "does not tokenize for the gateway" in await r.text()


async def test_an_upstream_counting_past_the_bound_is_billed_at_it_and_logged(make_gateway, caplog):
    async with VisionUpstream() as up:
        gw, _, key = await vision_gateway(make_gateway, up, image_tokens=1)
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        with caplog.at_level(logging.WARNING, "kvgate"):
            reply = await client.chat.completions.create(
                model="vl",
                messages=[{"role": "user", "content": [ASK, _part(data_url(png()))]}],
                max_tokens=2,
            )
        assert reply.usage.prompt_tokens < VisionUpstream.PROMPT_TOKENS  # the bound
        assert "the upstream counted 300 prompt tokens, past the" in caplog.text
        assert "image_tokens is too low" in caplog.text


async def test_a_vllm_shaped_upstream_takes_image_chats_on_its_chat_api(make_gateway):
    async with VisionUpstream(tokenizes=True) as up:
        gw, _, key = await vision_gateway(make_gateway, up)
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        text = await client.chat.completions.create(
            model="vl", messages=[{"role": "user", "content": "what is this"}], max_tokens=2
        )
        # text: rendered by its /tokenize, sent as ids to /v1/completions, as before
        assert text.choices[0].message.content == "Cold." and up.prompts and not up.bodies
        reply = await client.chat.completions.create(
            model="vl",
            messages=[{"role": "user", "content": [ASK, _part(data_url(png()))]}],
            max_tokens=2,
        )
        assert reply.choices[0].message.content == "Hello there"
        assert up.sent_images() == [data_url(png())] and reply.usage.prompt_tokens == 300
        assert len(up.prompts) == 1  # the image chat did not go to /v1/completions


def _part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"vision": "yes"}, "vision must be true or false, got 'yes'"),
        ({"vision": True, "image_tokens": 0}, "image_tokens must be an integer > 0"),
        ({"image_tokens": 256}, "image_tokens goes with vision = true"),
    ],
)
def test_an_entrys_image_options_are_checked(options, said):
    spec = BackendSpec("up", "remote", "vl", "", {"url": "http://127.0.0.1:9/v1"} | options)
    with pytest.raises(ValueError, match=f"remote backend 'up': {said}"):
        RemoteOptions.parse(spec)
