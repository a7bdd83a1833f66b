"""The interface both quota stores (memory, PostgreSQL) implement."""

from __future__ import annotations

from typing import Protocol

from gateway.tenancy.quota.limits import QuotaLimits, Reservation, Settlement


class QuotaStore(Protocol):
    async def admit(
        self,
        tenant_id: str,
        limits: QuotaLimits,
        tokens: int,
        now: float,
        requests: int = 1,
        spend: int = 0,
    ) -> Reservation:
        """Take `requests` requests and concurrency slots, `tokens` and `spend` (nanodollars,
        the worst case of those tokens) from every window of every scope of `limits` (the
        tenant's, and its key's where the key has limits), or raise QuotaExceeded, naming
        the scope that refused, and take nothing."""
        ...

    async def settle(
        self, res: Reservation, used_tokens: int, count_request: bool = True, used_spend: int = 0
    ) -> None:
        """Replace the reserved tokens and spend with those used, free the concurrency
        slot, and give the request back when `count_request` is false. Idempotent."""
        ...

    def settlement(
        self, res: Reservation, used_tokens: int, count_request: bool = True, used_spend: int = 0
    ) -> Settlement | None:
        """Settle as `settle` does, but as part of the commit of the request's usage row:
        the PostgreSQL store returns what to apply there (gateway.tenancy.quota.postgres.
        apply_settlements), the memory store settles at once and returns None."""
        ...

    async def used(self, owner: str, now: float) -> dict[str, int]:
        """Current values of a tenant's or a key's counters, for stats."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...
