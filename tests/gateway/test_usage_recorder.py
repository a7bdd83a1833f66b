"""The usage recorder on SQLite and PostgreSQL: one bad row fails no other, a database
that is down gives a fixed message and loses no row, and daily totals match the rows."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import select, text

from gateway.db import DailyUsage, Database, UsageRecord, migrate
from gateway.tenancy.usage import UsageRecorder, UsageRow, UsageUnavailable
from tests.conftest import PG_URL, free_port

# SQLite does not enforce VARCHAR lengths or refuse NUL; this trigger makes it refuse
# the `user` values PostgreSQL refuses, so both run the same isolation path.
_SQLITE_USER_CHECK = """
CREATE TRIGGER usage_user_like_postgres BEFORE INSERT ON usage_records
WHEN length(NEW.user) > 200 OR instr(NEW.user, char(0)) > 0
BEGIN SELECT RAISE(ABORT, 'value too long or holds NUL'); END
"""


@pytest.fixture(params=["sqlite", "postgres"])
async def db(request, tmp_path) -> AsyncIterator[Database]:
    if request.param == "postgres":
        db = Database(PG_URL, request.getfixturevalue("pg_schema"))
    else:
        db = Database(f"sqlite+aiosqlite:///{tmp_path / 'usage.db'}")
    await migrate(db)
    if not db.is_postgres:
        async with db.engine.begin() as conn:
            await conn.execute(text(_SQLITE_USER_CHECK))
    yield db
    await db.close()


def row(request_id: str, tenant: str, user: str | None = "u-ok", prompt: int = 10) -> UsageRow:
    return UsageRow(
        request_id=request_id,
        tenant_id=tenant,
        key_id=f"key-{tenant}",
        model="fake-model",
        prompt_tokens=prompt,
        completion_tokens=5,
        cached_tokens=1,
        ttft_ms=1.0,
        latency_ms=2.0,
        status=200,
        finish_reason="stop",
        user=user,
    )


async def committed(db: Database) -> dict[str, UsageRecord]:
    async with db.session() as s:
        return {r.request_id: r for r in (await s.scalars(select(UsageRecord))).all()}


async def assert_daily_matches_rows(db: Database) -> None:
    want: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for r in (await committed(db)).values():
        t = want[(r.tenant_id, UsageRow.day.fget(r), r.model)]
        for i, n in enumerate((1, r.prompt_tokens, r.completion_tokens, r.cached_tokens)):
            t[i] += n
    async with db.session() as s:
        daily = (await s.scalars(select(DailyUsage))).all()
    got = {
        (d.tenant_id, d.day, d.model): [
            d.requests,
            d.prompt_tokens,
            d.completion_tokens,
            d.cached_tokens,
        ]
        for d in daily
    }
    assert got == dict(want)


async def outcomes(futures: list[asyncio.Future]) -> list[BaseException | None]:
    return await asyncio.gather(*futures, return_exceptions=True)


def assert_says_nothing_of(exc: BaseException, rows: list[UsageRow]) -> None:
    assert isinstance(exc, UsageUnavailable)
    assert str(exc) == UsageUnavailable.MESSAGE
    assert exc.__cause__ is None and exc.__context__ is None  # no database error chained
    for r in rows:
        for value in (r.request_id, r.tenant_id, r.key_id):
            assert value not in str(exc) and value not in repr(exc)


async def rename_usage_table(db: Database, old: str, new: str) -> None:
    async with db.engine.begin() as conn:
        await conn.execute(text(f"ALTER TABLE {old} RENAME TO {new}"))


@pytest.mark.parametrize("bad_user", ["x" * 300, "bad\x00user"], ids=["long", "nul"])
@pytest.mark.parametrize("good", [3, 40], ids=["inline", "thread"])  # SQLite's two paths
async def test_one_bad_row_does_not_fail_its_batch(db, bad_user, good) -> None:
    recorder = UsageRecorder(db)
    recorder.start()
    try:
        await recorder.submit(row("warm-up", "t-a"))
        assert recorder.commits == 1
        good_rows = [row(f"req-{i}", f"t-{'abc'[i % 3]}", prompt=i + 1) for i in range(good)]
        good_rows[0].user = None
        bad = row("req-bad", "t-z", user=bad_user, prompt=7)
        rows = good_rows[:1] + [bad] + good_rows[1:]
        futures = [recorder.submit(r) for r in rows]  # one batch: no await in between
        assert await outcomes(futures) == [None] * len(rows)
        # the batch failed, then each row committed alone (the bad one on its second try)
        assert recorder.commits == 1 + len(rows)
        found = await committed(db)
        assert set(found) == {"warm-up", "req-bad"} | {r.request_id for r in good_rows}
        assert found["req-bad"].user is None and found["req-bad"].prompt_tokens == 7
        assert all(found[r.request_id].user == r.user for r in good_rows)
        await assert_daily_matches_rows(db)
    finally:
        await recorder.stop()


async def test_a_good_batch_is_one_commit(db) -> None:
    recorder = UsageRecorder(db)
    recorder.start()
    try:
        futures = [recorder.submit(row(f"req-{i}", f"t-{i % 2}")) for i in range(50)]
        assert await outcomes(futures) == [None] * 50
        assert recorder.commits == 1 and recorder.rows_committed == 50
        await assert_daily_matches_rows(db)
    finally:
        await recorder.stop()


async def test_a_database_that_is_down_keeps_the_rows_until_it_is_back(db) -> None:
    recorder = UsageRecorder(db, retry_s=0.05, retry_max_s=0.2)
    recorder.start()
    try:
        await rename_usage_table(db, "usage_records", "usage_records_away")
        rows = [row("req-1", "t-a"), row("req-2", "t-b", user="x" * 300), row("req-3", "t-c")]
        results = await outcomes([recorder.submit(r) for r in rows])
        for exc in results:
            assert_says_nothing_of(exc, rows)
        assert [r.request_id for r in recorder.kept] == ["req-1", "req-2", "req-3"]
        async with db.session() as s:  # nothing counted in the daily totals either
            assert (await s.scalars(select(DailyUsage))).all() == []

        await rename_usage_table(db, "usage_records_away", "usage_records")
        for _ in range(400):  # retried every 0.2 s at most
            if not recorder.kept:
                break
            await asyncio.sleep(0.05)
        assert recorder.kept == []
        found = await committed(db)
        assert set(found) == {"req-1", "req-2", "req-3"}
        assert found["req-2"].user is None and found["req-1"].user == "u-ok"
        await assert_daily_matches_rows(db)
        await recorder.submit(row("req-4", "t-a"))  # and the recorder goes on as before
        assert "req-4" in await committed(db)
    finally:
        await recorder.stop()


async def test_stop_flushes_the_kept_rows(db) -> None:
    recorder = UsageRecorder(db, retry_s=60, retry_max_s=60)
    recorder.start()
    await rename_usage_table(db, "usage_records", "usage_records_away")
    results = await outcomes([recorder.submit(row("req-1", "t-a"))])
    assert isinstance(results[0], UsageUnavailable)
    await rename_usage_table(db, "usage_records_away", "usage_records")
    await recorder.stop()  # the next retry would be a minute away; stop tries now
    assert set(await committed(db)) == {"req-1"}
    await assert_daily_matches_rows(db)


async def test_stop_gives_up_on_a_database_that_stays_down(caplog) -> None:
    # PostgreSQL on a port nothing listens on: every connection is refused
    db = Database(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/test")
    recorder = UsageRecorder(db, retry_s=0.05, retry_max_s=0.1, stop_flush_s=0.3)
    recorder.start()
    try:
        rows = [row("req-1", "t-a"), row("req-2", "t-b")]
        for exc in await outcomes([recorder.submit(r) for r in rows]):
            assert_says_nothing_of(exc, rows)
        with caplog.at_level(logging.ERROR, logger="kvgate.usage"):
            await recorder.stop()  # returns although the database never comes back
        lost = [r.getMessage() for r in caplog.records if "lost" in r.getMessage()]
        assert len(lost) == 1 and "req-1" in lost[0] and "req-2" in lost[0]
    finally:
        await db.close()
