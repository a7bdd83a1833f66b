"""Exact in-process counters for one gateway (the SQLite deployment).

admit() checks and takes every counter with no await in between, so on one event
loop two requests can never both take the last slot."""

from __future__ import annotations

from gateway.quota.limits import (
    CONCURRENT,
    DAILY,
    MONTHLY,
    REQUESTS,
    TOKENS,
    QuotaExceeded,
    QuotaLimits,
    Reservation,
    amounts,
    windows_at,
)

Counter = tuple[str, str, int]  # (tenant, kind, window)


class MemoryQuotaStore:
    def __init__(self) -> None:
        self.counters: dict[Counter, int] = {}
        self.minute_of: dict[str, int] = {}  # each tenant's newest minute window

    def preload(self, tenant_id: str, used: dict[str, int], now: float) -> None:
        """Seed the counters (kind -> amount) with the usage already committed in the
        current windows: the database is the record, so a restart resets nothing."""
        w = windows_at(now)
        for kind, amount in used.items():
            self.counters[(tenant_id, kind, w.of(kind))] = amount
            if kind in (REQUESTS, TOKENS):
                self.minute_of[tenant_id] = w.minute

    async def admit(
        self, tenant_id: str, limits: QuotaLimits, tokens: int, now: float, requests: int = 1
    ) -> Reservation:
        w = windows_at(now)
        wanted = amounts(requests, tokens)
        for kind, amount in wanted.items():
            limit = limits.limit_for(kind)
            if limit is None:
                continue
            used = self.counters.get((tenant_id, kind, w.of(kind)), 0)
            if used + amount > limit:
                raise QuotaExceeded(kind, limit, used, amount, w.reset_s(kind))
        for kind, amount in wanted.items():
            key = (tenant_id, kind, w.of(kind))
            self.counters[key] = self.counters.get(key, 0) + amount
        self._drop_old_minute(tenant_id, w.minute)
        remaining = {
            kind: None
            if limits.limit_for(kind) is None
            else limits.limit_for(kind) - self.counters[(tenant_id, kind, w.of(kind))]
            for kind in (REQUESTS, TOKENS)
        }
        return Reservation(tenant_id, tokens, w, remaining, limits, requests)

    async def settle(self, res: Reservation, used_tokens: int, count_request: bool = True) -> None:
        if res.settled:
            return
        res.settled = True
        w, t = res.windows, res.tenant_id
        delta = used_tokens - res.tokens
        for kind in (TOKENS, DAILY, MONTHLY):
            self._add((t, kind, w.of(kind)), delta)
        self._add((t, CONCURRENT, 0), -res.requests)
        if not count_request:
            self._add((t, REQUESTS, w.minute), -res.requests)

    async def used(self, tenant_id: str, now: float) -> dict[str, int]:
        w = windows_at(now)
        return {
            kind: self.counters.get((tenant_id, kind, w.of(kind)), 0)
            for kind in (REQUESTS, TOKENS, DAILY, MONTHLY, CONCURRENT)
        }

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def _add(self, key: Counter, delta: int) -> None:
        if key not in self.counters:
            return  # the window has closed since admission: nothing left to correct
        value = self.counters[key] + delta
        assert value >= 0, f"quota counter {key} went negative"
        self.counters[key] = value

    def _drop_old_minute(self, tenant_id: str, minute: int) -> None:
        previous = self.minute_of.get(tenant_id)
        if previous is not None and previous != minute:
            for kind in (REQUESTS, TOKENS):
                self.counters.pop((tenant_id, kind, previous), None)
        self.minute_of[tenant_id] = minute
