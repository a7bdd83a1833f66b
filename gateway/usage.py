"""Usage rows with group commit.

Each finished request submits its row to the recorder and waits until the row is
committed; only then does the gateway send the response's final bytes. Rows that
arrive while a transaction is being written go together in the next one, so under
load one commit carries many requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, fields

from sqlalchemy import text

from gateway.db import Database, UsageRecord

INLINE_COMMIT_ROWS = 32
CHECKPOINT_EVERY_S = 2.0


@dataclass
class UsageRow:
    request_id: str
    tenant_id: str
    key_id: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_ms: float | None
    latency_ms: float
    status: int
    finish_reason: str | None
    user: str | None = None
    created_at: float = 0.0

    @property
    def day(self) -> str:
        return time.strftime("%Y-%m-%d", time.gmtime(self.created_at))


class UsageRecorder:
    def __init__(self, db: Database, max_batch: int = 1000) -> None:
        self.db = db
        self.max_batch = max_batch
        self.pending: list[tuple[UsageRow, asyncio.Future[None]]] = []
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.commits = 0
        self.rows_committed = 0
        self._checkpoint: asyncio.Task[None] | None = None
        self._last_checkpoint = time.monotonic()

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name="usage-recorder")

    async def stop(self) -> None:
        if self.task is None:
            return
        while self.pending:  # drain: every waiting request gets its row
            self.wakeup.set()
            await asyncio.sleep(0.005)
        if self._checkpoint is not None:
            await self._checkpoint
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.task = None

    def submit(self, row: UsageRow) -> asyncio.Future[None]:
        """Queue `row`; the future resolves once it is committed, or fails with the commit.
        A plain future, not a task: cancelling a waiter does not withdraw the row."""
        if not row.created_at:
            row.created_at = time.time()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending.append((row, fut))
        self.wakeup.set()
        return fut

    async def _run(self) -> None:
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            while self.pending:
                batch = self.pending[: self.max_batch]
                del self.pending[: self.max_batch]
                try:
                    await self._commit([row for row, _ in batch])
                except Exception as e:  # the requests fail, the recorder goes on
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(e)
                    continue
                self.commits += 1
                self.rows_committed += len(batch)
                self._maybe_checkpoint()
                for _, fut in batch:
                    if not fut.done():
                        fut.set_result(None)

    async def _commit(self, rows: list[UsageRow]) -> None:
        # Core statements on a bare connection: executemany, no ORM unit of work.
        values = [dict(vars(r)) for r in rows]
        daily = self._daily_totals(rows)
        if self.db.sync_engine is not None:
            # A small batch costs less than the two thread switches that would hide it;
            # a large one goes to a worker thread so the event loop keeps serving.
            if len(rows) <= INLINE_COMMIT_ROWS:
                self._commit_sync(values, daily)
            else:
                await asyncio.to_thread(self._commit_sync, values, daily)
            return
        async with self.db.engine.begin() as conn:
            await conn.execute(UsageRecord.__table__.insert(), values)
            await conn.execute(_DAILY_UPSERT, daily)

    def _maybe_checkpoint(self) -> None:
        """Fold the SQLite WAL back into the database now and then, off the event loop."""
        if (
            self.db.sync_engine is None
            or time.monotonic() - self._last_checkpoint < CHECKPOINT_EVERY_S
        ):
            return
        if self._checkpoint is not None and not self._checkpoint.done():
            return
        self._last_checkpoint = time.monotonic()
        self._checkpoint = asyncio.create_task(asyncio.to_thread(self._checkpoint_sync))

    def _checkpoint_sync(self) -> None:
        assert self.db.sync_engine is not None
        raw = self.db.sync_engine.raw_connection()
        try:
            raw.execute("PRAGMA wal_checkpoint(PASSIVE)")
        finally:
            raw.close()

    def _commit_sync(self, values: list[dict], daily: list[dict]) -> None:
        # The plain sqlite3 cursor: SQLAlchemy's per-statement work would be most of a
        # small batch's cost, and this thread holds the GIL the event loop needs.
        assert self.db.sync_engine is not None
        raw = self.db.sync_engine.raw_connection()
        try:
            cur = raw.cursor()
            cur.executemany(_SQLITE_USAGE_INSERT, values)
            cur.executemany(_SQLITE_DAILY_UPSERT, daily)
            raw.commit()
        except BaseException:
            raw.rollback()
            raise
        finally:
            raw.close()

    def _daily_totals(self, rows: list[UsageRow]) -> list[dict]:
        totals: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        for r in rows:
            t = totals[(r.tenant_id, r.day, r.model)]
            t[0] += 1
            t[1] += r.prompt_tokens
            t[2] += r.completion_tokens
            t[3] += r.cached_tokens
        # sorted: concurrent writers (several gateways) lock daily rows in one order
        return [
            {"tenant_id": tenant, "day": day, "model": model, "requests": n,
             "prompt_tokens": p, "completion_tokens": c, "cached_tokens": k}
            for (tenant, day, model), (n, p, c, k) in sorted(totals.items())
        ]  # fmt: skip


_USAGE_COLUMNS = [f.name for f in fields(UsageRow)]
_SQLITE_USAGE_INSERT = (
    f"INSERT INTO usage_records ({', '.join(_USAGE_COLUMNS)}) "
    f"VALUES ({', '.join(':' + c for c in _USAGE_COLUMNS)})"
)

# The same upsert syntax on SQLite and PostgreSQL; one prepared statement, executemany.
_DAILY_UPSERT = text(
    "INSERT INTO daily_usage (tenant_id, day, model, requests, prompt_tokens, "
    "completion_tokens, cached_tokens) VALUES (:tenant_id, :day, :model, :requests, "
    ":prompt_tokens, :completion_tokens, :cached_tokens) "
    "ON CONFLICT (tenant_id, day, model) DO UPDATE SET "
    "requests = daily_usage.requests + excluded.requests, "
    "prompt_tokens = daily_usage.prompt_tokens + excluded.prompt_tokens, "
    "completion_tokens = daily_usage.completion_tokens + excluded.completion_tokens, "
    "cached_tokens = daily_usage.cached_tokens + excluded.cached_tokens"
)
_SQLITE_DAILY_UPSERT = _DAILY_UPSERT.text
