"""Quota counters in PostgreSQL, so that N gateways enforce one limit, not N.

Admission is one call of the `kvgate_admit` function (migration 0009) in autocommit: one
round trip, no transaction statements around it. It takes the tenant's advisory lock
(gateways queue on the same tenant; a key's requests take its tenant's lock too) and
admits each request of its batch all or nothing. Requests of one tenant that arrive
while its previous call is out go together in the next, so under load one statement
admits many, each exactly as if alone. Settlement is not a round trip of its own: the
request's `Settlement` rides with its usage row and `apply_settlements` runs in that
row's group commit, so the counters and the row are durable together. Every writer
takes counter rows in (owner, kind, window) order, and all it needs of them before any
lease row, so none can deadlock another.
A call whose reply is lost (the connection fails after it went out) may have committed:
its requests were answered with an error, so whatever it admitted is given back before
the tenant's next call (`_recover`, migration 0009), not left held until a restart.
The counter and lease tables' `tenant_id` column holds the owner: a tenant's id or a key's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import secrets
import time
from dataclasses import dataclass, field

import asyncpg
from sqlalchemy import delete, select, update

from gateway.db import Database, QuotaCounter, QuotaLease
from gateway.tenancy.quota.limits import (
    CONCURRENT,
    KINDS,
    REQUESTS,
    TOKENS,
    QuotaExceeded,
    QuotaLimits,
    Reservation,
    Settlement,
    amounts,
    checked_limit,
    least_remaining,
    windows_at,
)

log = logging.getLogger(__name__)

# A gateway killed with -9 holds its tenants' concurrency slots until another one sees
# its heartbeat go stale: at most HEARTBEAT_S + STALE_AFTER_S. Shorter would let a gateway
# whose loop stalls for longer than STALE_AFTER_S lose slots it still uses (design.md).
HEARTBEAT_S = 5.0
STALE_AFTER_S = 20.0
# the most requests one admission call carries
MAX_BATCH = 256

# on the bare asyncpg connection (Database.driver): jsonb goes and comes as text
_ADMIT = "SELECT kvgate_admit($1, $2::jsonb, $3, $4, $5)"
# under the tenant's advisory lock: no call of this gateway's can be half done meanwhile
_LOCK_TENANT = "SELECT pg_advisory_xact_lock(hashtext($1))"
_LAST_CALL = (
    "SELECT last_call, last_admitted FROM quota_leases WHERE instance_id = $1 AND tenant_id = $2"
)
_SETTLE = "SELECT kvgate_settle($1::jsonb, $2::jsonb, $3)"


async def apply_settlements(conn: asyncpg.Connection, settlements: list[Settlement]) -> None:
    """Apply settlements inside the caller's transaction (the usage writer's commit), or
    alone: each instance's are one statement."""
    by_instance: dict[str, list[Settlement]] = {}
    for s in settlements:
        by_instance.setdefault(s.instance_id, []).append(s)
    for instance, group in by_instance.items():
        deltas = sorted(d for s in group for d in s.deltas)
        slots = sorted(slot for s in group for slot in s.slots)
        await conn.execute(_SETTLE, json.dumps(deltas), json.dumps(slots), instance)


@dataclass
class _Asked:
    """One admission waiting for its tenant's next call."""

    rows: list[list]  # [owner, kind, window, amount, limit | None], in counter order
    slots: list[list]  # [owner, slots] for the leases
    now: float  # the lease's heartbeat
    reservation: Reservation  # what it takes, should the reply be lost
    done: asyncio.Future[dict] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class PostgresQuotaStore:
    def __init__(self, db: Database) -> None:
        assert db.is_postgres
        self.db = db
        self.instance_id = secrets.token_hex(8)
        self._heartbeat: asyncio.Task[None] | None = None
        self._queued: dict[str, list[_Asked]] = {}  # per tenant, for its next call
        self._calling: set[str] = set()  # tenants with a call out
        self._call_ids = itertools.count(1)
        # per tenant: a call whose reply was lost (its id, its batch), to look up
        self._unsure: dict[str, tuple[int, list[_Asked]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # held: the loop keeps only weak refs

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
        """Give back the concurrency slots of gateways silent for STALE_AFTER_S.

        Counter rows first, in (owner, kind, window) order, then the leases: the order
        admission and settlement take them in. A gateway thought dead may be only slow,
        and its settlement holds its counters while it waits for its lease."""
        reclaimed = 0
        stale = (
            QuotaLease.heartbeat < now - STALE_AFTER_S,
            QuotaLease.instance_id != self.instance_id,
        )
        async with self.db.session() as session, session.begin():
            # read without locks: which owners' counters to lock
            owners = set((await session.scalars(select(QuotaLease.tenant_id).where(*stale))).all())
            if not owners:
                return 0
            await session.execute(
                select(QuotaCounter.tenant_id)
                .where(
                    QuotaCounter.tenant_id.in_(owners),
                    QuotaCounter.kind == CONCURRENT,
                    QuotaCounter.window == 0,
                )
                .order_by(QuotaCounter.tenant_id)
                .with_for_update()
            )
            leases = (
                await session.scalars(
                    select(QuotaLease)
                    .where(*stale, QuotaLease.tenant_id.in_(owners))
                    .with_for_update(skip_locked=True)
                )
            ).all()
            held: dict[str, int] = {}
            for lease in leases:
                held[lease.tenant_id] = held.get(lease.tenant_id, 0) + lease.held
                await session.delete(lease)
            for owner, slots in sorted(held.items()):
                if slots:
                    await session.execute(
                        update(QuotaCounter)
                        .where(
                            QuotaCounter.tenant_id == owner,
                            QuotaCounter.kind == CONCURRENT,
                            QuotaCounter.window == 0,
                        )
                        .values(value=QuotaCounter.value - slots)
                    )
                    reclaimed += slots
        return reclaimed

    async def admit(
        self,
        tenant_id: str,
        limits: QuotaLimits,
        tokens: int,
        now: float,
        requests: int = 1,
        spend: int = 0,
    ) -> Reservation:
        w = windows_at(now)
        wanted = amounts(requests, tokens, spend, limits.rates)
        scopes = limits.scopes(tenant_id)
        rows = sorted(
            [s.owner, kind, w.of(kind), amount, checked_limit(s.limits, kind, amount)]
            for s in scopes
            for kind, amount in wanted.items()
        )
        reservation = Reservation(tenant_id, tokens, w, {}, limits, requests, spend)
        # no slots without rates, but the lease row all the same: it records the call
        slots = requests if limits.rates else 0
        asked = _Asked(rows, [[s.owner, slots] for s in scopes], now, reservation)
        self._queued.setdefault(tenant_id, []).append(asked)
        if tenant_id not in self._calling:
            self._calling.add(tenant_id)
            task = asyncio.create_task(self._call(tenant_id), name="quota-admit")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            result = await asyncio.shield(asked.done)
        except asyncio.CancelledError:
            asked.done.add_done_callback(functools.partial(self._release_orphan, reservation))
            raise
        if "refused" in result:
            owner, kind, used = result["refused"]
            scope = next(s for s in scopes if s.owner == owner)
            limit = scope.limits.limit_for(kind) or 0
            raise QuotaExceeded(kind, limit, used, wanted[kind], w.reset_s(kind), scope.who)
        taken = {(owner, kind): value for owner, kind, value in result["taken"]}
        reservation.remaining = {
            kind: least_remaining(scopes, kind, {s.owner: taken[(s.owner, kind)] for s in scopes})
            for kind in (REQUESTS, TOKENS)
            if kind in wanted
        }
        return reservation

    async def _call(self, tenant_id: str) -> None:
        """Admit the tenant's queued requests, a call at a time, until none are left."""
        try:
            while queued := self._queued.pop(tenant_id, None):
                batch, rest = queued[:MAX_BATCH], queued[MAX_BATCH:]
                if rest:
                    self._queued[tenant_id] = rest + self._queued.get(tenant_id, [])
                call_id = next(self._call_ids)
                try:
                    if tenant_id in self._unsure:
                        await self._recover(tenant_id)
                    results = await self._admit_batch(tenant_id, batch, call_id)
                except Exception as e:  # every waiter of the call hears of it
                    for a in batch:
                        a.done.set_exception(e)
                    continue
                for a, result in zip(batch, results, strict=True):
                    a.done.set_result(result)
        finally:
            self._calling.discard(tenant_id)

    async def _admit_batch(self, tenant_id: str, batch: list[_Asked], call_id: int) -> list:
        body = json.dumps([{"rows": a.rows, "leases": a.slots} for a in batch])
        now = max(a.now for a in batch)
        try:
            async with self.db.driver() as conn:  # autocommit: one round trip
                raw = await conn.fetchval(_ADMIT, tenant_id, body, self.instance_id, now, call_id)
        except BaseException:
            # perhaps sent and committed, the reply lost (asyncpg reports a dropped
            # connection as a PostgresError too): find out before the next call
            self._unsure[tenant_id] = (call_id, batch)
            raise
        return json.loads(raw)

    async def _recover(self, tenant_id: str) -> None:
        """Whether the tenant's call whose reply was lost committed; if it did, settle
        each request it admitted as unused (their callers were answered with an error).
        Under the tenant's advisory lock, so the lost call cannot still be running."""
        call_id, batch = self._unsure[tenant_id]
        async with self.db.driver() as conn, conn.transaction():
            await conn.execute(_LOCK_TENANT, tenant_id)
            row = await conn.fetchrow(_LAST_CALL, self.instance_id, tenant_id)
            if row is not None and row["last_call"] == call_id:
                admitted = [batch[i].reservation for i in json.loads(row["last_admitted"])]
                settlements = [self.settlement(r, 0, count_request=False) for r in admitted]
                await apply_settlements(conn, [s for s in settlements if s is not None])
                log.warning(
                    "quota: gave back %d admission(s) of tenant %s whose reply was lost",
                    len(admitted),
                    tenant_id,
                )
        del self._unsure[tenant_id]

    def _release_orphan(self, res: Reservation, fut: asyncio.Future[dict]) -> None:
        """Its waiter was cancelled while the call was out: if the database admitted it
        all the same, give everything back."""
        if fut.cancelled() or fut.exception() is not None or "refused" in fut.result():
            return
        task = asyncio.ensure_future(self.settle(res, 0, count_request=False))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def settlement(
        self, res: Reservation, used_tokens: int, count_request: bool = True, used_spend: int = 0
    ) -> Settlement | None:
        """What settling `res` moves, to be applied in its usage row's commit."""
        if res.settled:
            return None
        res.settled = True
        held = res.requests if res.limits.rates else 0
        slots = [(owner, held) for owner in sorted(res.owners())]
        deltas = res.deltas(used_tokens, count_request, used_spend)
        return Settlement(self.instance_id, deltas, slots)

    async def settle(
        self, res: Reservation, used_tokens: int, count_request: bool = True, used_spend: int = 0
    ) -> None:
        settlement = self.settlement(res, used_tokens, count_request, used_spend)
        if settlement is not None:
            async with self.db.driver() as conn:
                await apply_settlements(conn, [settlement])

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
