"""The PostgreSQL quota store's writers take rows in one order, counter rows in (owner,
kind, window) order and then lease rows, so none can deadlock another: each test holds
a settlement's first locks, lets the other writer block on them, then lets the
settlement take the rest. Taken in the other order, PostgreSQL would abort one of the
two (a 500 for an admission)."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from gateway.db import Database, migrate
from gateway.tenancy.quota import QuotaLimits
from gateway.tenancy.quota.postgres import PostgresQuotaStore, apply_settlements
from tests.conftest import PG_URL

pytestmark = pytest.mark.pg

NOW = 1_800_000_000.0 + 5  # 5 s into a minute
LOCK = 'SELECT 1 FROM quota_counters WHERE tenant_id = $1 ORDER BY kind, "window" FOR UPDATE'


async def _blocked_by(db: Database, conn: asyncpg.Connection) -> None:
    """Wait until another session waits for a lock `conn` holds."""
    pid = await conn.fetchval("SELECT pg_backend_pid()")
    async with db.driver() as watcher:
        for _ in range(500):
            waiting = "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))"
            if await watcher.fetchval(waiting, pid):
                return
            await asyncio.sleep(0.01)
    raise AssertionError("nothing waited for the held counter rows")


async def test_reclaim_waits_for_a_slow_gateways_settlement(pg_schema):
    """A gateway thought dead is only slow: its settlement holds the tenant's counters
    and then wants its lease, which the reclaim must not hold meanwhile."""
    db = Database(PG_URL, pg_schema)
    await migrate(db)
    slow, alive = PostgresQuotaStore(db), PostgresQuotaStore(db)
    res = await slow.admit("t", QuotaLimits(max_concurrent=2), 1, NOW)
    settlement = slow.settlement(res, 1)
    assert settlement is not None
    async with db.driver() as conn, conn.transaction():  # the slow one's usage commit
        await conn.execute(LOCK, "t")
        reclaim = asyncio.create_task(alive.reclaim_stale(NOW + 600))
        await _blocked_by(db, conn)
        await apply_settlements(conn, [settlement])
    assert await reclaim == 0  # settled first: the lease it found held nothing
    used = await alive.used("t", NOW)
    assert (used["concurrent"], used["requests"]) == (0, 1)
    async with db.driver() as conn:
        assert await conn.fetchval("SELECT count(*) FROM quota_leases") == 0
    await db.close()


async def test_a_batch_of_several_keys_takes_its_counters_first(pg_schema):
    """One admission call carries the tenant's requests through keys a and b; a
    settlement of key b holds b's counters (`key_b` sorts before the tenant's `t`) and
    then wants the tenant's, which the batch must not have taken before b's."""
    db = Database(PG_URL, pg_schema)
    await migrate(db)
    store = PostgresQuotaStore(db)
    tenant = QuotaLimits(max_concurrent=10)

    def key(key_id: str) -> QuotaLimits:
        return QuotaLimits.with_key(tenant, key_id, QuotaLimits(max_concurrent=5))

    earlier = await store.admit("t", key("key_b"), 1, NOW)
    settlement = store.settlement(earlier, 1)
    assert settlement is not None
    async with db.driver() as conn, conn.transaction():  # the usage commit settling it
        await conn.execute(LOCK, "key_b")
        # admitted in one call: both are queued before the call goes out
        batch = asyncio.gather(
            store.admit("t", key("key_a"), 1, NOW), store.admit("t", key("key_b"), 1, NOW)
        )
        await _blocked_by(db, conn)
        await apply_settlements(conn, [settlement])
    await batch
    for owner, concurrent in (("t", 2), ("key_a", 1), ("key_b", 1)):
        assert (await store.used(owner, NOW))["concurrent"] == concurrent, owner
    await db.close()
