"""Batches and their lines in the database: every change of a batch's state is a
transaction, so a gateway killed at any point resumes each batch where its rows say.
A line's answer and the batch's counts change together, and only from pending: a line
answered twice (run again after a crash) counts once."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from sqlalchemy import func, select, tuple_, update

from gateway.batches.jsonl import InputLine
from gateway.db import Database
from gateway.db.batch_tables import Batch, BatchLine

WINDOW_S = {"24h": 24 * 3600.0}
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
CANCELLABLE = ("validating", "in_progress")
PENDING, DONE, FAILED, EXPIRED, CANCELLED = "pending", "done", "failed", "expired", "cancelled"
INSERT_ROWS = 1000  # lines inserted a statement at a time


async def create(
    db: Database,
    tenant_id: str,
    key_id: str,
    endpoint: str,
    input_file_id: str,
    window: str,
    metadata: dict[str, str],
    lines: list[InputLine],
) -> Batch:
    now = time.time()
    batch = Batch(
        id="batch_" + secrets.token_hex(12),
        tenant_id=tenant_id,
        key_id=key_id,
        endpoint=endpoint,
        input_file_id=input_file_id,
        completion_window=window,
        status="validating",
        batch_metadata=metadata or None,
        created_at=now,
        expires_at=now + WINDOW_S[window],
        total=len(lines),
        completed=0,
        failed=0,
    )
    rows = [
        {"batch_id": batch.id, "line": i, "custom_id": ln.custom_id, "body": json.dumps(ln.body)}
        for i, ln in enumerate(lines)
    ]
    async with db.session() as s, s.begin():
        s.add(batch)
        await s.flush()
        for start in range(0, len(rows), INSERT_ROWS):
            chunk = [r | {"state": PENDING} for r in rows[start : start + INSERT_ROWS]]
            await s.execute(BatchLine.__table__.insert(), chunk)
    return batch


async def get(db: Database, batch_id: str, tenant_id: str | None = None) -> Batch | None:
    """The batch; None where `tenant_id` is given and it is another tenant's."""
    async with db.session() as s:
        row = await s.get(Batch, batch_id)
    if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
        return None
    return row


async def page(
    db: Database, tenant_id: str | None, after: str | None, limit: int
) -> tuple[list[Batch], bool]:
    """Newest first, up to `limit` after the batch `after`; and whether more follow.
    `tenant_id` None: every tenant's (the operator's CLI)."""
    q = select(Batch)
    if tenant_id is not None:
        q = q.where(Batch.tenant_id == tenant_id)
    async with db.session() as s:
        if after is not None and (mark := await s.get(Batch, after)) is not None:
            q = q.where(tuple_(Batch.created_at, Batch.id) < (mark.created_at, mark.id))
        q = q.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)
        rows = list((await s.scalars(q)).all())
    return rows[:limit], len(rows) > limit


async def cancel(db: Database, batch_id: str) -> bool:
    """Cancelling from validating or in progress; False: its status is past that."""
    async with db.session() as s, s.begin():
        done = await s.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.status.in_(CANCELLABLE))
            .values(status="cancelling", cancelling_at=time.time())
        )
    return bool(done.rowcount)


async def active(db: Database) -> list[Batch]:
    async with db.session() as s:
        q = select(Batch).where(Batch.status.in_(ACTIVE)).order_by(Batch.created_at)
        return list((await s.scalars(q)).all())


async def set_status(db: Database, batch_id: str, status: str, **values: Any) -> None:
    async with db.session() as s, s.begin():
        await s.execute(update(Batch).where(Batch.id == batch_id).values(status=status, **values))


async def pending(db: Database, batch_id: str, skip: set[int], limit: int) -> list[BatchLine]:
    """Up to `limit` lines not answered yet, in file order, but those in `skip` (running)."""
    q = select(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.state == PENDING)
    q = q.order_by(BatchLine.line).limit(limit + len(skip))
    async with db.session() as s:
        rows = (await s.scalars(q)).all()
    return [r for r in rows if r.line not in skip][:limit]


async def answer(db: Database, batch_id: str, line: int, state: str, result: dict) -> None:
    """A line's answer and the batch's count, together, once."""
    async with db.session() as s, s.begin():
        changed = await s.execute(
            update(BatchLine)
            .where(
                BatchLine.batch_id == batch_id,
                BatchLine.line == line,
                BatchLine.state == PENDING,
            )
            .values(state=state, result=json.dumps(result))
        )
        if changed.rowcount:
            count = Batch.completed if state == DONE else Batch.failed
            await s.execute(
                update(Batch).where(Batch.id == batch_id).values({count.key: count + 1})
            )


async def close_rest(db: Database, batch_id: str, state: str, skip: set[int]) -> list[BatchLine]:
    """Every pending line but those running (`skip`) given `state` (expired, cancelled,
    failed); the lines it closed. Failed ones count as failed."""
    async with db.session() as s, s.begin():
        q = select(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.state == PENDING)
        rows = [r for r in (await s.scalars(q)).all() if r.line not in skip]
        for r in rows:
            r.state = state
        if rows and state == FAILED:
            await s.execute(
                update(Batch).where(Batch.id == batch_id).values(failed=Batch.failed + len(rows))
            )
    return rows


async def pending_count(db: Database, batch_id: str) -> int:
    q = select(func.count()).where(BatchLine.batch_id == batch_id, BatchLine.state == PENDING)
    async with db.session() as s:
        return int((await s.execute(q)).scalar_one())


async def lines(db: Database, batch_id: str) -> list[BatchLine]:
    q = select(BatchLine).where(BatchLine.batch_id == batch_id).order_by(BatchLine.line)
    async with db.session() as s:
        return list((await s.scalars(q)).all())
