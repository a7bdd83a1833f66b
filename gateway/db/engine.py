"""Engine set-up for SQLite (WAL) and PostgreSQL, and the Alembic upgrade."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, event
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


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
    cur.execute("PRAGMA busy_timeout=10000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _no_autocheckpoint(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.execute("PRAGMA wal_autocheckpoint=0")


class Database:
    def __init__(self, url: str, schema: str | None = None) -> None:
        self.url = url
        self.schema = schema
        self.engine = create_engine(url, schema)
        self.session = async_sessionmaker(self.engine, expire_on_commit=False)
        # SQLite writes from a worker thread on a plain sqlite3 connection: one thread
        # hop per group commit instead of one per statement through aiosqlite.
        self.sync_engine: Engine | None = None
        if url.startswith("sqlite+aiosqlite"):
            self.sync_engine = create_sync_engine(url.replace("+aiosqlite", "+pysqlite", 1))
            event.listen(self.sync_engine, "connect", _sqlite_pragmas)
            # The usage writer must not pay a checkpoint's fsync inside a commit that
            # requests wait on; UsageRecorder checkpoints from a worker thread instead.
            event.listen(self.sync_engine, "connect", _no_autocheckpoint)

    @property
    def is_postgres(self) -> bool:
        return is_postgres(self.url)

    async def close(self) -> None:
        await self.engine.dispose()
        if self.sync_engine is not None:
            self.sync_engine.dispose()


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url)
    return cfg


async def migrate(db: Database, revision: str = "head") -> None:
    """Upgrade the schema to `revision` on the database's own engine."""
    if db.is_postgres and db.schema:
        async with db.engine.begin() as conn:
            await conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{db.schema}"')

    def upgrade(sync_conn: Any) -> None:
        cfg = alembic_config(db.url)
        cfg.attributes["connection"] = sync_conn
        command.upgrade(cfg, revision)

    async with db.engine.begin() as conn:
        await conn.run_sync(upgrade)
