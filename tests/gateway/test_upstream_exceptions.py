"""Whatever the HTTP client raises while a remote upstream streams, the request ends
with an OpenAI-shaped error and its job is finished: the usage row is written, the
tenant's slot and reservation are given back. Each exception is injected into a real
response from a real upstream, at the socket reader (where aiohttp raises them) and
above the adapter's line reader (the gateway's last line of defence).

Also here: the health monitor follows no redirect.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import http_exceptions

from gateway.backends import BackendSpec
from gateway.backends.remote_health import Monitor
from gateway.backends.remote_http import Endpoint, UpstreamClient
from studies.hostile_upstream_server import HostileUpstream
from tests.gateway.test_remote import MODEL

RAISED = {
    "LineTooLong": lambda: http_exceptions.LineTooLong(b"x" * 10, "8190"),
    "ClientPayloadError": lambda: aiohttp.ClientPayloadError("cut"),
    "ServerDisconnectedError": lambda: aiohttp.ServerDisconnectedError(),
    "TimeoutError": lambda: TimeoutError(),
    "ValueError": lambda: ValueError("bad chunk size"),
    "RuntimeError": lambda: RuntimeError("connection closed"),
    "UnicodeDecodeError": lambda: UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"),
    "OSError": lambda: OSError(113, "No route to host"),
}


@pytest.fixture(scope="module")
def up() -> Iterator[HostileUpstream]:
    with HostileUpstream(MODEL) as upstream:
        upstream.delay_s = 0.01
        yield upstream


async def gateway(make_gateway, up: HostileUpstream):
    options = {"url": up.url, "context_length": 4096, "read_timeout_s": 5}
    gw = await make_gateway([BackendSpec("up", "remote", "", MODEL, options)])
    _, key = await gw.tenant("acme", max_concurrent=1)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    return gw, client


def inject_in_reader(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    """The next completion's socket reader raises `error` after its first event."""
    request = UpstreamClient.request

    async def failing(self: UpstreamClient, method: str, url: str, *args: Any, **kw: Any):
        resp = await request(self, method, url, *args, **kw)
        if url.endswith("/completions"):
            readany, calls = resp.content.readany, [0]

            async def readany_then_fail() -> bytes:
                calls[0] += 1
                if calls[0] > 1:
                    raise error
                return await readany()

            resp.content.readany = readany_then_fail
        return resp

    monkeypatch.setattr(UpstreamClient, "request", failing)


def inject_above_lines(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    """The adapter's line reader itself raises `error` after one event."""

    async def lines(self: UpstreamClient, resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"index": 0, "text": " w0", "finish_reason": null}]}\n'
        yield b"\n"
        raise error

    monkeypatch.setattr(UpstreamClient, "lines", lines)


@pytest.mark.parametrize("layer", [inject_in_reader, inject_above_lines], ids=["reader", "lines"])
@pytest.mark.parametrize("name", RAISED)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_every_exception_finishes_the_job(make_gateway, up, monkeypatch, layer, name, stream):
    gw, client = await gateway(make_gateway, up)
    received = 0
    with monkeypatch.context() as patch:
        layer(patch, RAISED[name]())
        with pytest.raises(openai.APIError) as raised:
            if stream:
                chunks = await client.completions.create(
                    model=MODEL, prompt="a b", max_tokens=20, stream=True
                )
                async for _ in chunks:
                    received += 1
            else:
                await client.completions.create(model=MODEL, prompt="a b", max_tokens=20)
    message = str(raised.value)
    assert "remote backend 'up'" in message or "the backend of model" in message
    assert up.url.split("//")[1].split("/")[0] not in message  # no address
    db = sqlite3.connect(gw.state.settings.database_url.split(":///")[1])
    rows = db.execute("SELECT status, completion_tokens FROM usage_records").fetchall()
    assert rows == [(503, received)]  # billed what was streamed; a whole answer: nothing
    # the one slot was given back: the next request runs
    comp = await client.completions.create(model=MODEL, prompt="a b", max_tokens=2)
    assert comp.choices[0].text == " w0 w1"


async def test_the_health_monitor_follows_no_redirect():
    with HostileUpstream(MODEL) as up:
        up.health_redirect = True
        client = UpstreamClient(Endpoint.parse(up.url), "remote backend 'up'", None, 1, 2)
        await client.start()
        monitor = Monitor(client, "up", MODEL, 0.2, lambda: 0)
        monitor.start()
        try:
            for _ in range(100):
                if "HTTP 307" in monitor.reason:
                    break
                await asyncio.sleep(0.05)
        finally:
            await monitor.stop()
            await client.close()
        assert "HTTP 307" in monitor.reason and not monitor.healthy
        assert up.recorder.hits == []
