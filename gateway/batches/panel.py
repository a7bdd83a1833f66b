"""The batches the dashboard shows (GET /admin/stats's `batches`, `kvgate top`'s batch
panel): every tenant's running batches first, then the latest ended ones, each with its
progress, its result files and what its lines were billed so far at the batch price.
Bounded: a snapshot is read every second, so it holds at most PANEL_BATCHES."""

from __future__ import annotations

from sqlalchemy import Row, case, func, select

from gateway.batches.store import ACTIVE
from gateway.db import Database, UsageRecord
from gateway.db.batch_tables import Batch
from gateway.tenancy.quota.prices import to_usd

PANEL_BATCHES = 20


async def panel_batches(db: Database, limit: int = PANEL_BATCHES) -> list[dict]:
    """Up to `limit` batches, running ones first, each newest first."""
    running_first = case((Batch.status.in_(ACTIVE), 0), else_=1)
    q = select(Batch).order_by(running_first, Batch.created_at.desc(), Batch.id).limit(limit)
    async with db.session() as s:
        batches = list((await s.scalars(q)).all())
        billed = {}
        if batches:
            r = UsageRecord
            sums = select(
                r.batch_id,
                func.count().label("lines"),
                func.sum(r.prompt_tokens + r.completion_tokens).label("tokens"),
                func.sum(r.spend_nano_usd).label("spend"),
            ).where(r.batch_id.in_([b.id for b in batches]))
            for row in (await s.execute(sums.group_by(r.batch_id))).all():
                billed[row.batch_id] = row
    return [_row(b, billed.get(b.id)) for b in batches]


def _row(b: Batch, billed: Row | None) -> dict:
    return {
        "id": b.id,
        "tenant_id": b.tenant_id,
        "status": b.status,
        "endpoint": b.endpoint,
        "created_at": b.created_at,
        "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
        "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id,
        # usage rows of its lines: tokens and dollars at the batch price
        "billed_lines": int(billed.lines) if billed else 0,
        "billed_tokens": int(billed.tokens or 0) if billed else 0,
        "spend": to_usd(int(billed.spend or 0)) if billed else 0.0,
    }
