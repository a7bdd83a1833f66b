"""The HTTP transport against real sockets: compressed bodies, slow and half-sent
requests, the connection cap and parser errors, on a `kvgate serve` process and on the
in-process server (both run gateway/http/server.py)."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx
import pytest

from gateway.app import create_app
from gateway.config import Settings
from gateway.http.server import GatewayTestServer
from tests.conftest import ADMIN_KEY, start_gateway
from tests.gateway.conftest import fake_backends

CHAT = "/v1/chat/completions"
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
# small deadlines, and a keep-alive long enough that only the header deadline can close
# a half-sent request within the tests' bounds
TRANSPORT = {"header_timeout_s": 0.5, "body_timeout_s": 0.5, "keepalive_timeout_s": 120.0}
BOUND_S = 30  # generous: how long a test waits for what must happen much sooner


@dataclass
class Target:
    port: int
    key: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Target]:
    env = {f"KVGATE_{k.upper()}": str(v) for k, v in TRANSPORT.items()}
    gw = start_gateway(tmp_path_factory.mktemp("transport"), "--backend", "fake", extra_env=env)
    try:
        yield Target(gw.port, gw.tenant_key("acme")[1])
    finally:
        gw.stop()


@pytest.fixture
async def in_process(tmp_path) -> AsyncIterator[Target]:
    s = Settings(
        database_url=f"sqlite+aiosqlite:///{tmp_path / 'gw.db'}",
        admin_key=ADMIN_KEY,
        backend="",
        backends=fake_backends(),
        **TRANSPORT,
    )
    server = GatewayTestServer(create_app(s), s)
    await server.start_server()
    try:
        yield Target(server.port, await _tenant_key(f"http://127.0.0.1:{server.port}"))
    finally:
        await server.close()


@pytest.fixture(params=["live", "in_process"])
def target(request) -> Target:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """A JSON object padded with 100 MB of spaces, gzipped to about 100 KB."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = b" " * (1 << 20)
    parts = [packer.compress(json.dumps(BODY).encode())]
    parts += [packer.compress(block) for _ in range(100)]
    return b"".join(parts) + packer.flush()


async def _tenant_key(url: str) -> str:
    async with httpx.AsyncClient(base_url=url, headers=_auth(ADMIN_KEY)) as http:
        tenant = await http.post("/admin/tenants", json={"name": "acme"})
        key = await http.post(f"/admin/tenants/{tenant.json()['id']}/keys", json={})
        return key.json()["key"]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _error(body: bytes | dict, status: int) -> dict:
    """The OpenAI-shaped error in `body`, checked for its shape."""
    data = json.loads(body) if isinstance(body, bytes) else body
    assert set(data["error"]) == {"message", "type", "param", "code"}, data
    assert data["error"]["message"], data
    return data["error"]


async def _post(target: Target, content: bytes, headers: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=target.url, timeout=BOUND_S) as http:
        return await http.post(CHAT, content=content, headers=headers)


async def _health(target: Target) -> int:
    async with httpx.AsyncClient(base_url=target.url, timeout=BOUND_S) as http:
        return (await http.get("/health")).status_code


async def _connect(target: Target) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", target.port)


async def _send(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    await writer.drain()


async def _response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length, read off a raw connection."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND_S)
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if line)
    length = int({k.lower(): v for k, v in headers.items()}["content-length"])
    return int(lines[0].split()[1]), await reader.readexactly(length)


async def _closed(reader: asyncio.StreamReader) -> bytes:
    """Whatever the server still sends, up to its close (EOF)."""
    return await asyncio.wait_for(reader.read(), BOUND_S)


def _request(method: str, path: str, *headers: str, body: bytes = b"") -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: kvgate", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


# -- compressed bodies -------------------------------------------------------------


async def test_gzip_bomb_gets_413_and_the_gateway_stays_responsive(target, bomb):
    headers = _auth(target.key) | {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    r = await _post(target, bomb, headers)
    assert r.status_code == 413, r.text
    assert "decompressed" in _error(r.json(), 413)["message"]
    assert await _health(target) == 200


async def test_compressed_body_is_not_read_before_authentication(target, bomb):
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    for content in (bomb, b"this is not gzip"):
        r = await _post(target, content, headers)
        assert r.status_code == 401, r.text
        _error(r.json(), 401)
    # the same invalid gzip with a key is read, and refused for what it is
    r = await _post(target, b"this is not gzip", headers | _auth(target.key))
    assert r.status_code == 400 and "gzip" in _error(r.json(), 400)["message"]


async def test_an_unauthenticated_compressed_body_is_never_inflated(in_process, bomb, monkeypatch):
    inflaters = []  # zlib.decompressobj is what aiohttp and parse_body inflate with
    real = zlib.decompressobj
    monkeypatch.setattr(
        zlib, "decompressobj", lambda *a, **kw: inflaters.append(a) or real(*a, **kw)
    )
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    r = await _post(in_process, bomb, headers)
    assert r.status_code == 401 and inflaters == []
    r = await _post(
        in_process, gzip.compress(json.dumps(BODY).encode()), headers | _auth(in_process.key)
    )
    assert r.status_code == 200 and len(inflaters) == 1


@pytest.mark.parametrize(
    "encoding, pack",
    [
        ("gzip", gzip.compress),
        ("deflate", zlib.compress),
        ("deflate", lambda b: zlib.compress(b, wbits=-zlib.MAX_WBITS)),  # raw deflate
    ],
)
async def test_compressed_json_is_served(target, encoding, pack):
    headers = _auth(target.key) | {"Content-Encoding": encoding, "Content-Type": "application/json"}
    r = await _post(target, pack(json.dumps(BODY).encode()), headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


async def test_truncated_gzip_is_a_400(target):
    headers = _auth(target.key) | {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    r = await _post(target, gzip.compress(json.dumps(BODY).encode())[:-8], headers)
    assert r.status_code == 400 and "gzip" in _error(r.json(), 400)["message"]


async def test_unknown_content_encoding_gets_415_naming_it(target):
    headers = _auth(target.key) | {"Content-Encoding": "br", "Content-Type": "application/json"}
    r = await _post(target, json.dumps(BODY).encode(), headers)
    assert r.status_code == 415 and "'br'" in _error(r.json(), 415)["message"]


async def test_only_json_content_types_are_parsed(target):
    body = json.dumps(BODY).encode()
    r = await _post(target, body, _auth(target.key) | {"Content-Type": "text/plain"})
    assert r.status_code == 415 and "'text/plain'" in _error(r.json(), 415)["message"]
    for ctype in ("application/json; charset=utf-8", "application/vnd.api+json"):
        r = await _post(target, body, _auth(target.key) | {"Content-Type": ctype})
        assert r.status_code == 200, (ctype, r.text)
    r = await _post(target, body, _auth(target.key))  # no Content-Type: taken as JSON
    assert r.status_code == 200, r.text


# -- slow and half-sent requests ---------------------------------------------------


async def test_half_sent_headers_are_closed(target):
    reader, writer = await _connect(target)
    await _send(writer, b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvgate\r\nAuthoriz")
    assert await _closed(reader) == b""
    writer.close()


async def test_half_sent_headers_after_a_kept_alive_response_are_closed(target):
    reader, writer = await _connect(target)
    await _send(writer, _request("GET", "/health"))
    assert (await _response(reader))[0] == 200
    await asyncio.sleep(1)  # idle past header_timeout_s: that is the keep-alive timeout's
    await _send(writer, _request("GET", "/health"))
    assert (await _response(reader))[0] == 200
    await _send(writer, b"GET /health HTTP/1.1\r\nHo")
    assert await _closed(reader) == b""
    writer.close()


async def test_headers_that_keep_arriving_in_time_are_never_cut(target):
    """One timer a connection: one armed for an earlier request fires while later ones
    send their headers in two parts, each well inside header_timeout_s (0.5 s), for 1.2 s
    in all; it must wait on for each one's own deadline, not close the connection."""
    reader, writer = await _connect(target)
    whole = _request("GET", "/health")
    for _ in range(8):
        await _send(writer, whole[:10])
        await asyncio.sleep(0.15)
        await _send(writer, whole[10:])
        assert (await _response(reader))[0] == 200
    await _send(writer, whole[:10])  # and a request that stops half-way is still cut
    assert await _closed(reader) == b""
    writer.close()


async def test_a_body_that_stops_half_way_gets_408(target):
    reader, writer = await _connect(target)
    head = _request(
        "POST",
        CHAT,
        f"Authorization: Bearer {target.key}",
        "Content-Type: application/json",
        "Content-Length: 1000",
    )
    await _send(writer, head + json.dumps(BODY).encode()[:20])
    status, body = await _response(reader)
    assert status == 408 and "did not arrive" in _error(body, 408)["message"]
    writer.close()


# -- parser errors -----------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"NOT AN HTTP REQUEST LINE\r\n\r\n",
        _request("GET", "/health", "X-Big: " + "a" * 10_000),
        _request(
            "POST", CHAT, "Content-Length: 5", "Transfer-Encoding: chunked", body=b"0\r\n\r\n"
        ),
    ],
    ids=["bad-request-line", "oversized-header", "content-length-and-chunked"],
)
async def test_parser_errors_are_openai_shaped(target, raw):
    reader, writer = await _connect(target)
    await _send(writer, raw)
    status, body = await _response(reader)
    assert 400 <= status < 500
    assert _error(body, status)["type"] == "invalid_request_error"
    assert await _closed(reader) == b""
    writer.close()


@pytest.mark.parametrize("early", [True, False], ids=["with-headers", "after-headers"])
async def test_bad_chunked_body_is_a_400(target, early):
    reader, writer = await _connect(target)
    head = _request(
        "POST",
        CHAT,
        f"Authorization: Bearer {target.key}",
        "Content-Type: application/json",
        "Transfer-Encoding: chunked",
    )
    bad = b"zz-not-a-size\r\n{}\r\n0\r\n\r\n"
    if early:  # the parser meets it at once
        await _send(writer, head + bad)
    else:  # the handler is already reading the body when it comes
        await _send(writer, head + b"2\r\n{}\r\n")
        await asyncio.sleep(0.1)
        await _send(writer, bad)
    status, body = await _response(reader)
    # after the headers, aiohttp's C parser leaves the body unfinished (so: 408 once
    # body_timeout_s is spent), its Python parser fails the body's read (400)
    assert status == 400 if early else status in (400, 408), body
    _error(body, status)
    writer.close()


# -- the connection cap ------------------------------------------------------------


async def test_connections_past_the_cap_get_503_and_the_rest_keep_working(tmp_path):
    gw = start_gateway(tmp_path, "--backend", "fake", extra_env={"KVGATE_MAX_CONNECTIONS": "3"})
    target = Target(gw.port, "")
    try:
        conns = [await _connect(target) for _ in range(3)]
        for reader, writer in conns:  # each is counted once it has been answered
            await _send(writer, _request("GET", "/health"))
            assert (await _response(reader))[0] == 200
        reader, writer = await _connect(target)
        status, body = await _response(reader)
        assert status == 503 and _error(body, 503)["code"] == "too_many_connections"
        assert await _closed(reader) == b""
        writer.close()
        for reader, writer in conns:
            await _send(writer, _request("GET", "/health"))
            assert (await _response(reader))[0] == 200
            writer.close()
            await writer.wait_closed()
        assert await _health_once_free(target) == 200
    finally:
        gw.stop()


async def _health_once_free(target: Target) -> int:
    """/health on a new connection, retried while the server has yet to see the
    closes of the old ones (a bounded wait, not a measured one)."""
    async with asyncio.timeout(BOUND_S):
        while True:
            reader, writer = await _connect(target)
            await _send(writer, _request("GET", "/health"))
            status, _ = await _response(reader)
            writer.close()
            if status != 503:
                return status
            await asyncio.sleep(0.05)
