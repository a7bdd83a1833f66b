"""Batches and their lines in the database: every change of a batch's state is a
transaction, so a gateway killed at any point resumes each batch where its rows say.
A line's answer and the batch's counts change together, and only from pending: a line
answered twice (run again after a crash) counts once.

What a batch's every line or poll does (`get`, `pending`, `answer`, ...) is a prepared
Core statement through gateway.batches.writes, on SQLite on the event loop's thread, and
comes back as detached rows of the ORM's classes: the ORM's session through aiosqlite
cost the loop 1.2 to 1.8 ms of CPU a call, beside the engine (docs/PERF.md, issue 50)."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from sqlalchemy import (
    Connection,
    Integer,
    bindparam,
    func,
    insert,
    inspect,
    or_,
    select,
    tuple_,
    update,
)

from gateway.batches.jsonl import InputLine
from gateway.batches.writes import read, write
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
    values = {
        "id": "batch_" + secrets.token_hex(12),
        "tenant_id": tenant_id,
        "key_id": key_id,
        "endpoint": endpoint,
        "input_file_id": input_file_id,
        "completion_window": window,
        "status": "validating",
        "batch_metadata": metadata or None,
        "created_at": now,
        "expires_at": now + WINDOW_S[window],
        "total": len(lines),
        "completed": 0,
        "failed": 0,
    }
    rows = [
        {"batch_id": values["id"], "line": i, "custom_id": ln.custom_id,
         "body": json.dumps(ln.body), "state": PENDING}
        for i, ln in enumerate(lines)
    ]  # fmt: skip

    def insert_all(conn: Connection) -> None:
        conn.execute(insert(Batch).values(values))  # by attribute: `batch_metadata`
        for start in range(0, len(rows), INSERT_ROWS):
            conn.execute(insert(BatchLine), rows[start : start + INSERT_ROWS])

    await write(db, insert_all)
    return Batch(**values)


def _columns(model: type) -> list:
    """Every column of `model`, named as its attribute (Batch.batch_metadata is the column
    `metadata`), so that a row builds the model's object: `model(**row._mapping)`."""
    return [prop.columns[0].label(prop.key) for prop in inspect(model).column_attrs]


_BATCH, _LINE = select(*_columns(Batch)), select(*_columns(BatchLine))
_GET = _BATCH.where(Batch.id == bindparam("batch"))
_ACTIVE = _BATCH.where(Batch.status.in_(ACTIVE)).order_by(Batch.created_at)
_OF_BATCH = BatchLine.batch_id == bindparam("batch")
_LINES = _LINE.where(_OF_BATCH).order_by(BatchLine.line)
_PENDING = _LINE.where(_OF_BATCH, BatchLine.state == PENDING).order_by(BatchLine.line)
_PENDING = _PENDING.limit(bindparam("n", type_=Integer))
_PENDING_COUNT = select(func.count()).where(_OF_BATCH, BatchLine.state == PENDING)
_ANSWER = (
    update(BatchLine)
    .where(_OF_BATCH, BatchLine.line == bindparam("at"), BatchLine.state == PENDING)
    .values(state=bindparam("new_state"), result=bindparam("new_result"))
)
_COUNT = {
    state: update(Batch).where(Batch.id == bindparam("batch")).values({c.key: c + 1})
    for state, c in ((DONE, Batch.completed), (FAILED, Batch.failed))
}


async def get(db: Database, batch_id: str, tenant_id: str | None = None) -> Batch | None:
    """The batch; None where `tenant_id` is given and it is another tenant's."""
    row = await read(db, lambda conn: conn.execute(_GET, {"batch": batch_id}).first())
    if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
        return None
    return Batch(**row._mapping)


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
    stmt = (
        update(Batch)
        .where(Batch.id == batch_id, Batch.status.in_(CANCELLABLE))
        .values(status="cancelling", cancelling_at=time.time())
    )
    return bool(await write(db, lambda conn: conn.execute(stmt).rowcount))


async def claim(db: Database, batch_id: str, runner: str, now: float, lease_s: float) -> bool:
    """Whether `runner` holds the batch for `lease_s` from `now`: it held it, nobody
    did, or the holder's lease lapsed."""
    stmt = (
        update(Batch)
        .where(
            Batch.id == batch_id,
            or_(Batch.runner.is_(None), Batch.runner == runner, Batch.lease_until < now),
        )
        .values(runner=runner, lease_until=now + lease_s)
    )
    return bool(await write(db, lambda conn: conn.execute(stmt).rowcount))


async def active(db: Database) -> list[Batch]:
    rows = await read(db, lambda conn: conn.execute(_ACTIVE).all())
    return [Batch(**row._mapping) for row in rows]


async def set_status(db: Database, batch_id: str, status: str, **values: Any) -> None:
    stmt = update(Batch).where(Batch.id == batch_id).values(status=status, **values)
    await write(db, lambda conn: conn.execute(stmt))


async def start(db: Database, batch_id: str, now: float) -> bool:
    """Validating to in progress; False: it is not validating now (cancelled since the
    runner read it, which must not undo the cancel)."""
    stmt = (
        update(Batch)
        .where(Batch.id == batch_id, Batch.status == "validating")
        .values(status="in_progress", in_progress_at=now)
    )
    return bool(await write(db, lambda conn: conn.execute(stmt).rowcount))


async def pending(db: Database, batch_id: str, skip: set[int], limit: int) -> list[BatchLine]:
    """Up to `limit` lines not answered yet, in file order, but those in `skip` (running).

    `skip` as it is now, before the read: a running line answered while the read waits
    leaves the runner's set after its answer is written, and a read that began before
    that write sees it pending; skipping by the set after the read ran such lines twice
    (54 runs for 48 lines in studies.batch_yield on the gpu engine)."""
    skip = set(skip)
    values = {"batch": batch_id, "n": limit + len(skip)}
    rows = await read(db, lambda conn: conn.execute(_PENDING, values).all())
    return [BatchLine(**r._mapping) for r in rows if r.line not in skip][:limit]


async def answer(db: Database, batch_id: str, line: int, state: str, result: dict) -> None:
    """A line's answer and the batch's count, together, once; on SQLite on this thread
    (one small transaction, written as soon as the line ends: a gateway killed after its
    usage row's commit loses no more answers than before)."""
    mark = {"batch": batch_id, "at": line, "new_state": state, "new_result": json.dumps(result)}

    def both(conn: Connection) -> None:
        if conn.execute(_ANSWER, mark).rowcount:
            conn.execute(_COUNT[state], {"batch": batch_id})

    await write(db, both, inline=True)


async def close_rest(db: Database, batch_id: str, state: str, skip: set[int]) -> int:
    """Every pending line but those running (`skip`) given `state` (expired, cancelled,
    failed); how many. Failed ones count as failed."""
    close = update(BatchLine).where(
        BatchLine.batch_id == batch_id, BatchLine.state == PENDING, BatchLine.line.not_in(skip)
    )

    def closed(conn: Connection) -> int:
        n = conn.execute(close.values(state=state)).rowcount
        if n and state == FAILED:
            failed = Batch.failed + n
            conn.execute(update(Batch).where(Batch.id == batch_id).values(failed=failed))
        return n

    return await write(db, closed)


async def pending_count(db: Database, batch_id: str) -> int:
    values = {"batch": batch_id}
    return int(await read(db, lambda conn: conn.execute(_PENDING_COUNT, values).scalar_one()))


async def lines(db: Database, batch_id: str) -> list[BatchLine]:
    rows = await read(db, lambda conn: conn.execute(_LINES, {"batch": batch_id}).all())
    return [BatchLine(**row._mapping) for row in rows]
