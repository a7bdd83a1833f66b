"""What the usage rows add up to: the reports behind /admin/usage and `kvgate usage`
(daily totals per tenant and model, the period's totals per tenant and per API key, each
with its spend), and what the in-memory quota store is seeded with at start. A base of
TenantService, which owns the tables these read beside the tenants and keys."""

from __future__ import annotations

import calendar
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, or_, select

from gateway.db import ApiKey, DailyUsage, Database, UsageRecord
from gateway.tenancy.quota.limits import (
    COUNTED_LIMITS,
    DAILY,
    DAILY_SPEND,
    MONTHLY,
    MONTHLY_SPEND,
    REQUESTS,
    TOKENS,
)
from gateway.tenancy.quota.prices import to_usd

USAGE_COUNTS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "image_tokens")


class UsageQueries:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def usage(
        self,
        tenant_id: str | None = None,
        since: str | None = None,
        until: str | None = None,
        summaries: bool = False,
    ) -> dict:
        """Daily totals per tenant and model, each with its spend in dollars; `since`/`until`
        are inclusive YYYY-MM-DD. `summaries`: also the totals of the period per tenant
        and per API key (the key's from its usage rows: there is no daily total per key)."""
        query = select(DailyUsage).order_by(DailyUsage.day, DailyUsage.tenant_id, DailyUsage.model)
        if tenant_id is not None:
            query = query.where(DailyUsage.tenant_id == tenant_id)
        if since:
            query = query.where(DailyUsage.day >= since)
        if until:
            query = query.where(DailyUsage.day <= until)
        async with self.db.session() as s:
            rows = (await s.scalars(query)).all()
        data = [
            {"tenant_id": r.tenant_id, "day": r.day, "model": r.model} | _totals([r]) for r in rows
        ]
        report = {"object": "list", "data": data, "total": _totals(rows)}
        if summaries:
            by_tenant = defaultdict(list)
            for r in rows:
                by_tenant[r.tenant_id].append(r)
            report["tenants"] = [{"tenant_id": t} | _totals(rs) for t, rs in by_tenant.items()]
            report["keys"] = await self._key_usage(tenant_id, since, until)
        return report

    async def _key_usage(
        self, tenant_id: str | None, since: str | None, until: str | None
    ) -> list[dict]:
        """Per API key, what its usage rows of the days `since`..`until` add up to."""
        sums = [func.count().label("requests")] + [
            func.sum(getattr(UsageRecord, c)).label(c)
            for c in (*USAGE_COUNTS[1:], "spend_nano_usd")
        ]
        query = select(UsageRecord.key_id, UsageRecord.tenant_id, ApiKey.name, *sums)
        query = query.outerjoin(ApiKey, ApiKey.id == UsageRecord.key_id)
        if tenant_id is not None:
            query = query.where(UsageRecord.tenant_id == tenant_id)
        if since:
            query = query.where(UsageRecord.created_at >= _day_start(since))
        if until:
            query = query.where(UsageRecord.created_at < _day_start(until) + 86400)
        query = query.group_by(UsageRecord.key_id, UsageRecord.tenant_id, ApiKey.name)
        async with self.db.session() as s:
            rows = (
                await s.execute(query.order_by(UsageRecord.tenant_id, UsageRecord.key_id))
            ).all()
        return [
            {"key_id": r.key_id, "tenant_id": r.tenant_id, "name": r.name} | _totals([r])
            for r in rows
        ]

    async def committed_usage(self, now: float) -> dict[str, dict[str, int]]:
        """Per tenant, and per key with limits of its own, what its committed rows used
        in the windows open at `now`: tokens and spend this month and today (a tenant's
        from its daily totals), requests and tokens this minute (rows). The in-memory quota
        store starts from these, so a restart resets no window."""
        day = time.strftime("%Y-%m-%d", time.gmtime(now))
        tokens = func.sum(DailyUsage.prompt_tokens + DailyUsage.completion_tokens)
        spend = func.sum(DailyUsage.spend_nano_usd)
        row_tokens = func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens)
        async with self.db.session() as s:
            month = await s.execute(
                select(DailyUsage.tenant_id, tokens, spend)
                .where(DailyUsage.day.startswith(day[:7]))
                .group_by(DailyUsage.tenant_id)
            )
            today = await s.execute(
                select(DailyUsage.tenant_id, tokens, spend)
                .where(DailyUsage.day == day)
                .group_by(DailyUsage.tenant_id)
            )
            # a 503 gives its request back (QuotaStore.settle), so it does not count here
            counted = func.count().filter(UsageRecord.status != 503)
            minute = await s.execute(
                select(UsageRecord.tenant_id, counted, row_tokens)
                .where(UsageRecord.created_at >= now - now % 60)
                .group_by(UsageRecord.tenant_id)
            )
        used: dict[str, dict[str, int]] = defaultdict(dict)
        for tenant, value, spent in month.all():
            used[tenant] |= {MONTHLY: int(value or 0), MONTHLY_SPEND: int(spent or 0)}
        for tenant, value, spent in today.all():
            used[tenant] |= {DAILY: int(value or 0), DAILY_SPEND: int(spent or 0)}
        for tenant, requests, value in minute.all():
            used[tenant] |= {REQUESTS: int(requests), TOKENS: int(value or 0)}
        return dict(used) | await self._keys_committed_usage(now)

    async def _keys_committed_usage(self, now: float) -> dict[str, dict[str, int]]:
        """committed_usage for the keys with limits, from their rows of this month (read
        by their tenants' index: there is no daily total per key)."""
        counters = [getattr(ApiKey, f).is_not(None) for f in COUNTED_LIMITS]
        t = time.gmtime(now)
        month_start = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))
        today = UsageRecord.created_at >= now - now % 86400
        this_minute = UsageRecord.created_at >= now - now % 60
        tokens = UsageRecord.prompt_tokens + UsageRecord.completion_tokens
        spend = UsageRecord.spend_nano_usd
        columns = (
            func.sum(tokens),
            func.sum(tokens).filter(today),
            func.sum(tokens).filter(this_minute),
            # a 503 gives its request back (QuotaStore.settle), so it does not count here
            func.count().filter(this_minute, UsageRecord.status != 503),
            func.sum(spend),
            func.sum(spend).filter(today),
        )
        async with self.db.session() as s:
            keys = (
                await s.execute(
                    select(ApiKey.id, ApiKey.tenant_id).where(
                        ApiKey.revoked_at.is_(None), ApiKey.tenant_id.is_not(None), or_(*counters)
                    )
                )
            ).all()
            if not keys:
                return {}
            rows = await s.execute(
                select(UsageRecord.key_id, *columns)
                .where(
                    UsageRecord.tenant_id.in_({tenant for _, tenant in keys}),
                    UsageRecord.created_at >= month_start,
                    UsageRecord.key_id.in_([key for key, _ in keys]),
                )
                .group_by(UsageRecord.key_id)
            )
        used = {}
        for key, month, day, minute, requests, month_spend, day_spend in rows.all():
            used[key] = {MONTHLY: int(month or 0), DAILY: int(day or 0)}
            used[key] |= {TOKENS: int(minute or 0), REQUESTS: int(requests)}
            used[key] |= {MONTHLY_SPEND: int(month_spend or 0), DAILY_SPEND: int(day_spend or 0)}
        return used


def _totals(rows: Sequence[Any]) -> dict[str, Any]:
    """The counts of `rows` (daily totals, or sums of usage rows) added up; spend summed
    exactly in nanodollars, then said in dollars. int(): PostgreSQL sums are numeric."""
    totals = {c: int(sum(getattr(r, c) for r in rows)) for c in USAGE_COUNTS}
    return totals | {"spend": to_usd(int(sum(r.spend_nano_usd for r in rows)))}


def _day_start(day: str) -> int:
    return calendar.timegm(time.strptime(day, "%Y-%m-%d"))
