"""Quota limits, the windows they count in, and what a refusal says."""

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

    @classmethod
    def from_row(cls, row: Any) -> QuotaLimits:
        if row is None:
            return cls()
        return cls(row.rpm, row.tpm, row.max_concurrent, row.daily_tokens, row.monthly_tokens)

    def limit_for(self, kind: str) -> int | None:
        return getattr(self, _LIMIT_FIELD[kind])


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
    """What admission took from a tenant's counters, to be settled at completion."""

    tenant_id: str
    tokens: int
    windows: Windows
    # remaining requests/tokens after admission, for the x-ratelimit-* headers
    remaining: dict[str, int | None] = field(default_factory=dict)
    limits: QuotaLimits = field(default_factory=QuotaLimits)
    requests: int = 1  # one per choice: n=4 takes four requests and four slots
    settled: bool = False


class QuotaExceeded(Exception):
    """A refusal: HTTP 429 with Retry-After and x-ratelimit-* headers."""

    def __init__(self, kind: str, limit: int, used: int, requested: int, reset_s: float) -> None:
        self.kind, self.limit, self.used, self.requested = kind, limit, used, requested
        self.reset_s = reset_s
        super().__init__(self._message())

    def _message(self) -> str:
        what = {
            REQUESTS: ("requests per minute (RPM)", "requests"),
            TOKENS: ("tokens per minute (TPM)", "tokens"),
            DAILY: ("tokens per day", "tokens"),
            MONTHLY: ("tokens per month", "tokens"),
            CONCURRENT: ("concurrent requests", "requests"),
        }[self.kind]
        return (
            f"Rate limit reached for {what[0]}: limit {self.limit}, used {self.used}, "
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
