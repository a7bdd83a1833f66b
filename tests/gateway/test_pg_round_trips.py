"""Round trips to PostgreSQL, counted with SQLAlchemy's engine events: a request's path to
its first token is one statement (its admission), its settlement rides in its usage
row's commit, and concurrent admissions of one tenant share statements yet stay exact."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager

import aiohttp
import asyncpg
import pytest
from sqlalchemy import event

from gateway.app import create_app
from gateway.config import Settings
from gateway.db import Database, migrate
from gateway.http.server import GatewayTestServer
from gateway.routing import adapters
from gateway.tenancy.quota import QuotaExceeded, QuotaLimits
from gateway.tenancy.quota import postgres as quota_postgres
from gateway.tenancy.quota.postgres import PostgresQuotaStore
from studies import pg_cluster
from tests.conftest import ADMIN_KEY, PG_URL
from tests.gateway.conftest import fake_backends

pytestmark = pytest.mark.pg
NOW = 1_800_000_000.0 + 5


@contextmanager
def statements(db: Database) -> Iterator[list[str]]:
    """Every statement sent on `db`'s async engine meanwhile (SQLAlchemy's engine event)."""
    sent: list[str] = []

    def statement(conn, cursor, sql, params, context, executemany) -> None:
        sent.append(sql)

    event.listen(db.engine.sync_engine, "before_cursor_execute", statement)
    try:
        yield sent
    finally:
        event.remove(db.engine.sync_engine, "before_cursor_execute", statement)


async def test_concurrent_admissions_of_one_tenant_share_statements(pg_schema):
    db = Database(PG_URL, pg_schema)
    await migrate(db)
    store = PostgresQuotaStore(db)
    try:

        async def one() -> bool:
            try:
                await store.admit("t", QuotaLimits(rpm=50), 1, NOW)
                return True
            except QuotaExceeded:
                return False

        with statements(db) as sent:
            admitted = await asyncio.gather(*(one() for _ in range(120)))
        assert sum(admitted) == 50
        assert all("kvgate_admit" in sql for sql in sent), sent
        assert len(sent) < 120
    finally:
        await db.close()


@pytest.fixture
def cluster():
    if not pg_cluster.available():
        pytest.skip("no PostgreSQL server binaries")
    c = pg_cluster.PgCluster().start()
    yield c
    c.remove()


async def _server_statements(dsn: str, reset: bool = False) -> list[tuple[str, int]]:
    """What pg_stat_statements counted (wire-level: BEGIN and COMMIT included), less the
    periodic auth-epoch read (at most every 0.1 s per gateway, not per request) and the
    batch runner's periodic poll (a BEGIN, a SELECT from batches, a ROLLBACK each)."""
    conn = await asyncpg.connect(dsn)
    try:
        if reset:
            await conn.execute("SELECT pg_stat_statements_reset()")
            return []
        rows = await conn.fetch("SELECT query, calls FROM pg_stat_statements")
    finally:
        await conn.close()
    skip = ("pg_stat_statements", "server_settings")
    kept = [(r["query"], r["calls"]) for r in rows if not any(s in r["query"] for s in skip)]
    polls = sum(n for q, n in kept if "FROM batches" in q)
    out = []
    for query, calls in kept:
        if "FROM batches" in query:
            continue
        # the poll goes through SQLAlchemy, whose BEGIN names the isolation level;
        # the usage commit's own BEGIN (asyncpg's) is another statement
        if query.startswith(("BEGIN ISOLATION LEVEL", "ROLLBACK")):
            calls -= polls
        if calls > 0:
            out.append((query, calls))
    return out


async def test_a_request_makes_one_round_trip_before_its_first_token(cluster, monkeypatch):
    # the background polls (other gateways' adapters, this one's lease) are no request's
    monkeypatch.setattr(adapters, "REFRESH_S", 3600.0)
    monkeypatch.setattr(quota_postgres, "HEARTBEAT_S", 3600.0)
    await _sql(cluster.dsn, "CREATE EXTENSION pg_stat_statements")
    settings = Settings(
        database_url=cluster.url,
        admin_key=ADMIN_KEY,
        backend="",
        backends=fake_backends(ttft_ms=200, tokens_per_second=2),
    )
    server = GatewayTestServer(create_app(settings), settings)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    try:
        async with aiohttp.ClientSession() as http:
            tenant_body = {"name": "rt", "rpm": 1000}
            async with http.post(url + "/admin/tenants", json=tenant_body, headers=admin) as r:
                tenant = await r.json()
            keys_url = f"{url}/admin/tenants/{tenant['id']}/keys"
            async with http.post(keys_url, json={}, headers=admin) as r:
                key = (await r.json())["key"]
            body = {"model": "fake-model", "prompt": "hello", "max_tokens": 3, "stream": True}
            headers = {"Authorization": f"Bearer {key}"}

            async def stream() -> tuple[list, list]:
                await _server_statements(cluster.dsn, reset=True)
                async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200
                    first = await r.content.readline()
                    assert json.loads(first.removeprefix(b"data: "))["choices"]
                    before_first = await _server_statements(cluster.dsn)
                    await r.read()
                await asyncio.sleep(0.3)  # the stats of the last commit
                return before_first, await _server_statements(cluster.dsn)

            await stream()  # the key cached, the statements prepared
            before_first, whole = await stream()
        assert len(before_first) == 1 and before_first[0][1] == 1, before_first
        assert "kvgate_admit" in before_first[0][0]
        # then one transaction: the settlement, the usage row, the daily total
        calls = {
            query.split()[0] + (" settle" if "kvgate_settle" in query else ""): n
            for query, n in whole
        }
        assert calls.get("BEGIN") == 1 and calls.get("COMMIT") == 1, whole
        assert calls.get("SELECT settle") == 1, whole
    finally:
        await server.close()


async def _sql(dsn: str, sql: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()
