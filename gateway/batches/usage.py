"""Batch work apart in `kvgate usage`: per batch, what its lines' usage rows add up to
(they are in the daily totals too, at the batch price)."""

from __future__ import annotations

import calendar
import time

from sqlalchemy import func, select

from gateway.db import Database, UsageRecord
from gateway.tenancy.quota.prices import to_usd


async def batch_usage(
    db: Database, tenant_id: str | None, since: str | None, until: str | None
) -> list[dict]:
    """Per batch of the days `since`..`until` (inclusive YYYY-MM-DD): lines billed,
    tokens and spend in dollars."""
    r = UsageRecord
    query = select(
        r.batch_id,
        r.tenant_id,
        func.count().label("lines"),
        func.sum(r.prompt_tokens).label("prompt_tokens"),
        func.sum(r.completion_tokens).label("completion_tokens"),
        func.sum(r.spend_nano_usd).label("spend"),
    ).where(r.batch_id.is_not(None))
    if tenant_id is not None:
        query = query.where(r.tenant_id == tenant_id)
    if since:
        query = query.where(r.created_at >= _day_start(since))
    if until:
        query = query.where(r.created_at < _day_start(until) + 86400)
    query = query.group_by(r.batch_id, r.tenant_id).order_by(r.tenant_id, r.batch_id)
    async with db.session() as s:
        rows = (await s.execute(query)).all()
    return [
        {
            "batch_id": row.batch_id,
            "tenant_id": row.tenant_id,
            "lines": int(row.lines),
            "prompt_tokens": int(row.prompt_tokens),
            "completion_tokens": int(row.completion_tokens),
            "spend": to_usd(int(row.spend)),
        }
        for row in rows
    ]


def _day_start(day: str) -> int:
    return calendar.timegm(time.strptime(day, "%Y-%m-%d"))
