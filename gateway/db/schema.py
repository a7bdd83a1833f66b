"""The schema's migration: a database already at the newest migration (every start but
the first) is left as it is without importing Alembic, which with the Mako and Pygments it
pulls in, and every dialect's DDL module, costs a `kvgate` process about 0.2 CPU-s; one
behind it is upgraded by Alembic (gateway.db.schema_upgrade, imported then).
"""

from __future__ import annotations

from sqlalchemy import inspect

from gateway.db.engine import MIGRATIONS_DIR, Database

# Alembic's table of the revision a database is at (one row on a linear history)
VERSION_TABLE = "alembic_version"
# the advisory lock `migrate` holds on PostgreSQL (any constant of our own)
MIGRATION_LOCK = 0x6B766761_74650001


def head_revision() -> str:
    """The newest migration's revision, without Alembic: each file of migrations/versions
    is named after its revision, NNNN_what.py, on one line of history (a test holds the
    files to it)."""
    return max(p.name.split("_", 1)[0] for p in (MIGRATIONS_DIR / "versions").glob("[0-9]*_*.py"))


async def current_revision(db: Database) -> str | None:
    """The revision the database is at; None for a database never migrated (or one whose
    version table does not hold exactly one row)."""
    async with db.engine.connect() as conn:
        if not await conn.run_sync(lambda c: inspect(c).has_table(VERSION_TABLE)):
            return None
        rows = (await conn.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}")).all()
    return rows[0][0] if len(rows) == 1 else None


async def migrate(db: Database, revision: str = "head") -> None:
    """Upgrade the schema to `revision` on the database's own engine. A database already
    at the newest revision (every start but the first) is left without importing Alembic."""
    if revision == "head" and await current_revision(db) == head_revision():
        return
    from gateway.db.schema_upgrade import upgrade

    if db.is_postgres and db.schema:
        async with db.engine.begin() as conn:
            await conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{db.schema}"')

    async with db.engine.begin() as conn:
        if db.is_postgres:
            # gateways started together (a Deployment's replicas) migrate one at a time:
            # the others wait here, then find the schema current
            await conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
        await conn.run_sync(upgrade, db.url, revision)
