"""Per-tenant quotas: requests and tokens per minute, concurrency, daily and monthly
token budgets. One process keeps exact counters in memory; several gateways on one
PostgreSQL database share counters there."""

from gateway.tenancy.quota.limits import QuotaExceeded, QuotaLimits, Reservation, windows_at
from gateway.tenancy.quota.memory import MemoryQuotaStore
from gateway.tenancy.quota.store import QuotaStore

__all__ = [
    "MemoryQuotaStore",
    "QuotaExceeded",
    "QuotaLimits",
    "QuotaStore",
    "Reservation",
    "windows_at",
]
