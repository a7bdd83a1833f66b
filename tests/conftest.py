"""Shared fixtures: free ports (studies/ports.py), live `kvgate serve` processes, PostgreSQL schemas."""

from __future__ import annotations

import asyncio
import gc
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from studies.ports import free_port
from tests.migrated_db import copy_migrated

ADMIN_KEY = "kvg-test-admin-" + "x" * 32
PG_URL = os.environ.get("KVGATE_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")

# how the suite splits over pytest-xdist's workers (`make test`)
pytest_plugins = ["tests.parallel"]


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection made (every test module and what it imports: about 900,000 objects
    for the whole suite) lives until the session ends, yet each full collection walked it
    again: 0.4-1.3 s each, dozens of times a run, and a stall for the upstreams tests
    serve from a thread of this process. Frozen, collections walk what tests make."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True, scope="session")
def bench_history_dir(tmp_path_factory) -> Path:
    """`kvgate bench` runs in the tests keep their history records here, not in the
    user's cache (bench/history.py)."""
    path = tmp_path_factory.mktemp("bench-history")
    os.environ["KVGATE_BENCH_HISTORY"] = str(path)
    return path


@dataclass
class LiveGateway:
    """A real `kvgate serve` process on a free port."""

    url: str
    port: int
    proc: subprocess.Popen
    log: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_KEY}"}

    def tenant_key(self, name: str, **quota: Any) -> tuple[dict, str]:
        """A tenant made through the admin API, and a key for it."""
        with httpx.Client(base_url=self.url, headers=self.admin_headers, timeout=30) as http:
            tenant = http.post("/admin/tenants", json={"name": name, **quota})
            assert tenant.status_code == 201, tenant.text
            tenant_id = tenant.json()["id"]
            key = http.post(f"/admin/tenants/{tenant_id}/keys", json={})
            assert key.status_code == 201, key.text
        return tenant.json(), key.json()["key"]

    def stop(self, sig: int | None = None) -> None:
        if self.proc.poll() is None:
            if sig is None:
                self.proc.terminate()
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_gateway(
    tmp_path: Path,
    *args: str,
    database_url: str | None = None,
    extra_env: dict[str, str] | None = None,
    config: str | None = None,
    timeout: float = 60,
) -> LiveGateway:
    port = free_port()
    env = dict(os.environ)
    env["KVGATE_ADMIN_KEY"] = ADMIN_KEY
    if database_url is None and not (tmp_path / "kvgate.db").exists():
        copy_migrated(tmp_path / "kvgate.db")  # a new database, without its migrations' CPU
    env["KVGATE_DATABASE_URL"] = database_url or f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}"
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "gateway.cli"]
    if config is not None:
        cfg = tmp_path / f"kvgate-{port}.toml"
        cfg.write_text(config)
        cmd += ["--config", str(cfg)]
    cmd += ["serve", "--port", str(port), *args]
    log = tmp_path / f"gateway-{port}.log"
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    gw = LiveGateway(f"http://127.0.0.1:{port}", port, proc, log, env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvgate serve exited early:\n{log.read_text()}")
        if "kvgate: listening on" in log.read_text():  # not a worker's line
            return gw
        time.sleep(0.1)
    gw.stop()
    raise RuntimeError(f"kvgate serve did not start in {timeout}s:\n{log.read_text()}")


@pytest.fixture
def live_gateway(tmp_path: Path) -> Iterator[LiveGateway]:
    gw = start_gateway(tmp_path, "--backend", "fake")
    yield gw
    gw.stop()


async def away_from_minute_boundary(margin_s: float = 15) -> None:
    """Rate limits count per UTC minute: a burst must not straddle two of them."""
    left = 60 - time.time() % 60
    if left < margin_s:
        await asyncio.sleep(left + 0.2)


def pg_reachable() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture
def pg_schema() -> Iterator[str]:
    """A fresh PostgreSQL schema, dropped afterwards."""
    if "KVGATE_TEST_PG_URL" not in os.environ and not pg_reachable():
        pytest.skip("no PostgreSQL server at 127.0.0.1:5432 and KVGATE_TEST_PG_URL unset")
    import asyncpg

    schema = "kvgate_test_" + secrets.token_hex(4)
    dsn = PG_URL.replace("postgresql+asyncpg", "postgresql")

    async def run(sql: str) -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    def execute(sql: str) -> None:
        # in a thread of its own: the fixture may be used from inside a running loop
        with ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, run(sql)).result()

    execute(f'CREATE SCHEMA "{schema}"')
    yield schema
    execute(f'DROP SCHEMA "{schema}" CASCADE')
