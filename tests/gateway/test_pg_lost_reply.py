"""An admission whose reply is lost: the call commits, then the connection drops before
the answer reaches the gateway, which answers its request with an error. What the call
took (the concurrency slot, the request, the tokens) must come back before the tenant's
next admission, and a call that never committed must give back nothing.

The connection really drops: the store talks to PostgreSQL through a TCP proxy that,
when armed, holds the server's answer carrying `"taken"` until PostgreSQL says it is
ready for the next query (so the call has committed), then cuts both sides."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import make_url

from gateway.db import Database, migrate
from gateway.tenancy.quota import QuotaExceeded, QuotaLimits
from gateway.tenancy.quota.postgres import PostgresQuotaStore
from tests.conftest import PG_URL

pytestmark = pytest.mark.pg

NOW = 1_800_000_000.0 + 5
READY = b"Z\x00\x00\x00\x05I"  # ReadyForQuery, idle: the implicit transaction committed


class CuttingProxy:
    """A TCP proxy to PostgreSQL that can lose one admission's reply, or every link."""

    def __init__(self) -> None:
        url = make_url(PG_URL)
        self.target = (url.host or "127.0.0.1", url.port or 5432)
        self.lose_next_taken = False
        self.links: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._link, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    def url(self) -> str:
        return make_url(PG_URL).set(port=self.port).render_as_string(hide_password=False)

    async def _link(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter):
        server_r, server_w = await asyncio.open_connection(*self.target)
        self.links.append((client_w, server_w))
        await asyncio.gather(
            self._pipe(client_r, server_w), self._replies(server_r, client_w, server_w)
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
        writer.close()

    async def _replies(self, reader, client_w, server_w) -> None:
        held = b""
        while data := await reader.read(65536):
            if self.lose_next_taken and (held or b'"taken"' in data):
                held += data
                if READY in held[held.index(b'"taken"') :]:
                    self.lose_next_taken = False
                    client_w.transport.abort()
                    server_w.transport.abort()
                    return
                continue
            client_w.write(data)
        client_w.close()

    def cut_all(self) -> None:
        for client_w, server_w in self.links:
            client_w.transport.abort()
            server_w.transport.abort()
        self.links.clear()

    async def close(self) -> None:
        self.cut_all()
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture
async def setup(pg_schema):
    direct = Database(PG_URL, pg_schema)
    await migrate(direct)
    proxy = CuttingProxy()
    await proxy.start()
    through = Database(proxy.url(), pg_schema)
    yield PostgresQuotaStore(through), PostgresQuotaStore(direct), proxy
    await through.close()
    await proxy.close()
    await direct.close()


async def test_what_a_lost_reply_admitted_comes_back_before_the_next_admission(setup):
    store, truth, proxy = setup
    limits = QuotaLimits(max_concurrent=1, rpm=10, tpm=1000)
    proxy.lose_next_taken = True
    with pytest.raises(Exception) as lost:
        await store.admit("t", limits, 100, NOW)
    assert not isinstance(lost.value, QuotaExceeded)
    # it committed: the database holds the slot, the request and the tokens
    used = await truth.used("t", NOW)
    assert (used["concurrent"], used["requests"], used["tokens"]) == (1, 1, 100)
    # the next admission fits the one slot: the lost one's is back first
    res = await store.admit("t", limits, 30, NOW)
    used = await truth.used("t", NOW)
    assert (used["concurrent"], used["requests"], used["tokens"]) == (1, 1, 30)
    await store.settle(res, 20)
    used = await truth.used("t", NOW)
    assert (used["concurrent"], used["requests"], used["tokens"]) == (0, 1, 20)


async def test_a_call_that_never_ran_gives_back_nothing(setup):
    """The connection is gone before the call: nothing committed, so the recovery must
    leave alone the slot an earlier, live request holds."""
    store, truth, proxy = setup
    limits = QuotaLimits(max_concurrent=2)
    live = await store.admit("t", limits, 10, NOW)
    proxy.cut_all()  # the pool's connection is dead: the next call fails on it
    with pytest.raises(Exception) as lost:
        await store.admit("t", limits, 10, NOW)
    assert not isinstance(lost.value, QuotaExceeded)
    second = await store.admit("t", limits, 10, NOW)
    assert (await truth.used("t", NOW))["concurrent"] == 2  # the live one's slot is held
    with pytest.raises(QuotaExceeded):
        await store.admit("t", limits, 10, NOW)
    for res in (live, second):
        await store.settle(res, 10)
    assert (await truth.used("t", NOW))["concurrent"] == 0


async def test_a_lost_batch_gives_back_only_what_it_admitted(setup):
    """A call carrying three requests of which the limit admits two: both come back."""
    store, truth, proxy = setup
    limits = QuotaLimits(max_concurrent=2)
    proxy.lose_next_taken = True
    outcomes = await asyncio.gather(
        *(store.admit("t", limits, 5, NOW) for _ in range(3)), return_exceptions=True
    )
    assert all(isinstance(o, Exception) and not isinstance(o, QuotaExceeded) for o in outcomes)
    assert (await truth.used("t", NOW))["concurrent"] == 2
    again = await asyncio.gather(*(store.admit("t", limits, 5, NOW) for _ in range(2)))
    used = await truth.used("t", NOW)
    assert (used["concurrent"], used["requests"], used["tokens"]) == (2, 2, 10)
    for res in again:
        await store.settle(res, 5)
