"""Quota counters in PostgreSQL, so that N gateways enforce one limit, not N.

Admission is one conditional upsert of every counter the request moves, in one
transaction: a row is only incremented `WHERE value + amount <= limit`, and the
tenant's advisory lock makes concurrent gateways queue on the same tenant. If fewer
rows come back than were offered, a limit was hit and the transaction rolls back whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

from sqlalchemy import BigInteger, bindparam, delete, select, text, update

from gateway.db import Database, QuotaCounter, QuotaLease
from gateway.quota.limits import (
    CONCURRENT,
    DAILY,
    MONTHLY,
    REQUESTS,
    TOKENS,
    QuotaExceeded,
    QuotaLimits,
    Reservation,
    amounts,
    windows_at,
)

KINDS = (REQUESTS, TOKENS, DAILY, MONTHLY, CONCURRENT)
# A gateway killed with -9 holds its tenants' concurrency slots until another one sees
# its heartbeat go stale: at most HEARTBEAT_S + STALE_AFTER_S. Shorter would let a gateway
# whose loop stalls for longer than STALE_AFTER_S lose slots it still uses (design.md).
HEARTBEAT_S = 5.0
STALE_AFTER_S = 20.0

# Admission and settlement each take the tenant's advisory lock first: one tenant's
# counter rows are then always locked by one transaction at a time, in no order that
# could deadlock, and each is one statement (one round trip) after the lock.
_TENANT_LOCK = text("SELECT pg_advisory_xact_lock(hashtext(:t))")

_ADMIT = text("""
WITH taken AS (
  INSERT INTO quota_counters (tenant_id, kind, "window", value, limit_value) VALUES
    (:t, 'requests', :wm, :r, :l_requests), (:t, 'tokens', :wm, :n, :l_tokens),
    (:t, 'daily', :wd, :n, :l_daily), (:t, 'monthly', :wmo, :n, :l_monthly),
    (:t, 'concurrent', 0, :r, :l_concurrent)
  ON CONFLICT (tenant_id, kind, "window") DO UPDATE
    SET value = quota_counters.value + excluded.value, limit_value = excluded.limit_value
    WHERE excluded.limit_value IS NULL
       OR quota_counters.value + excluded.value <= excluded.limit_value
  RETURNING kind, value
), lease AS (
  INSERT INTO quota_leases (instance_id, tenant_id, held, heartbeat)
  SELECT :i, :t, :r, :now WHERE (SELECT count(*) FROM taken) = 5
  ON CONFLICT (instance_id, tenant_id) DO UPDATE
    SET held = quota_leases.held + excluded.held, heartbeat = excluded.heartbeat
)
SELECT kind, value FROM taken
""").bindparams(
    bindparam("wm", type_=BigInteger), bindparam("wd", type_=BigInteger),
    bindparam("wmo", type_=BigInteger), bindparam("n", type_=BigInteger),
    bindparam("r", type_=BigInteger),
    *(bindparam("l_" + k, type_=BigInteger) for k in KINDS),
)  # fmt: skip

_SETTLE = text("""
WITH counters AS (
  UPDATE quota_counters SET value = quota_counters.value + d.delta
  FROM (VALUES ('tokens', CAST(:wm AS BIGINT), CAST(:dt AS BIGINT)), ('daily', :wd, :dt),
               ('monthly', :wmo, :dt), ('concurrent', 0, -CAST(:r AS BIGINT)),
               ('requests', :wm, :dr))
       AS d(kind, win, delta)
  WHERE quota_counters.tenant_id = :t AND quota_counters.kind = d.kind
    AND quota_counters."window" = d.win AND d.delta <> 0
  RETURNING 1
)
UPDATE quota_leases SET held = held - :r WHERE instance_id = :i AND tenant_id = :t
""").bindparams(
    bindparam("wm", type_=BigInteger), bindparam("wd", type_=BigInteger),
    bindparam("wmo", type_=BigInteger), bindparam("dt", type_=BigInteger),
    bindparam("dr", type_=BigInteger), bindparam("r", type_=BigInteger),
)  # fmt: skip


class PostgresQuotaStore:
    def __init__(self, db: Database) -> None:
        assert db.is_postgres
        self.db = db
        self.instance_id = secrets.token_hex(8)
        self._heartbeat: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.reclaim_stale(time.time())
        self._heartbeat = asyncio.create_task(self._beat(), name="quota-lease-heartbeat")

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            now = time.time()
            async with self.db.session() as session, session.begin():
                await session.execute(
                    update(QuotaLease)
                    .where(QuotaLease.instance_id == self.instance_id)
                    .values(heartbeat=now)
                )
            await self.reclaim_stale(now)

    async def reclaim_stale(self, now: float) -> int:
        """Give back the concurrency slots of gateways silent for STALE_AFTER_S."""
        reclaimed = 0
        async with self.db.session() as session, session.begin():
            stale = (
                await session.scalars(
                    select(QuotaLease)
                    .where(
                        QuotaLease.heartbeat < now - STALE_AFTER_S,
                        QuotaLease.instance_id != self.instance_id,
                    )
                    .with_for_update(skip_locked=True)
                )
            ).all()
            for lease in stale:
                if lease.held:
                    await session.execute(
                        update(QuotaCounter)
                        .where(
                            QuotaCounter.tenant_id == lease.tenant_id,
                            QuotaCounter.kind == CONCURRENT,
                            QuotaCounter.window == 0,
                        )
                        .values(value=QuotaCounter.value - lease.held)
                    )
                    reclaimed += lease.held
                await session.delete(lease)
        return reclaimed

    async def admit(
        self, tenant_id: str, limits: QuotaLimits, tokens: int, now: float, requests: int = 1
    ) -> Reservation:
        w = windows_at(now)
        wanted = amounts(requests, tokens)
        for kind, amount in wanted.items():
            limit = limits.limit_for(kind)
            if limit is not None and amount > limit:  # a fresh row is inserted unchecked
                raise QuotaExceeded(kind, limit, 0, amount, w.reset_s(kind))
        params = {"t": tenant_id, "i": self.instance_id, "now": now, "n": tokens,
                  "r": requests, "wm": w.minute, "wd": w.day, "wmo": w.month}  # fmt: skip
        for kind in KINDS:
            params["l_" + kind] = limits.limit_for(kind)
        async with self.db.engine.begin() as conn:
            await conn.execute(_TENANT_LOCK, params)
            taken = {kind: value for kind, value in (await conn.execute(_ADMIT, params)).all()}
            if len(taken) < len(wanted):
                refused = next(k for k in KINDS if k not in taken)
                used = await conn.scalar(
                    select(QuotaCounter.value).where(
                        QuotaCounter.tenant_id == tenant_id,
                        QuotaCounter.kind == refused,
                        QuotaCounter.window == w.of(refused),
                    )
                )
                await conn.rollback()
                raise QuotaExceeded(refused, limits.limit_for(refused) or 0, used or 0,
                                    wanted[refused], w.reset_s(refused))  # fmt: skip
        remaining = {
            kind: None if limits.limit_for(kind) is None else limits.limit_for(kind) - taken[kind]
            for kind in (REQUESTS, TOKENS)
        }
        return Reservation(tenant_id, tokens, w, remaining, limits, requests)

    async def settle(self, res: Reservation, used_tokens: int, count_request: bool = True) -> None:
        if res.settled:
            return
        res.settled = True
        w = res.windows
        params = {"t": res.tenant_id, "i": self.instance_id, "dt": used_tokens - res.tokens,
                  "dr": 0 if count_request else -res.requests, "r": res.requests,
                  "wm": w.minute, "wd": w.day, "wmo": w.month}  # fmt: skip
        async with self.db.engine.begin() as conn:
            await conn.execute(_TENANT_LOCK, params)
            await conn.execute(_SETTLE, params)

    async def used(self, tenant_id: str, now: float) -> dict[str, int]:
        w = windows_at(now)
        async with self.db.session() as session:
            rows = (
                await session.execute(
                    select(QuotaCounter.kind, QuotaCounter.window, QuotaCounter.value).where(
                        QuotaCounter.tenant_id == tenant_id
                    )
                )
            ).all()
        current = {kind: value for kind, window, value in rows if window == w.of(kind)}
        return {kind: current.get(kind, 0) for kind in KINDS}

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        async with self.db.session() as session, session.begin():
            await session.execute(
                delete(QuotaLease).where(
                    QuotaLease.instance_id == self.instance_id, QuotaLease.held == 0
                )
            )
