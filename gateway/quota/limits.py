"""Quota limits, the windows they count in, and what a refusal says.

A request takes from its tenant's counters and, where its API key has limits of its
own, from the key's as well: it is admitted only if both admit it (`QuotaLimits.scopes`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

# The counters a request moves, and the window each one counts in.
REQUESTS, TOKENS, DAILY, MONTHLY, CONCURRENT = (
    "requests",
    "tokens",
    "daily",
    "monthly",
    "concurrent",
)


# Who a set of counters belongs to, as a refusal names it.
TENANT, KEY = "tenant", "key"

_LIMIT_FIELD = {
    REQUESTS: "rpm",
    TOKENS: "tpm",
    DAILY: "daily_tokens",
    MONTHLY: "monthly_tokens",
    CONCURRENT: "max_concurrent",
}


def amounts(requests: int, tokens: int) -> dict[str, int]:
    """What one admission takes from each counter."""
    return {
        REQUESTS: requests,
        TOKENS: tokens,
        DAILY: tokens,
        MONTHLY: tokens,
        CONCURRENT: requests,
    }


@dataclass(frozen=True)
class QuotaLimits:
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    daily_tokens: int | None = None
    monthly_tokens: int | None = None
    # Set by `with_key` for a key with limits of its own: the fields above are then the
    # stricter of the tenant's and the key's (what token planning and the x-ratelimit-*
    # headers see), and admission holds each to counters of its own (`scopes`).
    key_id: str | None = None
    tenant: QuotaLimits | None = None
    key: QuotaLimits | None = None

    @classmethod
    def from_row(cls, row: Any) -> QuotaLimits:
        if row is None:
            return cls()
        return cls(row.rpm, row.tpm, row.max_concurrent, row.daily_tokens, row.monthly_tokens)

    @classmethod
    def with_key(cls, tenant: QuotaLimits, key_id: str, key: QuotaLimits) -> QuotaLimits:
        """The tenant's limits with a key's on top; the tenant's alone if the key has none
        (its requests then move no counters of their own)."""
        if key == cls():
            return tenant
        stricter = {f: _least(getattr(tenant, f), getattr(key, f)) for f in _LIMIT_FIELD.values()}
        return cls(**stricter, key_id=key_id, tenant=tenant, key=key)

    def limit_for(self, kind: str) -> int | None:
        return getattr(self, _LIMIT_FIELD[kind])

    def scopes(self, tenant_id: str) -> tuple[Scope, ...]:
        """Every set of counters a request takes from: the tenant's, then the key's."""
        if self.key_id is None:
            return (Scope(TENANT, tenant_id, self),)
        assert self.tenant is not None and self.key is not None
        return (Scope(TENANT, tenant_id, self.tenant), Scope(KEY, self.key_id, self.key))


@dataclass(frozen=True)
class Scope:
    """One owner's counters and the limits they are held to. Owner ids never collide:
    tenants' are `t_...`, keys' `key_...`."""

    who: str  # TENANT or KEY
    owner: str
    limits: QuotaLimits


def _least(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


def least_remaining(scopes: tuple[Scope, ...], kind: str, taken: dict[str, int]) -> int | None:
    """What is left of `kind` after an admission, in the tightest scope (None: unlimited);
    `taken` is each owner's counter value after it."""
    left = None
    for scope in scopes:
        limit = scope.limits.limit_for(kind)
        if limit is not None:
            left = _least(left, limit - taken[scope.owner])
    return left


@dataclass(frozen=True)
class Windows:
    """Window ids at one instant: UTC minute, day and month, and seconds until each resets."""

    minute: int
    day: int
    month: int
    minute_reset_s: float
    day_reset_s: float
    month_reset_s: float

    def of(self, kind: str) -> int:
        if kind in (REQUESTS, TOKENS):
            return self.minute
        return {DAILY: self.day, MONTHLY: self.month}.get(kind, 0)

    def reset_s(self, kind: str) -> float:
        return {
            REQUESTS: self.minute_reset_s,
            TOKENS: self.minute_reset_s,
            DAILY: self.day_reset_s,
            MONTHLY: self.month_reset_s,
        }.get(kind, 1.0)


@functools.lru_cache(maxsize=4)
def _month_of_day(day: int) -> tuple[int, float]:
    """(month id, the UNIX time the month ends) for a UTC day number."""
    dt = datetime.fromtimestamp(day * 86400, UTC)
    next_month = datetime(dt.year + dt.month // 12, dt.month % 12 + 1, 1, tzinfo=UTC)
    return dt.year * 12 + dt.month - 1, next_month.timestamp()


def windows_at(now: float) -> Windows:
    day = int(now // 86400)
    month, month_end = _month_of_day(day)
    return Windows(
        minute=int(now // 60),
        day=day,
        month=month,
        minute_reset_s=60 - now % 60,
        day_reset_s=86400 - now % 86400,
        month_reset_s=month_end - now,
    )


@dataclass
class Reservation:
    """What admission took from a tenant's counters (and its key's, where the key has
    limits: `limits.scopes`), to be settled at completion."""

    tenant_id: str
    tokens: int
    windows: Windows
    # remaining requests/tokens after admission, for the x-ratelimit-* headers
    remaining: dict[str, int | None] = field(default_factory=dict)
    limits: QuotaLimits = field(default_factory=QuotaLimits)
    requests: int = 1  # one per choice: n=4 takes four requests and four slots
    settled: bool = False

    def owners(self) -> list[str]:
        """Whose counters it took from."""
        return [scope.owner for scope in self.limits.scopes(self.tenant_id)]


class QuotaExceeded(Exception):
    """A refusal: HTTP 429 with Retry-After and x-ratelimit-* headers; the message names
    whose limit it was, the tenant's or the API key's."""

    def __init__(
        self,
        kind: str,
        limit: int,
        used: int,
        requested: int,
        reset_s: float,
        who: str = TENANT,
    ) -> None:
        self.kind, self.limit, self.used, self.requested = kind, limit, used, requested
        self.reset_s, self.who = reset_s, who
        super().__init__(self._message())

    def _message(self) -> str:
        what = {
            REQUESTS: ("requests per minute (RPM)", "requests"),
            TOKENS: ("tokens per minute (TPM)", "tokens"),
            DAILY: ("tokens per day", "tokens"),
            MONTHLY: ("tokens per month", "tokens"),
            CONCURRENT: ("concurrent requests", "requests"),
        }[self.kind]
        whose = "this API key's" if self.who == KEY else "your tenant's"
        return (
            f"Rate limit reached for {whose} {what[0]}: limit {self.limit}, used {self.used}, "
            f"requested {self.requested} {what[1]}. Please try again in {self.reset_s:.1f}s."
        )

    @property
    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.reset_s))

    def headers(self) -> dict[str, str]:
        """Retry-After and, for the per-minute limits, OpenAI's x-ratelimit-* headers."""
        headers = {"Retry-After": str(self.retry_after_s)}
        if self.kind in (REQUESTS, TOKENS):
            headers[f"x-ratelimit-limit-{self.kind}"] = str(self.limit)
            headers[f"x-ratelimit-remaining-{self.kind}"] = str(max(0, self.limit - self.used))
            headers[f"x-ratelimit-reset-{self.kind}"] = f"{self.reset_s:.3f}s"
        return headers


def ratelimit_headers(
    limits: QuotaLimits, remaining: dict[str, int | None], windows: Windows
) -> dict[str, str]:
    headers = {}
    for kind, limit in ((REQUESTS, limits.rpm), (TOKENS, limits.tpm)):
        if limit is None:
            continue
        left = remaining.get(kind)
        headers[f"x-ratelimit-limit-{kind}"] = str(limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, left if left is not None else limit))
        headers[f"x-ratelimit-reset-{kind}"] = f"{windows.reset_s(kind):.3f}s"
    return headers
