"""Quota limits (and `LIMITS`, the one list of the limit fields), the windows they count
in, and what a refusal says.

A request takes from its tenant's counters and, where its API key has limits of its
own, from the key's as well: it is admitted only if both admit it (`QuotaLimits.scopes`).
Money budgets count nanodollars (gateway.tenancy.quota.prices) as token budgets count tokens:
the worst case is reserved at admission and the actual spend settled.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gateway.tenancy.quota.prices import to_usd, usd_text

# The counters a request moves, and the window each one counts in.
REQUESTS, TOKENS, DAILY, MONTHLY, CONCURRENT = (
    "requests",
    "tokens",
    "daily",
    "monthly",
    "concurrent",
)
DAILY_SPEND, MONTHLY_SPEND = "daily_spend", "monthly_spend"  # nanodollars
KINDS = (REQUESTS, TOKENS, DAILY, MONTHLY, CONCURRENT, DAILY_SPEND, MONTHLY_SPEND)
SPEND_KINDS = (DAILY_SPEND, MONTHLY_SPEND)


# Who a set of counters belongs to, as a refusal names it.
TENANT, KEY = "tenant", "key"

# What a limit holds, which decides its type and bounds at the API (gateway.schemas.admin
# bounds each), its flag (gateway.cli.admin) and its column (gateway.db.tables).
COUNT32 = "count32"  # a count that fits a 32-bit column
COUNT53 = "count53"  # a count that fits 53 bits, what every JSON client holds exactly
USD = "usd"  # dollars at the API, nanodollars in the database and the counters
MODELS = "models"  # the model ids allowed


@dataclass(frozen=True)
class LimitField:
    """One limit a tenant and an API key may each have.

    `LIMITS` is the one list of them: the request bodies and the response models
    (gateway.schemas) are built from it, the admin service and the command line loop
    over it, and the quota below maps its counters to it. It lives here, in the tenancy
    room, because tenancy needs the list and may not import schemas (the rooms import
    downward only), while schemas may import tenancy. It names what each field holds, not
    its pydantic type: the bounded types are the request bodies' own
    (gateway.schemas.fields), so that one bound keeps one definition. The database's
    columns (gateway.db.tables.Limits) stay written out: SQLAlchemy maps declared
    attributes, the migrations pin them, and db sits below tenancy;
    tests/gateway/test_limit_fields.py holds them, and `QuotaLimits`, to this list."""

    name: str  # at the API, in the database, and on the command line as --name-with-dashes
    holds: str  # COUNT32, COUNT53, USD or MODELS
    counter: str | None  # one of KINDS, the counter a request takes from; None: checked at auth
    description: str | None = None  # said in responses, not in the request bodies


LIMITS = (
    LimitField("rpm", COUNT32, REQUESTS),
    LimitField("tpm", COUNT53, TOKENS),
    LimitField("max_concurrent", COUNT32, CONCURRENT),
    LimitField("daily_tokens", COUNT53, DAILY),
    LimitField("monthly_tokens", COUNT53, MONTHLY),
    LimitField("daily_spend", USD, DAILY_SPEND, "USD"),
    LimitField("monthly_spend", USD, MONTHLY_SPEND, "USD"),
    LimitField("models", MODELS, None),
)
LIMIT_FIELDS = tuple(f.name for f in LIMITS)
# money budgets: dollars at the API, nanodollars in the database and the counters
SPEND_FIELDS = tuple(f.name for f in LIMITS if f.holds == USD)
_LIMIT_FIELD = {f.counter: f.name for f in LIMITS if f.counter is not None}
COUNTED_LIMITS = tuple(_LIMIT_FIELD.values())  # the limit fields that have counters


RATE_KINDS = (REQUESTS, TOKENS, CONCURRENT)  # what a request without rates never moves


def amounts(requests: int, tokens: int, spend: int = 0, rates: bool = True) -> dict[str, int]:
    """What one admission takes from each counter (`spend` in nanodollars); without
    `rates`, the budgets' alone (QuotaLimits.rates)."""
    wanted = {
        REQUESTS: requests,
        TOKENS: tokens,
        DAILY: tokens,
        MONTHLY: tokens,
        CONCURRENT: requests,
        DAILY_SPEND: spend,
        MONTHLY_SPEND: spend,
    }
    if not rates:
        for kind in RATE_KINDS:
            del wanted[kind]
    return wanted


def checked_limit(limits: QuotaLimits, kind: str, amount: int) -> int | None:
    """The limit an admission is held to on one counter; None: unchecked. Nothing asked
    is never refused: a model with no price is not held to a money budget."""
    return None if amount == 0 else limits.limit_for(kind)


@dataclass(frozen=True)
class QuotaLimits:
    """A request's counted limits (COUNTED_LIMITS), money in nanodollars. They stay
    declared, not built from `LIMITS`: serving reads them by name (`limits.rpm`), and a
    reader and a type checker should see them; the test of `LIMITS` holds them to it."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    daily_tokens: int | None = None
    monthly_tokens: int | None = None
    daily_spend: int | None = None  # nanodollars
    monthly_spend: int | None = None
    # Set by `with_key` for a key with limits of its own: the fields above are then the
    # stricter of the tenant's and the key's (what token planning and the x-ratelimit-*
    # headers see), and admission holds each to counters of its own (`scopes`).
    key_id: str | None = None
    tenant: QuotaLimits | None = None
    key: QuotaLimits | None = None
    # False: a batch line's (gateway.batches.runner.budgets_only): it takes from the token
    # and money budgets only, never from the per-minute windows or the concurrency slots
    # an interactive request of its tenant needs
    rates: bool = True

    @classmethod
    def from_row(cls, row: Any) -> QuotaLimits:
        if row is None:
            return cls()
        return cls(**{f: getattr(row, f) for f in COUNTED_LIMITS})

    @classmethod
    def with_key(cls, tenant: QuotaLimits, key_id: str, key: QuotaLimits) -> QuotaLimits:
        """The tenant's limits with a key's on top; the tenant's alone if the key has none
        (its requests then move no counters of their own)."""
        if key == cls():
            return tenant
        stricter = {f: _least(getattr(tenant, f), getattr(key, f)) for f in COUNTED_LIMITS}
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
        if kind in (DAILY, DAILY_SPEND):
            return self.day
        return self.month if kind in (MONTHLY, MONTHLY_SPEND) else 0

    def reset_s(self, kind: str) -> float:
        # as `of` reads: every response's x-ratelimit-* headers ask it, no dict built
        if kind in (REQUESTS, TOKENS):
            return self.minute_reset_s
        if kind in (DAILY, DAILY_SPEND):
            return self.day_reset_s
        return self.month_reset_s if kind in (MONTHLY, MONTHLY_SPEND) else 1.0


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
    spend: int = 0  # nanodollars: the worst case of the tokens reserved
    settled: bool = False

    def owners(self) -> list[str]:
        """Whose counters it took from."""
        return [scope.owner for scope in self.limits.scopes(self.tenant_id)]

    def deltas(self, used_tokens: int, count_request: bool, used_spend: int) -> list[Delta]:
        """What settling moves on each counter: the reserved tokens and spend replaced by
        those used, the slots freed, the requests given back unless `count_request`;
        in (owner, kind) order, the order every writer of the counters takes them in."""
        w = self.windows
        by_kind = {kind: used_tokens - self.tokens for kind in (TOKENS, DAILY, MONTHLY)}
        by_kind |= {kind: used_spend - self.spend for kind in SPEND_KINDS}
        by_kind[CONCURRENT] = -self.requests
        by_kind[REQUESTS] = 0 if count_request else -self.requests
        if not self.limits.rates:  # admission took nothing from these
            for kind in RATE_KINDS:
                del by_kind[kind]
        return [
            (owner, kind, w.of(kind), delta)
            for owner in sorted(self.owners())
            for kind, delta in sorted(by_kind.items())
            if delta
        ]


Delta = tuple[str, str, int, int]  # owner, kind, window, amount


@dataclass(frozen=True)
class Settlement:
    """What settling one reservation moves in PostgreSQL, for the usage writer to apply
    in the commit that holds the request's usage row (gateway.tenancy.quota.postgres)."""

    instance_id: str  # whose leases hold the slots
    deltas: list[Delta]
    slots: list[tuple[str, int]]  # owner, concurrency slots given back


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
            REQUESTS: "requests per minute (RPM)",
            TOKENS: "tokens per minute (TPM)",
            DAILY: "tokens per day",
            MONTHLY: "tokens per month",
            CONCURRENT: "concurrent requests",
            DAILY_SPEND: "spend per day (daily_spend)",
            MONTHLY_SPEND: "spend per month (monthly_spend)",
        }[self.kind]
        whose = "this API key's" if self.who == KEY else "your tenant's"
        if self.kind in SPEND_KINDS:  # nanodollars, said in dollars
            limit, used, asked = (_usd(v) for v in (self.limit, self.used, self.requested))
            amounts_ = f"limit {limit}, used {used}, requested at most {asked}"
        else:
            unit = "requests" if self.kind in (REQUESTS, CONCURRENT) else "tokens"
            amounts_ = f"limit {self.limit}, used {self.used}, requested {self.requested} {unit}"
        return (
            f"Rate limit reached for {whose} {what}: {amounts_}. "
            f"Please try again in {self.reset_s:.1f}s."
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


def _usd(nanos: int) -> str:
    return "$" + usd_text(to_usd(nanos))


# each per-minute counter's x-ratelimit-* header names, made once (every answer has them)
_HEADER_NAMES = {
    kind: tuple(f"x-ratelimit-{what}-{kind}" for what in ("limit", "remaining", "reset"))
    for kind in (REQUESTS, TOKENS)
}


def ratelimit_headers(
    limits: QuotaLimits, remaining: dict[str, int | None], windows: Windows
) -> dict[str, str]:
    headers = {}
    reset = f"{windows.minute_reset_s:.3f}s"  # both count in the minute window
    for kind, limit in ((REQUESTS, limits.rpm), (TOKENS, limits.tpm)):
        if limit is None:
            continue
        left = remaining.get(kind)
        name_limit, name_remaining, name_reset = _HEADER_NAMES[kind]
        headers[name_limit] = str(limit)
        headers[name_remaining] = str(max(0, left if left is not None else limit))
        headers[name_reset] = reset
    return headers
