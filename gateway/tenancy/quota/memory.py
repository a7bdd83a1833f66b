"""Exact in-process counters for one gateway (the SQLite deployment).

admit() checks and takes every counter, the tenant's and its key's, with no await in
between, so on one event loop two requests can never both take the last slot, and a
refusal by either takes nothing from both."""

from __future__ import annotations

from gateway.tenancy.quota.limits import (
    KINDS,
    REQUESTS,
    TOKENS,
    QuotaExceeded,
    QuotaLimits,
    Reservation,
    amounts,
    checked_limit,
    least_remaining,
    windows_at,
)

Counter = tuple[str, str, int]  # (owner: a tenant or a key, kind, window)


class MemoryQuotaStore:
    def __init__(self) -> None:
        self.counters: dict[Counter, int] = {}
        self.minute_of: dict[str, int] = {}  # each tenant's newest minute window

    def preload(self, owner: str, used: dict[str, int], now: float) -> None:
        """Seed a tenant's or a key's counters (kind -> amount) with the usage already
        committed in the current windows: the database is the record, so a restart
        resets nothing."""
        w = windows_at(now)
        for kind, amount in used.items():
            self.counters[(owner, kind, w.of(kind))] = amount
            if kind in (REQUESTS, TOKENS):
                self.minute_of[owner] = w.minute

    async def admit(
        self,
        tenant_id: str,
        limits: QuotaLimits,
        tokens: int,
        now: float,
        requests: int = 1,
        spend: int = 0,
    ) -> Reservation:
        w = windows_at(now)
        wanted = amounts(requests, tokens, spend, limits.rates)
        scopes = limits.scopes(tenant_id)
        for scope in scopes:
            for kind, amount in wanted.items():
                limit = checked_limit(scope.limits, kind, amount)
                if limit is None:
                    continue
                used = self.counters.get((scope.owner, kind, w.of(kind)), 0)
                if used + amount > limit:
                    raise QuotaExceeded(kind, limit, used, amount, w.reset_s(kind), scope.who)
        for scope in scopes:
            for kind, amount in wanted.items():
                key = (scope.owner, kind, w.of(kind))
                self.counters[key] = self.counters.get(key, 0) + amount
            self._drop_old_minute(scope.owner, w.minute)
        remaining = {
            kind: least_remaining(
                scopes, kind, {s.owner: self.counters[(s.owner, kind, w.minute)] for s in scopes}
            )
            for kind in (REQUESTS, TOKENS)
            if kind in wanted
        }
        return Reservation(tenant_id, tokens, w, remaining, limits, requests, spend)

    async def settle(
        self, res: Reservation, used_tokens: int, count_request: bool = True, used_spend: int = 0
    ) -> None:
        self.settlement(res, used_tokens, count_request, used_spend)

    def settlement(
        self, res: Reservation, used_tokens: int, count_request: bool = True, used_spend: int = 0
    ) -> None:
        """Settle now: in memory there is no commit to join (see QuotaStore)."""
        if res.settled:
            return
        res.settled = True
        for owner, kind, window, delta in res.deltas(used_tokens, count_request, used_spend):
            self._add((owner, kind, window), delta)

    async def used(self, owner: str, now: float) -> dict[str, int]:
        w = windows_at(now)
        return {kind: self.counters.get((owner, kind, w.of(kind)), 0) for kind in KINDS}

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

    def _drop_old_minute(self, owner: str, minute: int) -> None:
        previous = self.minute_of.get(owner)
        if previous is not None and previous != minute:
            for kind in (REQUESTS, TOKENS):
                self.counters.pop((owner, kind, previous), None)
        self.minute_of[owner] = minute
