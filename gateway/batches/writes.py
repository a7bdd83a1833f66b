"""The batches' reads and writes, each one transaction that needs no event loop while it
holds the database. On SQLite the usage writer commits on the event loop's thread (a
plain sqlite3 connection, gateway.tenancy.usage): a write that held SQLite's lock across
an await (aiosqlite's) would wait for the loop while the loop waits for the lock, until
the busy timeout. So on SQLite each write runs whole, never across an await, on the
same plain connections: in a worker thread, or on the loop's own thread where it is one
line's small write (`inline`); on PostgreSQL, on the async engine.

Reads on SQLite run on the loop's own thread too: in WAL mode a read waits for no
writer, and a worker thread's two hand-offs cost more than the read. A batch's poll, a
line's answer and the runner's reads cost the event loop 1.2 to 1.8 ms of CPU each
through aiosqlite or a worker thread, and 0.05 to 0.2 ms here (docs/PERF.md, issue 50):
the loop shares the engine's process and its GIL, and a batch's lines pay for each."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import Connection, Engine

from gateway.db import Database

T = TypeVar("T")


async def write(db: Database, fn: Callable[[Connection], T], inline: bool = False) -> T:
    """`fn` in one transaction; on SQLite in a worker thread, or on this thread where
    `inline` (a small write whose thread hand-offs would cost more than it)."""
    if db.sync_engine is not None:
        if inline:
            return _in_transaction(db.sync_engine, fn)
        return await asyncio.to_thread(_in_transaction, db.sync_engine, fn)
    async with db.engine.begin() as conn:
        return await conn.run_sync(fn)


async def read(db: Database, fn: Callable[[Connection], T]) -> T:
    """`fn` on a connection of its own; on SQLite on this thread."""
    if db.sync_engine is not None:
        with db.sync_engine.connect() as conn:
            return fn(conn)
    async with db.engine.connect() as conn:
        return await conn.run_sync(fn)


def _in_transaction(engine: Engine, fn: Callable[[Connection], T]) -> T:
    with engine.begin() as conn:
        return fn(conn)
