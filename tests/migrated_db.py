"""A migrated SQLite file for each `kvgate serve` the suite starts on a new database.

A gateway's first start on a new file imports Alembic and runs every migration (about
0.7 CPU-s of its 1.7), and the suite starts about a hundred such gateways. A new file
still migrates where that is the point (tests/gateway/test_lean_starts.py runs `kvgate`
on one) and in every in-process gateway (make_gateway); the processes start_gateway
starts on a database of their own begin from a copy of one file migrated once per test
process. The copy gets a KV tiers' secret of its own,
as migration 0012 generates one per database.
"""

from __future__ import annotations

import atexit
import functools
import os
import secrets
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path


@functools.cache
def _template() -> Path:
    """A database migrated to the newest schema by `kvgate db upgrade`, once a process."""
    folder = Path(tempfile.mkdtemp(prefix="kvgate-migrated-"))
    atexit.register(shutil.rmtree, folder, True)
    path = folder / "kvgate.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["KVGATE_DATABASE_URL"] = f"sqlite+aiosqlite:///{path}"
    subprocess.run(
        [sys.executable, "-m", "gateway.cli", "db", "upgrade"],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    return path


def copy_migrated(path: Path) -> None:
    """`path`: a new database at the newest schema, its KV tiers' secret its own."""
    template = _template()
    for suffix in ("", "-wal"):  # the log too, should the template have kept one
        if Path(f"{template}{suffix}").exists():
            shutil.copyfile(f"{template}{suffix}", f"{path}{suffix}")
    with sqlite3.connect(path) as conn:
        changed = conn.execute(
            "UPDATE server_settings SET value = ? WHERE key = 'kv_tier_secret'",
            (secrets.token_hex(32),),
        ).rowcount
    conn.close()
    assert changed == 1, "the KV tiers' secret moved out of server_settings"
