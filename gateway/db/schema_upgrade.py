"""Alembic's upgrade, in a module of its own: gateway.db.schema imports it only for a
database behind the newest migration (importing Alembic costs a process about 0.2 CPU-s).
"""

from __future__ import annotations

from typing import Any

from alembic import command
from alembic.config import Config

from gateway.db.engine import MIGRATIONS_DIR


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url)
    return cfg


def upgrade(sync_conn: Any, url: str, revision: str) -> None:
    """Alembic's upgrade to `revision` on a connection of the caller's (run_sync)."""
    cfg = alembic_config(url)
    cfg.attributes["connection"] = sync_conn
    command.upgrade(cfg, revision)
