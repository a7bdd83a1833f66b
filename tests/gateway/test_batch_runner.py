"""The batch runner's rules (issue 50) on their own: no line starts while a request waits
at a replica or a gateway queue; lines keep the budgets but not the rates; the batch
price is half the model's unless the config names one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from engine_api.records import BackendStats
from gateway.batches.prices import batch_price
from gateway.batches.runner import budgets_only, interactive_waiting
from gateway.config import Settings
from gateway.routing.fair_queue import FairQueue
from gateway.tenancy.quota import QuotaLimits


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

    async def hold() -> None:
        async with queue.slot("t_1", 1.0):
            holding.set()
            await asyncio.sleep(3600)

    first = asyncio.create_task(hold())
    await holding.wait()
    assert not interactive_waiting(_gw([], {"q": queue}))  # running, none waiting
    second = asyncio.create_task(hold())
    await asyncio.sleep(0)
    assert interactive_waiting(_gw([], {"q": queue}))
    for task in (first, second):
        task.cancel()
    await asyncio.gather(first, second, return_exceptions=True)


def test_lines_keep_the_budgets_not_the_rates() -> None:
    tenant = QuotaLimits(rpm=1, tpm=10, max_concurrent=1, daily_tokens=100, monthly_spend=5)
    key = QuotaLimits(rpm=2, daily_tokens=50)
    kept = budgets_only(QuotaLimits.with_key(tenant, "key_1", key))
    assert kept is not None and kept.tenant is not None and kept.key is not None
    for limits in (kept, kept.tenant, kept.key):
        assert (limits.rpm, limits.tpm, limits.max_concurrent) == (None, None, None)
    assert (kept.daily_tokens, kept.tenant.monthly_spend, kept.key.daily_tokens) == (50, 5, 50)


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
