"""The batch runner: the gateway's own client of its batches, started and stopped with
it (gateway.app). Every batch's lines run as requests of the endpoint they name, through
the same admission and Job as an HTTP request (`execute`, gateway.routes.batch_lines),
at the lowest priority: at most `batch_in_flight` at once, and none started while an
interactive request waits at a replica, or waits or runs at a gateway queue (whose
backend cannot preempt a line): interactive work goes first (`interactive_waiting`).

Durable: the rows are the state (gateway.batches.store). A gateway killed mid-batch
runs, once restarted, every line not answered; a line that was running at the kill runs
again, and its usage row (unique by batch and custom_id) bills it once. A batch past
its window has the rest of its lines expired, unrun and unbilled; one whose tenant's
budget ran out (a 429: batch lines are held to budgets, not rates) has the rest failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.batches import store
from gateway.batches.files import FileStore
from gateway.db import ApiKey, Tenant
from gateway.db.batch_tables import Batch, BatchLine
from gateway.http.errors import error_body
from gateway.state import GatewayState
from gateway.tenancy.auth import Principal, principal_for
from gateway.tenancy.quota import QuotaLimits

log = logging.getLogger("kvgate.batches")
LOWEST_PRIORITY = 2**31 - 1  # vLLM's priority: lower first; a batch line is last
POLL_S = 0.5  # how often the runner looks again while nothing wakes it
PRINCIPAL_TTL_S = 5.0  # a batch's key is read again this often (a revocation stops it)
LEASE_S = 30.0  # a batch's runner holds it this long; renewed at half of it
READ_AHEAD = 32  # pending lines read from the database at once (each read costs the loop)
_END_TIME = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}
_END_TIME |= {"failed": "failed_at"}


@dataclass(frozen=True)
class LineAnswer:
    status: int
    request_id: str | None
    body: dict


# (gateway, principal, endpoint, body, (batch id, custom_id)) -> the line's answer
Execute = Callable[[GatewayState, Principal, str, dict, tuple[str, str]], Awaitable[LineAnswer]]


class BatchRunner:
    def __init__(self, gw: GatewayState, files: FileStore, execute: Execute) -> None:
        self.gw, self.files, self.execute = gw, files, execute
        self.running: dict[str, set[int]] = {}  # batch id -> its lines in flight
        self.stopped: dict[str, dict] = {}  # batch id -> why its rest fails (a budget)
        self.tasks: set[asyncio.Task] = set()
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task | None = None
        self._principals: dict[str, tuple[Principal | None, float]] = {}
        self.leases: dict[str, float] = {}  # batch id -> until when this gateway runs it
        self.held: dict[str, Batch] = {}  # the batches this gateway runs, as last read
        self.ahead: dict[str, deque[BatchLine]] = {}  # batch id -> pending lines read, unstarted
        self.reread = True  # the next turn reads the batches (a route woke it)
        self.read_at = 0.0

    def start(self) -> None:
        self.task = asyncio.create_task(self._loop(), name="batch-runner")

    def wake(self) -> None:
        """A batch was created or cancelled: the next turn reads the batches again."""
        self.reread = True
        self.wakeup.set()

    async def stop(self, timeout_s: float) -> None:
        """No line starts from now; those running get `timeout_s` to finish, then are
        cancelled (and run again at the next start)."""
        if self.task is None:
            return
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.task = None
        if self.tasks:
            _, left = await asyncio.wait(self.tasks, timeout=timeout_s)
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            self.wakeup.clear()
            try:
                await self._turn()
            except Exception:  # the database away: try again at the next turn
                log.exception("the batch runner's turn failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wakeup.wait(), POLL_S)

    async def _turn(self) -> None:
        """Every batch advanced: read again from the database, and claimed, when a route
        woke the runner or POLL_S after the last read; after a line's end, those held as
        last read (a line's end changes no batch's status, and reading them costs the
        event loop, which serves the interactive requests too, about what writing the
        line's answer does: 0.8 ms of CPU on SQLite; PERF.md, issue 50)."""
        now = time.monotonic()
        if self.reread or now - self.read_at >= POLL_S:
            self.reread = False
            batches = await store.active(self.gw.db)
            self.held = {b.id: b for b in batches if await self._hold(b)}
            self.read_at = now
            for gone in self.ahead.keys() - self.held.keys():  # another gateway's now
                del self.ahead[gone]
        for batch in list(self.held.values()):
            await self._advance(batch)

    async def _hold(self, b: Batch) -> bool:
        """Whether this gateway runs the batch (gateways on one database share none)."""
        now = time.time()
        if self.leases.get(b.id, 0.0) - now > LEASE_S / 2:
            return True
        if await store.claim(self.gw.db, b.id, self.gw.settings.instance, now, LEASE_S):
            self.leases[b.id] = now + LEASE_S
            return True
        self.leases.pop(b.id, None)
        return False

    async def _advance(self, b: Batch) -> None:
        db, flying = self.gw.db, self.running.setdefault(b.id, set())
        if b.status == "validating":
            if not await store.start(db, b.id, time.time()):
                self.reread = True  # cancelled since it was read: the next turn sees it
                return
            b.status = "in_progress"
        end = "completed"
        if b.status == "cancelling":
            await self._close_rest(b.id, store.CANCELLED, flying)
            end = "cancelled"
        elif b.status == "in_progress":
            if time.time() >= b.expires_at:
                await self._close_rest(b.id, store.EXPIRED, flying)
                end = "expired"
            elif b.id in self.stopped:
                await self._close_rest(b.id, store.FAILED, flying)
                end = "failed"
            else:
                await self._start_lines(b, flying)
        if not flying and await store.pending_count(db, b.id) == 0:
            await self._finalize(b, end)

    async def _start_lines(self, b: Batch, flying: set[int]) -> None:
        in_flight = sum(map(len, self.running.values()))
        room = self.gw.settings.batch_in_flight - in_flight
        if room <= 0 or interactive_waiting(self.gw, in_flight):
            return
        principal = await self._principal(b)
        if principal is None:
            self.stopped[b.id] = {"code": "key_unavailable", "message": "The batch's API key "
                                  "was revoked or has expired."}  # fmt: skip
            return
        ahead = self.ahead.setdefault(b.id, deque())
        if len(ahead) < room:  # read ahead: a line's end then starts the next unread
            skip = flying | {line.line for line in ahead}
            ahead += await store.pending(self.gw.db, b.id, skip, max(room, READ_AHEAD))
        for _ in range(min(room, len(ahead))):
            line = ahead.popleft()
            flying.add(line.line)
            task = asyncio.create_task(self._run_line(b, principal, line))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _close_rest(self, batch_id: str, state: str, flying: set[int]) -> None:
        """The batch's pending lines but those running closed unrun (its lines read ahead
        among them)."""
        self.ahead.pop(batch_id, None)
        await store.close_rest(self.gw.db, batch_id, state, flying)

    async def _run_line(self, b: Batch, principal: Principal, line: BatchLine) -> None:
        try:
            try:
                body, tag = json.loads(line.body), (b.id, line.custom_id)
                answer = await self.execute(self.gw, principal, b.endpoint, body, tag)
            except Exception:
                log.exception("batch %s line %d failed in the gateway", b.id, line.line)
                answer = LineAnswer(500, None, error_body(500, "The gateway failed this line."))
            if answer.status == 429:  # a budget: the batch's rest would be refused too
                self.stopped[b.id] = {"code": "budget_exceeded", "message": _message(answer)}
            state = store.DONE if answer.status == 200 else store.FAILED
            await store.answer(self.gw.db, b.id, line.line, state, result_line(line, answer))
        finally:
            self.running[b.id].discard(line.line)
            self.wakeup.set()

    async def _principal(self, b: Batch) -> Principal | None:
        """The batch's key as its lines use it: its tenant's budgets but no rates (the
        runner paces itself), at the lowest priority; None: revoked or expired."""
        cached = self._principals.get(b.id)
        if cached is not None and time.monotonic() - cached[1] < PRINCIPAL_TTL_S:
            return cached[0]
        async with self.gw.db.session() as s:
            key = await s.get(ApiKey, b.key_id)
            tenant = None if key is None else await s.get(Tenant, b.tenant_id)
        principal = None
        usable = key is not None and key.revoked_at is None and tenant is not None
        if usable and (key.expires_at is None or key.expires_at > time.time()):
            p = principal_for(key, tenant)
            limits = budgets_only(p.limits)
            principal = dataclasses.replace(p, priority=LOWEST_PRIORITY, limits=limits)
        self._principals[b.id] = (principal, time.monotonic())
        return principal

    async def _finalize(self, b: Batch, end: str) -> None:
        """The output and error files written from the lines' rows, then the batch's end."""
        db, now = self.gw.db, time.time()
        await store.set_status(db, b.id, "finalizing", finalizing_at=b.finalizing_at or now)
        out: list[str] = []
        err: list[str] = []
        for row in await store.lines(db, b.id):
            if row.state == store.DONE:
                out.append(row.result or "")
            else:
                err.append(row.result or json.dumps(closed_line(row, self.stopped.get(b.id))))
        ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        for field, rows, name in (
            ("output_file_id", out, "output"),
            ("error_file_id", err, "error"),
        ):
            if rows:
                data = ("\n".join(rows) + "\n").encode()
                f = await self.files.create(
                    b.tenant_id, "batch_output", f"{b.id}_{name}.jsonl", data
                )
                ids[field] = f.id
        errors = [self.stopped[b.id]] if b.id in self.stopped else None
        await store.set_status(db, b.id, end, errors=errors, **ids, **{_END_TIME[end]: now})
        self.running.pop(b.id, None)
        self.stopped.pop(b.id, None)
        self._principals.pop(b.id, None)
        self.leases.pop(b.id, None)
        self.held.pop(b.id, None)
        self.ahead.pop(b.id, None)
        log.info("batch %s %s", b.id, end)


def interactive_waiting(gw: GatewayState, lines_in_flight: int = 0) -> bool:
    """Whether interactive work (any request but the batch lines) comes first now.

    Behind the gateway's fair queues (the llama.cpp backend's slots, a remote upstream
    with `max_in_flight`), whose backends cannot preempt a line, while one waits or runs:
    each request's priority tells, and a line started beside a running one would share
    its every decode step (on llama.cpp with two slots that cost an interactive request
    2.9x its time alone, PERF.md). At the replicas (an engine's waiting count: in-process,
    or a worker's as its stats say), while more wait than lines are in flight (a line
    counts as waiting until it runs); there the gpu engine preempts a line for a better
    priority. Counting every waiting request instead held new lines back while the
    runner's own lines queued for an engine's slots: the batch ran at 0.74x the same
    lines sent at full concurrency (studies/batch_yield.py, gpu engine)."""
    for q in gw.queues.values():
        if q.waiting_ahead_of(LOWEST_PRIORITY) or q.running_ahead_of(LOWEST_PRIORITY):
            return True
    live = (b for b in gw.router.backends if b.name not in gw.router.broken)
    return sum(b.stats().waiting for b in live) > lines_in_flight


def budgets_only(limits: QuotaLimits | None) -> QuotaLimits | None:
    """`limits` without its rates (rpm, tpm, concurrency), in every scope, and counting
    in none of their windows: a batch's lines never fill the minute's tokens or slots an
    interactive request of the tenant is held to."""
    if limits is None:
        return None
    return dataclasses.replace(
        limits,
        rpm=None,
        tpm=None,
        max_concurrent=None,
        tenant=budgets_only(limits.tenant),
        key=budgets_only(limits.key),
        rates=False,
    )


def result_line(line: BatchLine, answer: LineAnswer) -> dict:
    """A line's answer in OpenAI's output (and error) file shape."""
    response = {"status_code": answer.status, "request_id": answer.request_id, "body": answer.body}
    return {
        "id": "batch_req_" + secrets.token_hex(12),
        "custom_id": line.custom_id,
        "response": response,
        "error": None,
    }


def closed_line(line: BatchLine, why: dict | None) -> dict:
    """A line closed unrun: expired, cancelled, or failed with the batch's reason."""
    error = why or {"code": "batch_failed", "message": "The line was not run."}
    if line.state == store.EXPIRED:
        error = {"code": "batch_expired", "message": "The batch's completion window passed."}
    elif line.state == store.CANCELLED:
        error = {"code": "batch_cancelled", "message": "The batch was cancelled."}
    return {"id": "batch_req_" + secrets.token_hex(12), "custom_id": line.custom_id,
            "response": None, "error": error}  # fmt: skip


def _message(answer: LineAnswer) -> str:
    error = answer.body.get("error")
    return error.get("message", "") if isinstance(error, dict) else str(error)
