"""The SQLite write-ahead log stays bounded while usage rows keep coming: commits with
no gap between them once kept every checkpoint from starting it again, so it grew
until shutdown. A reader that holds an old snapshot delays that, but no commit."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from gateway.db import Database, migrate
from gateway.tenancy.usage import RESTART_RETRY_S, UsageRecorder
from tests.conftest import start_gateway
from tests.gateway.test_usage_recorder import row

LIMIT = 256 * 1024
LIVE_LIMIT = 1024 * 1024
# the recorder waits for its copy of the log at twice the limit; a commit or two more
# may come before it looks
BOUND = 3
LOAD_S = 20
CLIENTS = 16


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'usage.db'}", wal_limit_bytes=LIMIT)
    await migrate(db)
    yield db
    await db.close()


def wal_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


async def commit_wave(recorder: UsageRecorder, wave: int, rows: int = 20) -> None:
    await asyncio.gather(*(recorder.submit(row(f"r-{wave}-{i}", "t1")) for i in range(rows)))


def usage_count(db_file: Path) -> int:
    with contextlib.closing(sqlite3.connect(db_file)) as conn:
        return conn.execute("SELECT count(*) FROM usage_records").fetchone()[0]


async def test_wal_stays_bounded_under_back_to_back_commits(db, tmp_path):
    recorder = UsageRecorder(db)
    assert recorder.wal == Path(f"{tmp_path / 'usage.db'}-wal")
    recorder.start()
    sizes = []
    for wave in range(200):
        await commit_wave(recorder, wave)
        sizes.append(wal_size(recorder.wal))
    await recorder.stop()
    assert max(sizes) <= BOUND * LIMIT, max(sizes)
    assert recorder.wal_restarts >= 2
    assert recorder.rows_committed == 4000 == usage_count(tmp_path / "usage.db")


async def test_a_reader_on_an_old_snapshot_delays_the_reset_not_the_commits(db, tmp_path):
    recorder = UsageRecorder(db)
    recorder.start()
    reader = sqlite3.connect(tmp_path / "usage.db", isolation_level=None)
    try:
        reader.execute("BEGIN")
        held = reader.execute("SELECT count(*) FROM usage_records").fetchone()[0]
        for wave in range(60):
            await commit_wave(recorder, wave)
        grown = wal_size(recorder.wal)
        assert grown > BOUND * LIMIT  # the log could not start again under the reader
        assert reader.execute("SELECT count(*) FROM usage_records").fetchone()[0] == held
        reader.execute("COMMIT")
    finally:
        reader.close()
    await asyncio.sleep(RESTART_RETRY_S)  # the next try comes this much later
    await commit_wave(recorder, 60)  # after it, the checkpoint
    await commit_wave(recorder, 61)  # starts the log again and cuts its file back
    assert wal_size(recorder.wal) <= LIMIT < grown
    await recorder.stop()
    assert recorder.rows_committed == 62 * 20 == usage_count(tmp_path / "usage.db")


async def _load(url: str, key: str, served: list[str]) -> None:
    client = AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    end = time.monotonic() + LOAD_S

    async def one_client() -> None:
        while time.monotonic() < end:
            chat = await client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            served.append(chat.id)

    try:
        await asyncio.gather(*(one_client() for _ in range(CLIENTS)))
    finally:
        await client.close()


async def _sample(path: Path, sizes: list[int], done: asyncio.Event) -> None:
    while not done.is_set():
        sizes.append(wal_size(path))
        await asyncio.sleep(0.02)


async def test_live_gateway_keeps_the_wal_bounded_under_sustained_load(tmp_path):
    env = {"KVGATE_SQLITE_WAL_LIMIT_BYTES": str(LIVE_LIMIT)}
    gw = start_gateway(tmp_path, "--backend", "fake", extra_env=env)
    try:
        _, key = gw.tenant_key("acme")
        served: list[str] = []
        sizes: list[int] = []
        done = asyncio.Event()
        sampler = asyncio.create_task(_sample(tmp_path / "kvgate.db-wal", sizes, done))
        try:
            await _load(gw.url, key, served)
        finally:
            done.set()
            await sampler
        with contextlib.closing(sqlite3.connect(tmp_path / "kvgate.db")) as conn:
            committed = {r for (r,) in conn.execute("SELECT request_id FROM usage_records")}
    finally:
        gw.stop()
    # every response went out after its row was committed
    assert set(served) == committed and len(served) == len(committed)
    assert max(sizes) <= BOUND * LIVE_LIMIT, max(sizes)
    restarts = sum(1 for before, after in zip(sizes, sizes[1:], strict=False) if after < before)
    assert restarts >= 2, (restarts, len(served))  # the log started again under load
