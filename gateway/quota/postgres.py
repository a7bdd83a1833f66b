"""Quota counters in PostgreSQL, so that N gateways enforce one limit, not N.

Admission is one conditional upsert of every counter the request moves (its tenant's,
and its key's where the key has limits), in one transaction: a row is only incremented
`WHERE value + amount <= limit`, and the tenant's advisory lock makes concurrent gateways
queue on the same tenant (a key's requests all take its tenant's lock too). If fewer rows
come back than were offered, a limit was hit and the transaction rolls back whole.
The counter and lease tables' `tenant_id` column holds the owner: a tenant's id or a key's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import time

from sqlalchemy import BigInteger, TextClause, bindparam, delete, select, text, update

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
    Windows,
    amounts,
    least_remaining,
    windows_at,
)

KINDS = (REQUESTS, TOKENS, DAILY, MONTHLY, CONCURRENT)
# A gateway killed with -9 holds its tenants' concurrency slots until another one sees
# its heartbeat go stale: at most HEARTBEAT_S + STALE_AFTER_S. Shorter would let a gateway
# whose loop stalls for longer than STALE_AFTER_S lose slots it still uses (design.md).
HEARTBEAT_S = 5.0
STALE_AFTER_S = 20.0

# Admission and settlement each take the tenant's advisory lock first: one tenant's
# counter rows (and its keys') are then always locked by one transaction at a time, in
# no order that could deadlock, and each is one statement (one round trip) after the lock.
_TENANT_LOCK = text("SELECT pg_advisory_xact_lock(hashtext(:t))")

# one owner's five counters, and its lease when all of the request's counters were taken
_COUNTER_ROWS = (
    "(:t{i}, 'requests', :wm, :r, :l{i}_requests), (:t{i}, 'tokens', :wm, :n, :l{i}_tokens), "
    "(:t{i}, 'daily', :wd, :n, :l{i}_daily), (:t{i}, 'monthly', :wmo, :n, :l{i}_monthly), "
    "(:t{i}, 'concurrent', 0, :r, :l{i}_concurrent)"
)
_LEASE = """, lease{i} AS (
  INSERT INTO quota_leases (instance_id, tenant_id, held, heartbeat)
  SELECT :i, :t{i}, :r, :now WHERE (SELECT count(*) FROM taken) = {rows}
  ON CONFLICT (instance_id, tenant_id) DO UPDATE
    SET held = quota_leases.held + excluded.held, heartbeat = excluded.heartbeat
)"""


@functools.cache
def _admit_sql(owners: int) -> TextClause:
    """The admission statement for a tenant alone (1) or a tenant and its key (2)."""
    rows = ",\n    ".join(_COUNTER_ROWS.format(i=i) for i in range(owners))
    leases = "".join(_LEASE.format(i=i, rows=len(KINDS) * owners) for i in range(owners))
    sql = f"""
WITH taken AS (
  INSERT INTO quota_counters (tenant_id, kind, "window", value, limit_value) VALUES
    {rows}
  ON CONFLICT (tenant_id, kind, "window") DO UPDATE
    SET value = quota_counters.value + excluded.value, limit_value = excluded.limit_value
    WHERE excluded.limit_value IS NULL
       OR quota_counters.value + excluded.value <= excluded.limit_value
  RETURNING tenant_id, kind, value
){leases}
SELECT tenant_id, kind, value FROM taken"""
    limits = [bindparam(f"l{i}_{k}", type_=BigInteger) for i in range(owners) for k in KINDS]
    amounts_ = [bindparam(p, type_=BigInteger) for p in ("wm", "wd", "wmo", "n", "r")]
    return text(sql).bindparams(*amounts_, *limits)


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
""").bindparams(*(bindparam(p, type_=BigInteger) for p in ("wm", "wd", "wmo", "dt", "dr", "r")))


def _window_params(w: Windows) -> dict[str, int]:
    return {"wm": w.minute, "wd": w.day, "wmo": w.month}


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
        scopes = limits.scopes(tenant_id)
        params = _window_params(w) | {"i": self.instance_id, "now": now, "n": tokens}
        params["r"] = requests
        for i, scope in enumerate(scopes):
            params[f"t{i}"] = scope.owner
            for kind, amount in wanted.items():
                limit = scope.limits.limit_for(kind)
                if limit is not None and amount > limit:  # a fresh row is inserted unchecked
                    raise QuotaExceeded(kind, limit, 0, amount, w.reset_s(kind), scope.who)
                params[f"l{i}_{kind}"] = limit
        async with self.db.engine.begin() as conn:
            await conn.execute(_TENANT_LOCK, {"t": tenant_id})
            rows = (await conn.execute(_admit_sql(len(scopes)), params)).all()
            taken = {(owner, kind): value for owner, kind, value in rows}
            if len(taken) < len(wanted) * len(scopes):
                scope, refused = next(
                    (s, k) for s in scopes for k in KINDS if (s.owner, k) not in taken
                )
                used = await conn.scalar(
                    select(QuotaCounter.value).where(
                        QuotaCounter.tenant_id == scope.owner,
                        QuotaCounter.kind == refused,
                        QuotaCounter.window == w.of(refused),
                    )
                )
                await conn.rollback()
                limit = scope.limits.limit_for(refused) or 0
                reset_s = w.reset_s(refused)
                raise QuotaExceeded(refused, limit, used or 0, wanted[refused], reset_s, scope.who)
        remaining = {
            kind: least_remaining(scopes, kind, {s.owner: taken[(s.owner, kind)] for s in scopes})
            for kind in (REQUESTS, TOKENS)
        }
        return Reservation(tenant_id, tokens, w, remaining, limits, requests)

    async def settle(self, res: Reservation, used_tokens: int, count_request: bool = True) -> None:
        if res.settled:
            return
        res.settled = True
        w = res.windows
        params = _window_params(w) | {"i": self.instance_id, "r": res.requests}
        params["dt"] = used_tokens - res.tokens
        params["dr"] = 0 if count_request else -res.requests
        async with self.db.engine.begin() as conn:
            await conn.execute(_TENANT_LOCK, {"t": res.tenant_id})
            for owner in res.owners():
                await conn.execute(_SETTLE, params | {"t": owner})

    async def used(self, owner: str, now: float) -> dict[str, int]:
        w = windows_at(now)
        async with self.db.session() as session:
            rows = (
                await session.execute(
                    select(QuotaCounter.kind, QuotaCounter.window, QuotaCounter.value).where(
                        QuotaCounter.tenant_id == owner
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
