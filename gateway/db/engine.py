"""Engine set-up for SQLite (WAL) and PostgreSQL (the schema's migration: gateway.db.schema).

SQLite's write-ahead log starts again from its beginning only after a checkpoint has
copied all of it with no commit since and no reader left on an older snapshot; under
steady load that gap never comes by itself, so the usage writer makes one (see
`Database.wal_checkpoint`). A log that starts again keeps its file at the largest size
it reached, so `journal_size_limit` cuts the file back to `wal_limit_bytes`: past that
size, the file says the log has grown past the limit since it last started again.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
from sqlalchemy import Engine, event, make_url, select
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    async_sessionmaker,
    create_async_engine,
)

from gateway.db.tables import ServerSetting
from gateway.sqlite_wal import SQLITE_WAL_LIMIT_BYTES

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
BUSY_TIMEOUT_MS = 10_000
DRIVER_POOL_SIZE = 8  # asyncpg connections for admission and usage commits (PostgreSQL)

_SETTING = f"SELECT value FROM {ServerSetting.__tablename__} WHERE key = ?"


def is_postgres(url: str) -> bool:
    return url.startswith("postgresql")


def create_engine(url: str, schema: str | None = None) -> AsyncEngine:
    kwargs: dict[str, Any] = {}
    if is_postgres(url):
        kwargs["pool_size"] = 10
        kwargs["max_overflow"] = 20
        if schema:
            kwargs["connect_args"] = {"server_settings": {"search_path": schema}}
    engine = create_async_engine(url, **kwargs)
    if url.startswith("sqlite"):
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets readers run beside the group-commit writer; NORMAL is durable across a
    # process crash (kill -9), which is what the usage guarantee needs.
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _no_autocheckpoint(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.execute("PRAGMA wal_autocheckpoint=0")


class Database:
    def __init__(
        self, url: str, schema: str | None = None, wal_limit_bytes: int = SQLITE_WAL_LIMIT_BYTES
    ) -> None:
        self.url = url
        self.schema = schema
        self.wal_limit_bytes = wal_limit_bytes
        self.engine = create_engine(url, schema)
        self.session = async_sessionmaker(self.engine, expire_on_commit=False)
        self._driver_pool: asyncpg.Pool | None = None
        # SQLite writes from a worker thread on a plain sqlite3 connection: one thread
        # hop per group commit instead of one per statement through aiosqlite.
        self.sync_engine: Engine | None = None
        if url.startswith("sqlite+aiosqlite"):
            self.sync_engine = create_sync_engine(url.replace("+aiosqlite", "+pysqlite", 1))
            event.listen(self.sync_engine, "connect", _sqlite_pragmas)
            # The usage writer must not pay a checkpoint's fsync inside a commit that
            # requests wait on; UsageRecorder checkpoints between its commits instead.
            event.listen(self.sync_engine, "connect", _no_autocheckpoint)
            for engine in (self.engine.sync_engine, self.sync_engine):
                event.listen(engine, "connect", self._limit_wal_file)

    @contextlib.asynccontextmanager
    async def driver(self) -> AsyncIterator[asyncpg.Connection]:
        """A bare asyncpg connection (PostgreSQL) for the two statements every request
        makes, admission and the usage commit: SQLAlchemy's layers cost more CPU per
        request than the database spends on them. A pool of its own, made on first use."""
        if self._driver_pool is None:
            self._driver_pool = await asyncpg.create_pool(
                self.driver_dsn,
                min_size=1,
                max_size=DRIVER_POOL_SIZE,
                reset=_keep_session,
                server_settings={"search_path": self.schema} if self.schema else {},
            )
        async with self._driver_pool.acquire() as conn:
            yield conn

    @contextlib.asynccontextmanager
    async def autocommit(self) -> AsyncIterator[AsyncConnection]:
        """A connection whose statements each commit alone: on PostgreSQL one round trip
        each, where a transaction would add a BEGIN and a COMMIT or ROLLBACK."""
        async with self.engine.connect() as conn:
            yield await conn.execution_options(isolation_level="AUTOCOMMIT")

    async def setting(self, key: str) -> str | None:
        """A server_settings value (None if it has no row). On SQLite one primary-key read
        through the plain sqlite3 connection, on the loop: about 20 us, where aiosqlite's
        worker thread would cost the loop milliseconds of GIL hand-offs for each read (the
        auth epoch is read ten times a second under load). On PostgreSQL one statement."""
        if self.sync_engine is not None:
            raw = self.sync_engine.raw_connection()
            try:
                cur = raw.cursor()
                row = cur.execute(_SETTING, (key,)).fetchone()
                cur.close()
            finally:
                raw.close()
            return None if row is None else row[0]
        async with self.autocommit() as conn:
            return await conn.scalar(select(ServerSetting.value).where(ServerSetting.key == key))

    @property
    def driver_dsn(self) -> str:
        """The URL as asyncpg takes it (PostgreSQL)."""
        url = make_url(self.url).set(drivername="postgresql")
        return url.render_as_string(hide_password=False)

    @property
    def is_postgres(self) -> bool:
        return is_postgres(self.url)

    @property
    def wal_path(self) -> Path | None:
        """The SQLite write-ahead log's file; None without the sync SQLite writer or
        for an in-memory database."""
        if self.sync_engine is None:
            return None
        name = self.sync_engine.url.database
        if not name or name == ":memory:":
            return None
        return Path(name + "-wal")

    def _limit_wal_file(self, dbapi_conn: Any, _record: Any) -> None:
        # any connection's commit may be the first of a log started again
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA journal_size_limit={self.wal_limit_bytes}")
        cur.close()

    def wal_checkpoint(self, mode: str, busy_ms: int = BUSY_TIMEOUT_MS) -> bool:
        """One checkpoint on the SQLite writer engine: `PASSIVE` copies what it can
        beside commits and readers; `RESTART` also waits up to `busy_ms` for the other
        writers and for the readers of older snapshots, so that the next commit starts
        the log again. True when the whole log was copied (and, for RESTART, no reader
        holds it)."""
        assert self.sync_engine is not None and mode in ("PASSIVE", "RESTART")
        raw = self.sync_engine.raw_connection()
        try:
            raw.execute(f"PRAGMA busy_timeout={busy_ms}")
            try:
                busy, log_frames, copied = raw.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
            finally:
                raw.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        finally:
            raw.close()
        return not busy and copied == log_frames

    async def close(self) -> None:
        if self._driver_pool is not None:
            await self._driver_pool.close()
        await self.engine.dispose()
        if self.sync_engine is not None:
            self.sync_engine.dispose()


async def _keep_session(_conn: asyncpg.Connection) -> None:
    """asyncpg resets a connection it takes back (RESET ALL, UNLISTEN, advisory unlocks):
    one more round trip per statement for ours, which leave no session state behind
    (their advisory locks are transaction-scoped)."""
