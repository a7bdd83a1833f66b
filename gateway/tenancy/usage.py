"""Usage rows with group commit.

Each finished request submits its row to the recorder and waits until the row is
committed; only then does the gateway send the response's final bytes. On PostgreSQL
the row carries its request's quota settlement, applied in the same transaction: no
round trip of its own, and counters and row are durable (or retried) together. Rows that
arrive while a transaction is being written go together in the next one, so under
load one commit carries many requests.

One bad row must not fail the others in its transaction: a batch that fails is
committed again row by row, a row that fails alone once more without the field the
client chose (`user`), and a row that still fails (the database is down) is kept and
retried until it is committed, so a response that already went out is still billed.

On SQLite the recorder also keeps the write-ahead log bounded. Commits come without
a gap under load, so a checkpoint beside them never catches up and the log never
starts again. Once the log passes the database's `wal_limit_bytes`, a PASSIVE
checkpoint copies it into the database from a worker thread while commits go on;
then, between two commits, a RESTART checkpoint copies the little that came since,
and the next commit starts the log again from the beginning of its file (which it
cuts back to the limit). Rows that arrive during that checkpoint wait and go together
in the next commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import asyncpg
from sqlalchemy.pool import PoolProxiedConnection

from gateway.db import Database
from gateway.tenancy.quota.postgres import apply_settlements
from gateway.tenancy.usage_rows import (
    DAILY_COLUMNS,
    PG_DAILY_UPSERT,
    PG_USAGE_INSERT,
    SQLITE_DAILY_UPSERT,
    SQLITE_USAGE_INSERT,
    UsageRow,
    billed_before,
    daily_totals,
    row_fault,
    row_values,
)

log = logging.getLogger("kvgate.usage")

INLINE_COMMIT_ROWS = 32
# The RESTART checkpoint waits this long at most for a reader of an older snapshot
# (commits wait too); after one that could not finish, the next is tried this much later.
RESTART_BUSY_MS = 100
RESTART_RETRY_S = 1.0


class UsageUnavailable(Exception):
    """The usage row could not be committed now; the recorder keeps it and retries.
    Its message is fixed: a database error names other tenants' rows."""

    MESSAGE = "usage could not be recorded; the request was not completed"

    def __init__(self) -> None:
        super().__init__(self.MESSAGE)


Waiter = tuple[UsageRow, asyncio.Future[None]]


class UsageRecorder:
    def __init__(
        self,
        db: Database,
        max_batch: int = 1000,
        retry_s: float = 1.0,
        retry_max_s: float = 30.0,
        stop_flush_s: float = 5.0,
    ) -> None:
        self.db = db
        self.wal = db.wal_path
        self.max_batch = max_batch
        self.retry_s, self.retry_max_s, self.stop_flush_s = retry_s, retry_max_s, stop_flush_s
        self.pending: list[Waiter] = []
        self.kept: list[UsageRow] = []  # rows no commit took yet; retried with backoff
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.commits = 0
        self.rows_committed = 0
        self._retry_delay = retry_s
        self._retry_at = 0.0
        self._stopping = False
        self._copying: asyncio.Task[bool] | None = None  # the PASSIVE checkpoint
        self._restart_at = 0.0
        self.wal_restarts = 0
        # the connection the commits write through, taken from its pool once (one commit
        # at a time); given back at stop, or after a failed commit
        self._sqlite: PoolProxiedConnection | None = None
        self._pg: tuple[contextlib.AsyncExitStack, asyncpg.Connection] | None = None

    def start(self) -> None:
        self._stopping = False
        self.task = asyncio.create_task(self._run(), name="usage-recorder")

    async def stop(self) -> None:
        """Commit every waiting row, try the kept ones for a bounded time, then end."""
        if self.task is None:
            return
        self._stopping = True
        self.wakeup.set()
        await self.task  # it drains the pending rows, then returns
        self.task = None
        await self._flush_kept()
        if self._copying is not None:
            await self._copying
        self._release_sqlite()
        await self._release_postgres()

    def submit(self, row: UsageRow) -> asyncio.Future[None]:
        """Queue `row`; the future resolves once it is committed, or fails with
        UsageUnavailable (the row is then kept and retried). A plain future, not a
        task: cancelling a waiter does not withdraw the row."""
        if not row.created_at:
            row.created_at = time.time()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending.append((row, fut))
        self.wakeup.set()
        return fut

    async def _run(self) -> None:
        while True:
            await self._wait()
            self.wakeup.clear()
            while self.pending:
                batch = self.pending[: self.max_batch]
                del self.pending[: self.max_batch]
                await self._commit_batch(batch)
                await self._bound_wal()
            if self._stopping:
                return
            if self.kept and time.monotonic() >= self._retry_at:
                await self._retry_kept()

    async def _wait(self) -> None:
        if not self.kept:
            await self.wakeup.wait()
            return
        delay = self._retry_at - time.monotonic()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wakeup.wait(), delay)

    async def _commit_batch(self, batch: list[Waiter]) -> None:
        try:
            await self._commit([row for row, _ in batch])
        except Exception as e:
            # the error names every row of the batch: log its kind, never its text
            log.warning(
                "a usage batch of %d rows failed (%s); committing them one by one",
                len(batch),
                type(e).__name__,
            )
            await self._isolate(batch)
            return
        self._committed(batch)
        if self.kept:
            self._retry_at = 0.0  # the database is back: retry the kept rows now

    async def _isolate(self, batch: list[Waiter]) -> None:
        for i, (row, fut) in enumerate(batch):
            error = await self._commit_alone(row)
            if error is None or billed_before(row, error):
                self._committed([(row, fut)])
            elif row_fault(error):
                self._keep([(row, fut)], error)
            else:  # the database is unavailable: keep the rest untried
                self._keep(batch[i:], error)
                return

    async def _commit_alone(self, row: UsageRow) -> Exception | None:
        """Commit one row; if it fails and has a `user`, once more without it."""
        try:
            await self._commit([row])
            return None
        except Exception as e:
            if row.user is None or not row_fault(e):
                return e
            log.warning(
                "usage row %s failed (%s); committing it without its user field", row.request_id, e
            )
        row.user = None  # the one field the client chose; the server made the others
        try:
            await self._commit([row])
        except Exception as e:
            return e
        return None

    def _committed(self, batch: list[Waiter]) -> None:
        self.commits += 1
        self.rows_committed += len(batch)
        for _, fut in batch:
            if not fut.done():
                fut.set_result(None)

    def _keep(self, batch: list[Waiter], error: Exception) -> None:
        ids = [row.request_id for row, _ in batch]
        log.error(
            "usage rows not committed (%s: %s); kept to retry: %s",
            type(error).__name__,
            error,
            ", ".join(ids),
        )
        if not self.kept:
            self._retry_delay = self.retry_s
            self._retry_at = time.monotonic() + self._retry_delay
        self.kept.extend(row for row, _ in batch)
        for _, fut in batch:
            if not fut.done():
                fut.set_exception(UsageUnavailable())

    async def _retry_kept(self) -> None:
        """Commit the kept rows, a batch at a time while that works, else one by one."""
        while self.kept:
            rows = self.kept[: self.max_batch]
            try:
                await self._commit(rows)
            except Exception:
                await self._retry_one_by_one(rows)
                break
            del self.kept[: len(rows)]
            self._count_retried(len(rows))
        if self.kept:
            self._retry_delay = min(self._retry_delay * 2, self.retry_max_s)
            self._retry_at = time.monotonic() + self._retry_delay

    async def _retry_one_by_one(self, rows: list[UsageRow]) -> None:
        for row in rows:
            error = await self._commit_alone(row)
            if error is None:
                self.kept.remove(row)
                self._count_retried(1)
            elif not row_fault(error):
                # still down; this row goes last, so one that always fails holds up no other
                self.kept.remove(row)
                self.kept.append(row)
                return

    def _count_retried(self, n: int) -> None:
        self.commits += 1
        self.rows_committed += n
        log.info("committed %d kept usage rows; %d still kept", n, len(self.kept))

    async def _flush_kept(self) -> None:
        """At exit: retry the kept rows for at most stop_flush_s, then name those lost."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.stop_flush_s):
                while self.kept:
                    await self._retry_kept()
                    if self.kept:
                        await asyncio.sleep(self.retry_s)
        if self.kept:
            log.error(
                "%d usage rows are lost: the database stayed unavailable until exit: %s",
                len(self.kept),
                ", ".join(r.request_id for r in self.kept),
            )

    async def _commit(self, rows: list[UsageRow]) -> None:
        # Core statements on a bare connection: executemany, no ORM unit of work.
        daily = daily_totals(rows)
        values = [row_values(r) for r in rows]  # a tuple in USAGE_COLUMNS' order
        if self.db.sync_engine is not None:
            # A small batch costs less than the two thread switches that would hide it;
            # a large one goes to a worker thread so the event loop keeps serving.
            if len(rows) <= INLINE_COMMIT_ROWS:
                self._commit_sync(values, daily)
            else:
                await asyncio.to_thread(self._commit_sync, values, daily)
            return
        # PostgreSQL: the bare driver, as SQLite's plain cursor above, for the same reason,
        # on the recorder's own connection (a pool acquire and release, 16-22 us a commit)
        settlements = [r.settlement for r in rows if r.settlement is not None]
        conn = await self._postgres()
        try:
            async with conn.transaction():
                if settlements:  # first: counter rows are locked before any other row
                    await apply_settlements(conn, settlements)
                await conn.executemany(PG_USAGE_INSERT, values)
                await conn.executemany(
                    PG_DAILY_UPSERT, [[d[c] for c in DAILY_COLUMNS] for d in daily]
                )
        except BaseException:
            await self._release_postgres()  # the next commit takes a fresh one
            raise

    async def _postgres(self) -> asyncpg.Connection:
        """The recorder's PostgreSQL connection, taken from the driver's pool once."""
        if self._pg is None:
            held = contextlib.AsyncExitStack()
            conn = await held.enter_async_context(self.db.driver())
            self._pg = (held, conn)
        return self._pg[1]

    async def _release_postgres(self) -> None:
        if self._pg is not None:
            held, self._pg = self._pg[0], None
            await held.aclose()

    async def _bound_wal(self) -> None:
        """Between two commits: once the log has passed its limit, copy it beside the
        commits, then have it start again; wait for the copy only at twice the limit."""
        if self.wal is None:
            return
        try:
            size = self.wal.stat().st_size
        except FileNotFoundError:
            return
        limit = self.db.wal_limit_bytes
        if size <= limit:  # a log started again keeps its file at the limit
            return
        if self._copying is None:
            self._copying = asyncio.create_task(self._checkpoint("PASSIVE"))
        if not (self._copying.done() or size >= 2 * limit):
            return
        if time.monotonic() < self._restart_at:
            return
        await self._copying  # two checkpoints at once: the second would be refused
        self._copying = None
        if await self._checkpoint("RESTART"):
            self.wal_restarts += 1
        else:
            self._restart_at = time.monotonic() + RESTART_RETRY_S

    async def _checkpoint(self, mode: str) -> bool:
        try:
            return await asyncio.to_thread(self.db.wal_checkpoint, mode, RESTART_BUSY_MS)
        except Exception as e:  # a failed checkpoint must not stop the commits
            log.warning("SQLite %s checkpoint failed: %s", mode, e)
            return False

    def _commit_sync(self, values: list[tuple], daily: list[dict]) -> None:
        # The plain sqlite3 cursor: SQLAlchemy's per-statement work would be most of a
        # small batch's cost, and this thread holds the GIL the event loop needs. The
        # connection is the recorder's own, kept between commits (one commit at a time):
        # a pool checkout and return cost 21 us a commit (docs/PERF.md, issue 53).
        raw = self._sqlite
        if raw is None:
            assert self.db.sync_engine is not None
            raw = self._sqlite = self.db.sync_engine.raw_connection()
        try:
            cur = raw.cursor()
            cur.executemany(SQLITE_USAGE_INSERT, values)
            cur.executemany(SQLITE_DAILY_UPSERT, daily)
            raw.commit()
        except BaseException:
            # a failed commit gives its connection back: the next takes a fresh one
            self._sqlite = None
            try:
                raw.rollback()
            finally:
                raw.close()
            raise

    def _release_sqlite(self) -> None:
        """The recorder's SQLite connection back to its pool (at stop)."""
        if self._sqlite is not None:
            raw, self._sqlite = self._sqlite, None
            raw.close()
