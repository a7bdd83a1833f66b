"""The audit log: one row for every change an operator makes (tenants, keys and their
limits and budgets, pinned prefixes, LoRA adapters, config reloads), saying when, which
admin credential, what (an action on a target) and the object before and after.

A change that is a database write adds its row in the same transaction (`audit_row`), so
there is no change without its row and no row for a change that rolled back; a change
outside the database (a reload) writes its row just before it takes effect, in a step
that cannot fail (`record`). The credential is the admin key's id (`key_...`, never the
key nor its hash), `cli:<user>` for the command line, which works on the database with no
key, `bootstrap` for the admin key made at first start, and `signal:SIGHUP` for a SIGHUP's
reload. Rows carry the records as the admin API shows them, which hold no secret; a pin's
text (a tenant's system prompt) is kept as its length and SHA-256 only, since the row
outlives the pin.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from gateway.db import AuditLog, Database

MAX_PAGE = 1000


@dataclass(frozen=True)
class AuditFilter:
    """Which rows `page` returns, newest first. `action` is one (`key.revoke`) or, with no
    dot, a family (`key`: every key.*); `cursor` is the `next_cursor` of the page before."""

    action: str | None = None
    target: str | None = None
    tenant_id: str | None = None
    since: float | None = None  # UNIX seconds, inclusive
    until: float | None = None  # UNIX seconds, exclusive
    limit: int = 100
    cursor: int | None = None


def audit_row(
    actor: str,
    action: str,
    target: str,
    tenant_id: str | None,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> AuditLog:
    """The row of one change: add it to the session that makes the change."""
    return AuditLog(
        ts=time.time(),
        actor=actor,
        action=action,
        target=target,
        tenant_id=tenant_id,
        before=before,
        after=after,
    )


async def record(
    db: Database,
    actor: str,
    action: str,
    target: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> None:
    """The row of a change that is no database write (a config reload), in a transaction
    of its own."""
    async with db.session() as s, s.begin():
        s.add(audit_row(actor, action, target, None, before, after))


def text_digest(text: str) -> dict[str, Any]:
    """A text the log must not keep (a pin's system prompt) as what identifies it."""
    return {"chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def audit_dict(row: AuditLog) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "audit_entry",
        "ts": row.ts,
        "actor": row.actor,
        "action": row.action,
        "target": row.target,
        "tenant_id": row.tenant_id,
        "before": row.before,
        "after": row.after,
    }


async def page(db: Database, f: AuditFilter) -> dict[str, Any]:
    """One page of rows, newest first, and the cursor of the next (None: no more)."""
    query = select(AuditLog).order_by(AuditLog.id.desc()).limit(f.limit + 1)
    if f.action is not None:
        if "." in f.action:
            query = query.where(AuditLog.action == f.action)
        else:
            query = query.where(AuditLog.action.startswith(f.action + ".", autoescape=True))
    if f.target is not None:
        query = query.where(AuditLog.target == f.target)
    if f.tenant_id is not None:
        query = query.where(AuditLog.tenant_id == f.tenant_id)
    if f.since is not None:
        query = query.where(AuditLog.ts >= f.since)
    if f.until is not None:
        query = query.where(AuditLog.ts < f.until)
    if f.cursor is not None:
        query = query.where(AuditLog.id < f.cursor)
    async with db.session() as s:
        rows = (await s.scalars(query)).all()
    more = len(rows) > f.limit
    rows = rows[: f.limit]
    data = [audit_dict(r) for r in rows]
    next_cursor = rows[-1].id if more else None
    return {"object": "list", "data": data, "next_cursor": next_cursor}
