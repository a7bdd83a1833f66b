"""Key and tenant changes announced to every gateway on one PostgreSQL database at once.

The auth epoch (gateway.tenancy.auth) is read on the request path, at most every EPOCH_CHECK_S:
on PostgreSQL that is three round trips before the first token of any request that
comes after a pause. Instead, the transaction that changes a key or a tenant also sends
`pg_notify(CHANNEL, current_schema())`, delivered when it commits, and each gateway
LISTENs on a connection of its own and drops its cached keys when a notice for its
schema comes: a revocation reaches every gateway within milliseconds and the request
path reads nothing. While that connection is down the gateway reads the epoch as on
SQLite, and it drops its cache on reconnecting (notices sent meanwhile are lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import asyncpg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db import Database

CHANNEL = "kvgate_auth"
PING_S = 5.0  # a connection that died without a word is found this soon
RECONNECT_S = 1.0
log = logging.getLogger("kvgate")


async def notify(session: AsyncSession) -> None:
    """Announce a change to keys or tenants, in the caller's transaction (PostgreSQL)."""
    if session.bind.dialect.name == "postgresql":
        await session.execute(text("SELECT pg_notify(:c, current_schema())"), {"c": CHANNEL})


class AuthListener:
    """Calls `on_change` for every notice of its schema, and whenever it (re)connects;
    `listening` says whether notices can be trusted to come."""

    def __init__(self, db: Database, on_change: Callable[[], None]) -> None:
        self.db = db
        self.on_change = on_change
        self.listening = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="auth-listener")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        dsn = self.db.driver_dsn
        settings = {"search_path": self.db.schema} if self.db.schema else {}
        while True:
            conn = None
            try:
                conn = await asyncpg.connect(dsn, server_settings=settings, timeout=10)
                await self._listen(conn)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as e:
                log.warning("auth change notices unavailable (%s); reading the epoch", e)
            finally:
                self.listening = False
                if conn is not None and not conn.is_closed():
                    conn.terminate()
            await asyncio.sleep(RECONNECT_S)

    async def _listen(self, conn: asyncpg.Connection) -> None:
        schema = await conn.fetchval("SELECT current_schema()")
        lost = asyncio.Event()
        conn.add_termination_listener(lambda _: lost.set())

        def notice(_conn: object, _pid: int, _channel: str, payload: str) -> None:
            if payload == schema:
                self.on_change()

        await conn.add_listener(CHANNEL, notice)
        self.on_change()  # whatever changed while nobody listened
        self.listening = True
        while not lost.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lost.wait(), PING_S)
            if not lost.is_set():
                await conn.execute("SELECT 1")
