"""Quota counters in PostgreSQL, so that N gateways enforce one limit, not N.

Admission is one conditional upsert of every counter the request moves, in one
transaction: a row is only incremented `WHERE value + amount <= limit`, and the row
lock makes concurrent gateways queue on the same tenant's counters. If fewer rows
come back than were offered, a limit was hit and the transaction rolls back whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

from sqlalchemy import and_, delete, or_, select, update
from sqlalchemy.dialects.postgresql import insert

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
    windows_at,
)

KINDS = (REQUESTS, TOKENS, DAILY, MONTHLY, CONCURRENT)
HEARTBEAT_S = 10.0
STALE_AFTER_S = 45.0


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
        self, tenant_id: str, limits: QuotaLimits, tokens: int, now: float
    ) -> Reservation:
        w = windows_at(now)
        wanted = {REQUESTS: 1, TOKENS: tokens, DAILY: tokens, MONTHLY: tokens, CONCURRENT: 1}
        for kind, amount in wanted.items():
            limit = limits.limit_for(kind)
            if limit is not None and amount > limit:  # a fresh row is inserted unchecked
                raise QuotaExceeded(kind, limit, 0, amount, w.reset_s(kind))
        rows = [
            {
                "tenant_id": tenant_id,
                "kind": kind,
                "window": w.of(kind),
                "value": amount,
                "limit_value": limits.limit_for(kind),
            }
            for kind, amount in wanted.items()
        ]
        stmt = insert(QuotaCounter).values(rows)
        stmt = stmt.on_conflict_do_update(
            index_elements=["tenant_id", "kind", "window"],
            set_={
                "value": QuotaCounter.value + stmt.excluded.value,
                "limit_value": stmt.excluded.limit_value,
            },
            where=or_(
                stmt.excluded.limit_value.is_(None),
                QuotaCounter.value + stmt.excluded.value <= stmt.excluded.limit_value,
            ),
        ).returning(QuotaCounter.kind, QuotaCounter.value)
        lease = insert(QuotaLease).values(
            instance_id=self.instance_id, tenant_id=tenant_id, held=1, heartbeat=now
        )
        lease = lease.on_conflict_do_update(
            index_elements=["instance_id", "tenant_id"],
            set_={"held": QuotaLease.held + 1, "heartbeat": lease.excluded.heartbeat},
        )
        async with self.db.session() as session, session.begin():
            taken = {kind: value for kind, value in (await session.execute(stmt)).all()}
            if len(taken) == len(rows):
                await session.execute(lease)
            else:
                await session.rollback()
                refused = next(k for k in KINDS if k not in taken)
                used = await self._value(tenant_id, refused, w.of(refused))
                raise QuotaExceeded(
                    refused,
                    limits.limit_for(refused) or 0,
                    used,
                    wanted[refused],
                    w.reset_s(refused),
                )
        remaining = {
            kind: None if limits.limit_for(kind) is None else limits.limit_for(kind) - taken[kind]
            for kind in (REQUESTS, TOKENS)
        }
        return Reservation(tenant_id, tokens, w, remaining, limits)

    async def settle(self, res: Reservation, used_tokens: int, count_request: bool = True) -> None:
        if res.settled:
            return
        res.settled = True
        w, delta = res.windows, used_tokens - res.tokens
        changes = [(TOKENS, delta), (DAILY, delta), (MONTHLY, delta), (CONCURRENT, -1)]
        if not count_request:
            changes.append((REQUESTS, -1))
        async with self.db.session() as session, session.begin():
            for kind, amount in changes:
                if amount == 0:
                    continue
                await session.execute(
                    update(QuotaCounter)
                    .where(
                        and_(
                            QuotaCounter.tenant_id == res.tenant_id,
                            QuotaCounter.kind == kind,
                            QuotaCounter.window == w.of(kind),
                        )
                    )
                    .values(value=QuotaCounter.value + amount)
                )
            await session.execute(
                update(QuotaLease)
                .where(
                    QuotaLease.instance_id == self.instance_id,
                    QuotaLease.tenant_id == res.tenant_id,
                )
                .values(held=QuotaLease.held - 1)
            )

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

    async def _value(self, tenant_id: str, kind: str, window: int) -> int:
        async with self.db.session() as session:
            value = await session.scalar(
                select(QuotaCounter.value).where(
                    QuotaCounter.tenant_id == tenant_id,
                    QuotaCounter.kind == kind,
                    QuotaCounter.window == window,
                )
            )
        return value or 0
