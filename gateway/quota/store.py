"""The interface both quota stores (memory, PostgreSQL) implement."""

from __future__ import annotations

from typing import Protocol

from gateway.quota.limits import QuotaLimits, Reservation


class QuotaStore(Protocol):
    async def admit(
        self, tenant_id: str, limits: QuotaLimits, tokens: int, now: float, requests: int = 1
    ) -> Reservation:
        """Take `requests` requests and concurrency slots and `tokens` from every window of
        every scope of `limits` (the tenant's, and its key's where the key has limits), or
        raise QuotaExceeded, naming the scope that refused, and take nothing."""
        ...

    async def settle(self, res: Reservation, used_tokens: int, count_request: bool = True) -> None:
        """Replace the reserved tokens with those used, free the concurrency slot, and
        give the request back when `count_request` is false. Idempotent."""
        ...

    async def used(self, owner: str, now: float) -> dict[str, int]:
        """Current values of a tenant's or a key's counters, for stats."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...
