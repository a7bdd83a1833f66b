"""The batch store's reads and writes as the runner and the polls use them (issue 50), on
SQLite and PostgreSQL: the prepared Core reads give the objects the ORM's session gives;
a line's answer, written on SQLite on the event loop's own thread, waits out another
thread's write and counts once; a cancel that lands between the runner's read of a
batch and its start is not undone."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from types import SimpleNamespace

from sqlalchemy import inspect, select

from gateway.batches import store
from gateway.batches.files import FileStore
from gateway.batches.runner import BatchRunner, LineAnswer
from gateway.db import Database, migrate
from gateway.db.batch_tables import Batch, BatchLine
from gateway.tenancy.tenants import TenantService


async def _batch(db: Database, n: int = 5, metadata: dict | None = None) -> Batch:
    tenant = await TenantService(db).create_tenant("acme", {}, "test")
    body = {"model": "m", "messages": [{"role": "user", "content": "héllo"}]}
    lines = [store.InputLine(f"c{i}", "/v1/chat/completions", body) for i in range(n)]
    return await store.create(
        db, tenant["id"], "key_1", "/v1/chat/completions", "file-1", "24h", metadata or {}, lines
    )


def _fields(row: object) -> dict:
    return {a.key: getattr(row, a.key) for a in inspect(type(row)).column_attrs}


async def test_the_reads_give_what_the_orm_gives(db) -> None:
    batch = await _batch(db, metadata={"team": "ops"})
    await store.answer(db, batch.id, 1, store.DONE, {"custom_id": "c1", "answer": "é"})
    await store.answer(db, batch.id, 3, store.FAILED, {"custom_id": "c3"})
    errors = [{"code": "budget_exceeded", "message": "out"}]
    await store.set_status(db, batch.id, "in_progress", errors=errors)
    async with db.session() as s:
        orm_batch = await s.get(Batch, batch.id)
        q = select(BatchLine).where(BatchLine.batch_id == batch.id).order_by(BatchLine.line)
        orm_lines = list((await s.scalars(q)).all())
    got = await store.get(db, batch.id, batch.tenant_id)
    assert got is not None and _fields(got) == _fields(orm_batch)
    assert got.batch_metadata == {"team": "ops"} and got.errors == errors
    assert (got.completed, got.failed) == (1, 1)
    assert [_fields(b) for b in await store.active(db)] == [_fields(orm_batch)]
    assert [_fields(x) for x in await store.lines(db, batch.id)] == [_fields(x) for x in orm_lines]
    pending = await store.pending(db, batch.id, {0}, 2)
    assert [_fields(x) for x in pending] == [_fields(orm_lines[2]), _fields(orm_lines[4])]
    assert await store.pending_count(db, batch.id) == 3
    assert await store.get(db, batch.id, "another tenant") is None
    assert await store.get(db, "batch_none") is None


async def test_a_line_answered_twice_counts_once(db) -> None:
    batch = await _batch(db, n=2)
    await store.answer(db, batch.id, 0, store.DONE, {"first": True})
    await store.answer(db, batch.id, 0, store.FAILED, {"again": True})  # run again
    got = await store.get(db, batch.id)
    assert got is not None and (got.completed, got.failed) == (1, 0)
    assert [x.result for x in await store.lines(db, batch.id)] == ['{"first": true}', None]


async def test_an_answer_on_the_loop_waits_out_another_threads_write(tmp_path) -> None:
    """On SQLite a line's answer is written on the event loop's thread: while another
    thread holds the write lock (a batch's claim or status, a large usage commit) it
    waits for it, then commits; nothing is lost or counted twice."""
    path = tmp_path / "batches.db"
    db = Database(f"sqlite+aiosqlite:///{path}")
    await migrate(db)
    try:
        batch = await _batch(db, n=2)
        locked, release = threading.Event(), threading.Event()

        def hold_the_lock() -> None:
            with sqlite3.connect(path) as conn:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("UPDATE batches SET total = total WHERE id = ?", (batch.id,))
                locked.set()
                release.wait(10)

        holder = threading.Thread(target=hold_the_lock)
        holder.start()
        assert locked.wait(10)
        threading.Timer(0.3, release.set).start()
        await store.answer(db, batch.id, 1, store.DONE, {"ok": 1})
        holder.join(10)
        assert release.is_set()  # the answer waited for the other write to end
        got = await store.get(db, batch.id)
        assert got is not None and (got.completed, got.failed) == (1, 0)
        assert [x.state for x in await store.lines(db, batch.id)] == [store.PENDING, store.DONE]
    finally:
        await db.close()


async def test_a_cancel_between_the_runners_read_and_its_start_holds(db, tmp_path) -> None:
    """The runner read the batch while it was validating; the client cancelled it before
    the runner moved it to in progress: the cancel stands and no line starts."""
    batch = await _batch(db, n=3)
    ran: list[str] = []

    async def execute(gw, principal, endpoint, body, tag) -> LineAnswer:
        ran.append(tag[1])
        return LineAnswer(200, "r", {})

    router = SimpleNamespace(backends=[], broken={})
    settings = SimpleNamespace(batch_in_flight=2, instance="gw-a")
    gw = SimpleNamespace(db=db, settings=settings, router=router, queues={})
    files = FileStore(db, tmp_path / "files")
    runner = BatchRunner(gw, files, execute)  # type: ignore[arg-type]
    (read,) = await store.active(db)
    assert read.status == "validating"
    assert await store.cancel(db, batch.id)
    await runner._advance(read)  # the turn that read it goes on with what it read
    await asyncio.sleep(0)
    got = await store.get(db, batch.id)
    assert got is not None and got.status == "cancelling"
    assert ran == [] and not runner.tasks
