"""The batch runner's rules (issue 50) on their own: no line starts while an interactive
request waits at a replica, or waits or runs at a gateway queue; lines keep the budgets but not the rates, and take
nothing from the minute's windows or the slots (both quota stores); the batch price is
half the model's unless the config names one; lines read ahead run once, in order, and
close unrun when the batch is cancelled."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine_api.records import BackendStats
from gateway.batches import store
from gateway.batches.files import FileStore
from gateway.batches.jsonl import InputLine
from gateway.batches.prices import batch_price
from gateway.batches.runner import (
    LOWEST_PRIORITY,
    BatchRunner,
    LineAnswer,
    budgets_only,
    interactive_waiting,
)
from gateway.config import Settings
from gateway.db import Database, migrate
from gateway.routing.fair_queue import FairQueue
from gateway.tenancy.quota import MemoryQuotaStore, QuotaExceeded, QuotaLimits
from gateway.tenancy.quota.postgres import PostgresQuotaStore
from gateway.tenancy.tenants import TenantService
from tests.conftest import PG_URL

NOW = 1_800_000_000.0 + 5  # 5 s into a minute


class _Replica:
    def __init__(self, name: str, waiting: int) -> None:
        self.name, self.waiting = name, waiting

    def stats(self) -> BackendStats:
        return BackendStats(self.name, waiting=self.waiting)


def _gw(replicas: list[_Replica], queues: dict[str, FairQueue], broken=()) -> SimpleNamespace:
    router = SimpleNamespace(backends=replicas, broken=dict.fromkeys(broken, "down"))
    return SimpleNamespace(router=router, queues=queues)


async def test_no_line_starts_while_a_request_waits() -> None:
    assert not interactive_waiting(_gw([_Replica("a", 0)], {}))
    assert interactive_waiting(_gw([_Replica("a", 0), _Replica("b", 2)], {}))
    assert not interactive_waiting(_gw([_Replica("b", 2)], {}, broken=["b"]))
    # the runner's own lines waiting for an engine's slots are not interactive work
    assert not interactive_waiting(_gw([_Replica("a", 2)], {}), lines_in_flight=2)
    assert interactive_waiting(_gw([_Replica("a", 3)], {}), lines_in_flight=2)
    queue = FairQueue(1)
    holding = asyncio.Event()

    async def hold(priority: int = 0) -> None:
        async with queue.slot("t_1", 1.0, priority):
            holding.set()
            await asyncio.sleep(3600)

    # the runner's own lines, holding the queue's slot or waiting there (a remote
    # upstream's, llama.cpp's), are not interactive work, however many are in flight
    lines = [asyncio.create_task(hold(LOWEST_PRIORITY)) for _ in range(3)]
    await holding.wait()
    assert queue.in_flight == 1 and queue.stats()["t_1"]["waiting"] == 2
    assert not interactive_waiting(_gw([], {"q": queue}), lines_in_flight=0)
    # an interactive request waiting there: lines wait
    interactive = asyncio.create_task(hold())
    await asyncio.sleep(0)
    assert interactive_waiting(_gw([], {"q": queue}), lines_in_flight=3)
    # and while it runs there: a line beside it would share its steps (no preemption)
    lines[0].cancel()
    await asyncio.sleep(0)
    assert queue.holding == {0: 1} and queue.waiting_ahead_of(LOWEST_PRIORITY) == 0
    assert interactive_waiting(_gw([], {"q": queue}), lines_in_flight=3)
    interactive.cancel()
    await asyncio.sleep(0)
    assert queue.holding == {LOWEST_PRIORITY: 1}  # the next line took the slot
    assert not interactive_waiting(_gw([], {"q": queue}), lines_in_flight=2)
    for task in lines:
        task.cancel()
    await asyncio.gather(interactive, *lines, return_exceptions=True)
    assert queue.in_flight == 0 and queue.holding == {}


def test_lines_keep_the_budgets_not_the_rates() -> None:
    tenant = QuotaLimits(rpm=1, tpm=10, max_concurrent=1, daily_tokens=100, monthly_spend=5)
    key = QuotaLimits(rpm=2, daily_tokens=50)
    kept = budgets_only(QuotaLimits.with_key(tenant, "key_1", key))
    assert kept is not None and kept.tenant is not None and kept.key is not None
    for limits in (kept, kept.tenant, kept.key):
        assert (limits.rpm, limits.tpm, limits.max_concurrent) == (None, None, None)
    assert (kept.daily_tokens, kept.tenant.monthly_spend, kept.key.daily_tokens) == (50, 5, 50)


@pytest.fixture(params=["memory", "postgres"])
async def quota(request):
    if request.param == "memory":
        yield MemoryQuotaStore()
        return
    db = Database(PG_URL, request.getfixturevalue("pg_schema"))
    await migrate(db)
    yield PostgresQuotaStore(db)
    await db.close()


async def test_lines_leave_the_minute_and_the_slots_to_interactive_requests(quota) -> None:
    tenant = QuotaLimits(rpm=2, tpm=100, max_concurrent=1, daily_tokens=1000, daily_spend=900)
    key = QuotaLimits(tpm=100, daily_tokens=5000)
    interactive = QuotaLimits.with_key(tenant, "key_1", key)
    lines = budgets_only(interactive)
    assert lines is not None
    # three lines at once, each past the minute's tokens, running together past the slot
    held = [await quota.admit("t_1", lines, 300, NOW, spend=200) for _ in range(3)]
    used = await quota.used("t_1", NOW)
    assert (used["requests"], used["tokens"], used["concurrent"]) == (0, 0, 0)
    assert (used["daily"], used["daily_spend"]) == (900, 600)  # the budgets count them
    assert (await quota.used("key_1", NOW))["daily"] == 900
    # an interactive request of the tenant still has the whole minute and its slot
    res = await quota.admit("t_1", interactive, 100, NOW)
    with pytest.raises(QuotaExceeded) as e:  # and the budgets hold both kinds
        await quota.admit("t_1", lines, 1, NOW)
    assert e.value.kind == "daily"
    for r in held:
        await quota.settle(r, 250, used_spend=150)
    await quota.settle(res, 80)
    used = await quota.used("t_1", NOW)
    assert (used["requests"], used["tokens"], used["concurrent"]) == (1, 80, 0)
    assert (used["daily"], used["daily_spend"]) == (3 * 250 + 80, 3 * 150)
    assert (await quota.used("key_1", NOW))["tokens"] == 80


def test_the_batch_price_is_half_unless_configured() -> None:
    prices = {"m": {"input": 1.0, "output": 3.000001}, "n": {"input": 2.0}}
    settings = Settings(prices=prices, batch_prices={"n": {"input": 0.5, "output": 1.0}})
    gw = SimpleNamespace(settings=settings, price_of=settings.price_of)
    half = batch_price(gw, "m")  # type: ignore[arg-type]
    full = settings.price_of("m")
    assert (half.input, half.cached_input) == (full.input // 2, full.cached_input // 2)
    assert half.output == (full.output + 1) // 2  # an odd picodollar rounds up
    assert batch_price(gw, "n") == settings.batch_prices["n"]  # type: ignore[arg-type]
    assert batch_price(gw, "free").output == 0  # type: ignore[arg-type]


async def test_lines_read_ahead_run_once_in_order_and_close_unrun_on_cancel(
    tmp_path, monkeypatch
) -> None:
    """The runner reads a batch's pending lines ahead (one read for many lines' starts):
    each line runs once, in file order; cancelled, the lines read ahead close unrun."""
    db = Database(f"sqlite+aiosqlite:///{tmp_path / 'runner.db'}")
    await migrate(db)
    tenants = TenantService(db)
    tenant = await tenants.create_tenant("acme", {}, "test")
    key, _ = await tenants.create_key(tenant["id"])
    files = FileStore(db, tmp_path / "files")
    files.open()
    settings = SimpleNamespace(batch_in_flight=2, instance="gw-a")
    gw = _gw([], {})
    gw.db, gw.settings = db, settings
    ran: list[str] = []
    hold = asyncio.Event()
    reads = 0

    async def execute(gw, principal, endpoint, body, tag) -> LineAnswer:
        ran.append(tag[1])
        if len(ran) > 10:  # the 11th and 12th lines wait while the batch is cancelled
            await hold.wait()
        return LineAnswer(200, "r", {"ok": True})

    async def counted(*args, **kwargs):
        nonlocal reads
        reads += 1
        return await pending(*args, **kwargs)

    pending = store.pending
    monkeypatch.setattr(store, "pending", counted)
    lines = [InputLine(f"l{i}", "/v1/completions", {}) for i in range(40)]
    batch = await store.create(
        db, tenant["id"], key["id"], "/v1/completions", "f", "24h", {}, lines
    )
    runner = BatchRunner(gw, files, execute)
    runner.start()
    try:
        while len(ran) < 12:
            await asyncio.sleep(0.01)
        assert await store.cancel(db, batch.id)
        runner.wake()
        while (await store.get(db, batch.id)).status != "cancelled":
            hold.set()
            await asyncio.sleep(0.01)
        states = [row.state for row in await store.lines(db, batch.id)]
    finally:
        await runner.stop(5)
        await db.close()
    assert ran == [f"l{i}" for i in range(12)]  # once each, in order, none after the cancel
    assert reads == 1  # 12 lines started from one read of 32
    assert states == [store.DONE] * 12 + [store.CANCELLED] * 28
