"""The gateway's fair queue (gateway/routing/fair_queue.py), deterministic on one event loop:
slots are never exceeded or leaked, a flooding tenant does not hold another behind its
line, weights share the service, idle time banks no credit, a cancelled waiter leaves
nothing behind, a better priority goes first (a batch line never ahead of an interactive
request, its own tenant's included) with fair share within a class; and through a live
gateway in front of a backend with a slot limit."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI

from gateway.routing.fair_queue import FairQueue
from tests.gateway.conftest import fake_backends


async def _run(queue: FairQueue, tenant: str, cost: int, order: list[str], gate: asyncio.Event):
    async with queue.slot(tenant, queue.tenants[tenant].weight if tenant in queue.tenants else 1):
        assert queue.in_flight <= queue.slots + queue.spare
        order.append(tenant)
        queue.charge(tenant, cost)
        await gate.wait()


async def _drain(tasks: list[asyncio.Task], gate: asyncio.Event) -> None:
    gate.set()
    await asyncio.gather(*tasks)


@pytest.mark.parametrize(("fairness", "quiet_at"), [("vtc", 2), ("fcfs", 11)])
async def test_a_flood_does_not_hold_a_newcomer_behind_its_line(fairness, quiet_at):
    queue, order, gate = FairQueue(1, fairness), [], asyncio.Event()
    tasks = [asyncio.create_task(_run(queue, "flood", 10, order, gate)) for _ in range(10)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(_run(queue, "quiet", 10, order, gate)))
    await _drain(tasks, gate)
    assert order.index("quiet") + 1 == quiet_at
    assert queue.in_flight == 0 and queue.stats()["quiet"]["waiting"] == 0


@pytest.mark.parametrize("fairness", ["vtc", "fcfs"])
async def test_a_newcomer_takes_the_spare_seat_only_under_vtc(fairness):
    queue, order, gate = FairQueue(2, fairness), [], asyncio.Event()
    tasks = [asyncio.create_task(_run(queue, "flood", 10, order, gate)) for _ in range(6)]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(_run(queue, "quiet", 1, order, gate)) for _ in range(2)]
    await asyncio.sleep(0)
    if fairness == "vtc":  # the first of quiet's two starts beside the flood's two
        assert order == ["flood", "flood", "quiet"] and queue.in_flight == 3
    else:
        assert order == ["flood", "flood"] and queue.in_flight == 2
    await _drain(tasks, gate)
    assert queue.in_flight == 0 and sorted(order) == ["flood"] * 6 + ["quiet"] * 2


async def test_weights_share_the_service():
    queue, order = FairQueue(1), []

    async def one(tenant: str, weight: float) -> None:
        async with queue.slot(tenant, weight):
            order.append(tenant)
            queue.charge(tenant, 10)
            await asyncio.sleep(0)

    tasks = [asyncio.create_task(one("heavy", 2.0)) for _ in range(30)]
    tasks += [asyncio.create_task(one("light", 1.0)) for _ in range(30)]
    await asyncio.gather(*tasks)
    first = order[:30]  # while both are backlogged
    assert abs(first.count("heavy") - 2 * first.count("light")) <= 2


async def test_a_tenant_back_from_idle_banks_no_credit():
    queue, order, gate = FairQueue(1), [], asyncio.Event()
    gate.set()
    for _ in range(5):  # "busy" is served alone while "idle" sends nothing
        await _run(queue, "busy", 10, order, gate)
    gate = asyncio.Event()
    tasks = [asyncio.create_task(_run(queue, "busy", 10, order, gate)) for _ in range(6)]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(_run(queue, "idle", 10, order, gate)) for _ in range(6)]
    await _drain(tasks, gate)
    # lifted to busy's counter, "idle" alternates with it instead of taking a run of its own
    assert "idle,idle,idle" not in ",".join(order[5:])
    assert "idle" in order[5:8]


async def test_a_cancelled_waiter_leaves_nothing_behind():
    queue, order, gate = FairQueue(1), [], asyncio.Event()
    holders = [asyncio.create_task(_run(queue, t, 1, order, gate)) for t in "ab"]  # b: spare
    waiter = asyncio.create_task(_run(queue, "b", 1, order, gate))
    await asyncio.sleep(0)
    assert queue.stats()["b"]["waiting"] == 1
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    await _drain(holders, gate)
    assert order == ["a", "b"] and queue.in_flight == 0
    assert queue.stats()["b"]["waiting"] == 0 and queue.stats()["b"]["running"] == 0


async def _ranked(queue: FairQueue, who: str, priority: int, order: list[str], gate) -> None:
    tenant = who.rstrip("0123456789")
    async with queue.slot(tenant, 1.0, priority):
        order.append(who)
        queue.charge(tenant, 10)
        await gate.wait()


@pytest.mark.parametrize("fairness", ["vtc", "fcfs"])
async def test_a_better_priority_goes_first_and_fair_share_holds_within_it(fairness):
    queue, order, gate = FairQueue(1, fairness), [], asyncio.Event()
    batch = 2**31 - 1  # gateway.batches.runner.LOWEST_PRIORITY
    # a's batch lines take the slot (and the spare seat) and queue; then interactive
    # requests: a's own, and b's, which has had more service than c
    tasks = [asyncio.create_task(_ranked(queue, f"a{i}", batch, order, gate)) for i in range(5)]
    await asyncio.sleep(0)
    queue.charge("a", 1000)
    for who in ("b1", "b2"):
        tasks.append(asyncio.create_task(_ranked(queue, who, 0, order, gate)))
    await asyncio.sleep(0)
    queue.tenants["b"].counter += 500  # b has had more service than c when c comes
    tasks += [asyncio.create_task(_ranked(queue, w, 0, order, gate)) for w in ("c1", "a5")]
    await asyncio.sleep(0)
    # VTC gives the spare seat to b, a tenant becoming active; FCFS has none
    assert order == (["a0", "b1"] if fairness == "vtc" else ["a0"])
    await _drain(tasks, gate)
    assert order[5:] == ["a1", "a2", "a3", "a4"]  # every interactive request before a line
    if fairness == "vtc":  # within the class the least served first: c and a level (c
        assert order[2:5] == ["c1", "a5", "b2"]  # never served), then b, 500 tokens ahead
    else:  # arrival order
        assert order[1:5] == ["b1", "b2", "c1", "a5"]
    assert queue.in_flight == 0


@settings(max_examples=60, deadline=None)
@given(
    slots=st.integers(1, 3),
    arrivals=st.lists(
        st.tuples(st.sampled_from("abc"), st.integers(1, 20), st.sampled_from([0, 9])),
        max_size=30,
    ),
    cancel=st.sets(st.integers(0, 29)),
)
def test_slots_are_never_exceeded_or_leaked(slots, arrivals, cancel):
    async def run(queue: FairQueue, tenant: str, cost: int, priority: int, order, gate):
        async with queue.slot(tenant, 1.0, priority):
            assert queue.in_flight <= queue.slots + queue.spare
            assert sum(queue.holding.values()) == queue.in_flight
            order.append(tenant)
            queue.charge(tenant, cost)
            await gate.wait()

    async def scenario() -> None:
        queue, order, gate = FairQueue(slots), [], asyncio.Event()
        tasks = [asyncio.create_task(run(queue, t, c, p, order, gate)) for t, c, p in arrivals]
        await asyncio.sleep(0)
        for i in cancel:
            if i < len(tasks):
                tasks[i].cancel()
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert queue.in_flight == 0 and queue.holding == {}
        assert all(t["waiting"] == 0 and t["running"] == 0 for t in queue.stats().values())
        assert len(order) <= len(arrivals)

    asyncio.run(scenario())


async def test_through_the_gateway_a_quiet_tenant_is_not_queued_behind_a_flood(make_gateway):
    gw = await make_gateway(fake_backends(max_in_flight=1, tokens_per_second=200))
    clients = {}
    for name in ("flood", "quiet"):
        _, key = await gw.tenant(name)
        clients[name] = AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    done: list[str] = []

    async def one(tenant: str) -> None:
        await clients[tenant].completions.create(model="fake-model", prompt="hi", max_tokens=4)
        done.append(tenant)

    flood = [asyncio.create_task(one("flood")) for _ in range(8)]
    queue = gw.state.queues["fake"]
    while sum(t["waiting"] for t in queue.stats().values()) < 6:
        await asyncio.sleep(0.01)
    await one("quiet")
    await asyncio.gather(*flood)
    assert done.index("quiet") <= 2  # next in line after the running one
    _, snap = await gw.admin("GET", "/admin/stats")
    row = next(t for t in snap["tenants"] if t["name"] == "quiet")
    assert row["fair_share"]["service"] > 0 and row["fair_share"]["running"] == 0
