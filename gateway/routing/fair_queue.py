"""A fair queue in the gateway, for backends whose scheduler kvgate does not control.

The gpu engine shares itself between tenants (backend_gpu/fairness.py). The llama.cpp
backend's slots and a remote upstream serve whatever reaches them first, so for those
the gateway lets at most `slots` requests in flight (a backend's `max_in_flight`) and
holds the rest in one line per tenant, released by the Virtual Token Counter (Sheng et
al., OSDI 2024) as slots free: the waiting tenant with the least weighted service goes
next; a tenant that becomes active is lifted to the smallest counter of the others
waiting (or to the virtual time when none is), so idling banks no credit; a tie goes to
the tenant that has waited longest for a slot. Service is
charged as it happens: the prompt when a request gets its slot, cached prompt tokens
refunded down to CACHED_TOKEN_COST when the backend reports them, output tokens as
they stream. With `fairness="fcfs"` the lines are released in arrival order.

Priority classes come first (a request's `priority`, vLLM's: lower first): a slot that
frees goes to a waiting request of the best priority waiting, and VTC (or arrival
order) chooses only among the tenants with one of those. A batch line (the lowest
priority, gateway/batches) that waits here never goes ahead of an interactive request,
which is how batch work yields on a backend whose own scheduler knows no priority: the
llama.cpp backend's slots and a remote upstream with `max_in_flight`.

A slot frees only when a request ends, so behind a flood of long requests a newcomer
would wait for the nearest end. Under VTC the queue keeps SPARE_SEATS slots beyond
`slots` for a tenant becoming active (nothing in flight or waiting) and not ahead of the
others' counters: its first request starts at once (backends behind a fair queue take `slots + SPARE_SEATS` requests at a
time; the llama.cpp backend holds a sequence for it). Its other requests, and those of
tenants already active, wait for ordinary slots, so weights still divide the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.backends.base import SPARE_SEATS

CACHED_TOKEN_COST = 0.1  # as the gpu engine charges a cached prompt token
FAIRNESS = ("vtc", "fcfs")


@dataclass
class _Tenant:
    weight: float = 1.0
    counter: float = 0.0  # weighted service, lifted when the tenant starts waiting
    service: float = 0.0  # unweighted service given; only goes up
    running: int = 0
    granted_at: int = -1  # when it last got a slot: ties go to the longest without one
    # its waiters by priority (none empty), each line in arrival order: (arrival, waiter)
    waiting: dict[int, deque[tuple[int, asyncio.Future[None]]]] = field(default_factory=dict)

    def waiters(self) -> int:
        return sum(map(len, self.waiting.values()))


class FairQueue:
    def __init__(self, slots: int, fairness: str = "vtc") -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.set_fairness(fairness)
        self.in_flight = 0
        self.holding: dict[int, int] = {}  # requests holding a slot, by priority
        self.vtime = 0.0  # the largest counter any tenant had when it got a slot
        self.tenants: dict[str, _Tenant] = {}
        self._arrival = itertools.count()

    def set_fairness(self, fairness: str) -> None:
        """The policy (a reload may change it: the next slot that frees goes by it)."""
        if fairness not in FAIRNESS:
            raise ValueError(f"fairness must be one of {FAIRNESS}, got {fairness!r}")
        self.fairness = fairness
        self.spare = SPARE_SEATS if fairness == "vtc" else 0

    @contextlib.asynccontextmanager
    async def slot(self, tenant_id: str, weight: float, priority: int = 0) -> AsyncIterator[None]:
        """Hold one of the backend's slots while the body runs (waiting in line first)."""
        await self._acquire(tenant_id, weight, priority)
        try:
            yield
        finally:
            self._release(tenant_id, priority)

    def running_ahead_of(self, priority: int) -> int:
        """How many hold a slot here with a better priority than `priority`."""
        return sum(n for p, n in self.holding.items() if p < priority)

    def waiting_ahead_of(self, priority: int) -> int:
        """How many wait here with a better priority than `priority`."""
        return sum(
            len(line)
            for t in self.tenants.values()
            for p, line in t.waiting.items()
            if p < priority
        )

    def charge(self, tenant_id: str, tokens: float) -> None:
        t = self.tenants[tenant_id]
        t.service += tokens
        t.counter += tokens / t.weight

    def stats(self) -> dict[str, dict]:
        """Per tenant, as the gpu engine reports it in BackendStats.extra["tenants"]."""
        return {
            tenant_id: {
                "weight": t.weight,
                "service": t.service,
                "counter": t.counter,
                "waiting": t.waiters(),
                "running": t.running,
            }
            for tenant_id, t in self.tenants.items()
        }

    async def _acquire(self, tenant_id: str, weight: float, priority: int) -> None:
        t = self.tenants.setdefault(tenant_id, _Tenant())
        t.weight = weight
        newcomer = False
        if not t.waiting and not t.running:  # it becomes active: no credit from idling
            others = [o.counter for o in self.tenants.values() if o is not t and o.waiting]
            floor = min(others) if others else self.vtime
            # the spare seat is for one not ahead of the others: a tenant that keeps
            # coming back with one request at a time cannot ride it past its share
            newcomer = t.counter <= floor
            t.counter = max(t.counter, floor)
        free = self.in_flight < self.slots and not any(o.waiting for o in self.tenants.values())
        if free or (newcomer and self.in_flight < self.slots + self.spare):
            self._grant(tenant_id, priority)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (next(self._arrival), fut)
        t.waiting.setdefault(priority, deque()).append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted, then cancelled: give it back
                self._release(tenant_id, priority)
            elif entry in (line := t.waiting.get(priority, ())):  # _release may have dropped it
                line.remove(entry)
                if not line:
                    del t.waiting[priority]
            raise

    def _grant(self, tenant_id: str, priority: int) -> None:
        t = self.tenants[tenant_id]
        self.in_flight += 1
        self.holding[priority] = self.holding.get(priority, 0) + 1
        t.running += 1
        t.granted_at = next(self._arrival)
        self.vtime = max(self.vtime, t.counter)

    def _release(self, tenant_id: str, priority: int) -> None:
        self.in_flight -= 1
        self.holding[priority] -= 1
        if not self.holding[priority]:
            del self.holding[priority]
        self.tenants[tenant_id].running -= 1
        while self.in_flight < self.slots and (nxt := self._next()) is not None:
            tenant, priority = nxt
            waiting = self.tenants[tenant].waiting
            _, fut = waiting[priority].popleft()
            if not waiting[priority]:
                del waiting[priority]
            if fut.done():  # its waiter was cancelled and has not run yet
                continue
            self._grant(tenant, priority)
            fut.set_result(None)

    def _next(self) -> tuple[str, int] | None:
        """The tenant whose request goes next, and that request's priority: the best one
        waiting; among the tenants with one of it, by VTC or arrival."""
        waiting = [(k, t) for k, t in self.tenants.items() if t.waiting]
        if not waiting:
            return None
        best = min(min(t.waiting) for _, t in waiting)
        waiting = [(k, t) for k, t in waiting if best in t.waiting]
        if self.fairness == "fcfs":
            return min(waiting, key=lambda kt: kt[1].waiting[best][0][0])[0], best
        return min(waiting, key=lambda kt: (kt[1].counter, kt[1].granted_at))[0], best
