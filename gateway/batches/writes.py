"""The batches' writes, each one transaction that needs no event loop while it holds the
database. On SQLite the usage writer commits on the event loop's thread (a plain
sqlite3 connection, gateway.tenancy.usage): a write that held SQLite's lock across an
await (aiosqlite's) would wait for the loop while the loop waits for the lock, until the
busy timeout. So on SQLite each write runs whole in a worker thread, on the same plain
connections; on PostgreSQL, on the async engine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import Connection, Engine

from gateway.db import Database

T = TypeVar("T")


async def write(db: Database, fn: Callable[[Connection], T]) -> T:
    if db.sync_engine is not None:
        return await asyncio.to_thread(_in_transaction, db.sync_engine, fn)
    async with db.engine.begin() as conn:
        return await conn.run_sync(fn)


def _in_transaction(engine: Engine, fn: Callable[[Connection], T]) -> T:
    with engine.begin() as conn:
        return fn(conn)
