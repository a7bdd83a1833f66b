"""Remote image URLs and the gateway's reach (SSRF): a URL is fetched only from a host
the admin allows, never from a private, loopback or link-local address however its
host resolves, without following a redirect, within its byte and time bounds; images
decode to the same digest whatever lossless format carried their pixels; the settings
that bound them are checked at start-up.

The servers are real aiohttp servers on this machine. Every address here is loopback or
private, so the one test that must see a fetch succeed calls the address classifier's
answer public for loopback (monkeypatched, nothing else)."""

from __future__ import annotations

import asyncio
import io
import ipaddress
import socket

import pytest
from aiohttp import web
from PIL import Image

from gateway.config import Settings
from gateway.config_check import ConfigError
from gateway.http.errors import ApiError
from gateway.serving import image_fetch
from gateway.serving.image_fetch import FetchRefused, fetch_image, is_public
from gateway.serving.images import decode_image
from tests.gateway.test_images import BACKENDS, image_chat, png

PNG = png()


@pytest.fixture
async def server():
    """A real image server on 127.0.0.1 (and, where the machine has one, on its
    non-loopback address too): /cat.png, /big.png, /away (a redirect), /slow."""

    async def cat(request: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    async def big(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()  # no Content-Length: only reading stops it
        await resp.prepare(request)
        for _ in range(64):
            await resp.write(b"x" * 4096)
        return resp

    async def away(request: web.Request) -> web.Response:
        raise web.HTTPFound("/cat.png")

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response(body=PNG)

    app = web.Application()
    app.router.add_get("/cat.png", cat)
    app.router.add_get("/big.png", big)
    app.router.add_get("/away", away)
    app.router.add_get("/slow", slow)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "0.0.0.0", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield port
    await runner.cleanup()


def _own_address() -> str | None:
    """This machine's non-loopback IPv4 address, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: the route picks the address
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(address).is_loopback else address


async def fetch(url: str, allowed=("localhost", "127.0.0.1"), max_bytes=1 << 20, limit_s=5.0):
    return await fetch_image(url, frozenset(allowed), max_bytes, limit_s)


async def test_loopback_and_private_addresses_are_never_fetched(server):
    for url in (f"http://localhost:{server}/cat.png", f"http://127.0.0.1:{server}/cat.png"):
        with pytest.raises(FetchRefused, match="private, loopback or link-local"):
            await fetch(url)
    own = _own_address()
    if own is not None:  # a real server on a non-loopback address: private here, refused
        assert not is_public(ipaddress.ip_address(own))
        with pytest.raises(FetchRefused, match="private, loopback or link-local"):
            await fetch(f"http://{own}:{server}/cat.png", allowed=(own,))
    for address in ("10.1.2.3", "169.254.169.254", "::1", "fe80::1", "::ffff:127.0.0.1"):
        assert not is_public(ipaddress.ip_address(address)), address
    assert is_public(ipaddress.ip_address("93.184.215.14"))


async def test_hosts_not_allowed_schemes_and_credentials_are_refused(server):
    with pytest.raises(FetchRefused, match="fetches no image URLs"):
        await fetch(f"http://localhost:{server}/cat.png", allowed=())
    with pytest.raises(FetchRefused, match="not one this gateway fetches from"):
        await fetch(f"http://localhost:{server}/cat.png", allowed=("images.example.com",))
    with pytest.raises(FetchRefused, match="may not carry credentials"):
        await fetch(f"http://user:pw@localhost:{server}/cat.png")
    with pytest.raises(FetchRefused, match="data: URL, or http"):
        await fetch("file:///etc/passwd")


async def test_an_allowed_public_host_is_fetched_once_bounded(server, monkeypatch):
    # loopback stands in for a public address: the classifier alone is told so
    monkeypatch.setattr(image_fetch, "is_public", lambda a: a.is_loopback or is_public(a))
    assert await fetch(f"http://localhost:{server}/cat.png") == PNG
    with pytest.raises(FetchRefused, match="redirects are not followed"):
        await fetch(f"http://localhost:{server}/away")
    with pytest.raises(FetchRefused, match=r"over 65536 bytes \(max_image_bytes\)"):
        await fetch(f"http://localhost:{server}/big.png", max_bytes=65536)
    with pytest.raises(FetchRefused, match=r"within 0.3 s \(image_fetch_timeout_s\)"):
        await fetch(f"http://localhost:{server}/slow", limit_s=0.3)
    with pytest.raises(FetchRefused, match="answered HTTP 404"):
        await fetch(f"http://localhost:{server}/none.png")


async def test_the_gateway_fetches_only_what_it_may(server, make_gateway, monkeypatch):
    gw = await make_gateway(BACKENDS, allowed_image_hosts=["LocalHost"])
    _, key = await gw.tenant()
    url = f"http://localhost:{server}/cat.png"
    r = await gw.post("/v1/chat/completions", key, image_chat(url, max_tokens=2))
    assert r.status == 400
    assert "Image 1: The image URL's host 'localhost' resolves to a private" in await r.text()
    monkeypatch.setattr(image_fetch, "is_public", lambda a: a.is_loopback or is_public(a))
    r = await gw.post("/v1/chat/completions", key, image_chat(url, max_tokens=2))
    body = await r.json()
    assert r.status == 200, body
    assert body["usage"]["prompt_tokens_details"]["image_tokens"] == 2


def test_the_digest_is_the_pixels_not_the_file():
    image = Image.frombytes("RGB", (5, 3), bytes(range(45)))
    files = {}
    for kind in ("PNG", "BMP", "WEBP"):
        out = io.BytesIO()
        image.save(out, kind, **({"lossless": True} if kind == "WEBP" else {}))
        files[kind] = out.getvalue()
    decoded = {kind: decode_image(raw, 100) for kind, raw in files.items()}
    assert len({d.digest for d in decoded.values()}) == 1
    assert len(set(files.values())) == 3  # three different files
    assert decoded["PNG"].rgb == image.tobytes() and decoded["PNG"].width == 5
    other = Image.frombytes("RGB", (5, 3), bytes(range(1, 46)))
    out = io.BytesIO()
    other.save(out, "PNG")
    assert decode_image(out.getvalue(), 100).digest != decoded["PNG"].digest
    with pytest.raises(ApiError, match="5x3 pixels; at most 14"):
        decode_image(files["PNG"], 14)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"max_image_bytes": 0}, "max_image_bytes"),
        ({"max_images_per_request": 0}, "max_images_per_request"),
        ({"image_fetch_timeout_s": 0}, "image_fetch_timeout_s"),
        ({"allowed_image_hosts": ["https://x.example"]}, "is not a host name"),
        ({"allowed_image_hosts": ["x.example:443"]}, "is not a host name"),
    ],
)
def test_image_settings_are_checked(settings, named):
    with pytest.raises(ConfigError, match=named):
        Settings(**settings)
    assert Settings(allowed_image_hosts=[" Images.Example.COM. "]).allowed_image_hosts == [
        "images.example.com"
    ]
