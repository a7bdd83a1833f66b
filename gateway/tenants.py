"""Tenants, their quotas and their API keys (with limits of their own): the one service
behind the admin API and the CLI. Every change to a key or a tenant rewrites the auth
epoch in its transaction, so every running gateway drops its cached keys (gateway.auth)."""

from __future__ import annotations

import calendar
import json
import secrets
import time
from collections import defaultdict
from typing import Any

from sqlalchemy import delete, func, or_, select
from sqlalchemy.exc import IntegrityError

from gateway.auth import bump_epoch, generate_key, hash_key, visible_prefix
from gateway.db import (
    ApiKey,
    AuditLog,
    DailyUsage,
    Database,
    Quota,
    ServerSetting,
    Tenant,
    UsageRecord,
)
from gateway.quota.limits import DAILY, MONTHLY, REQUESTS, TOKENS

# what a tenant and a key may both limit; a tenant also has a priority and a weight
LIMIT_FIELDS = ("rpm", "tpm", "max_concurrent", "daily_tokens", "monthly_tokens", "models")
QUOTA_FIELDS = (*LIMIT_FIELDS, "priority", "weight")


class NotFound(LookupError):
    pass


class Conflict(ValueError):
    pass


def tenant_dict(t: Tenant) -> dict[str, Any]:
    q = t.quota
    out: dict[str, Any] = {
        "id": t.id,
        "object": "tenant",
        "name": t.name,
        "created_at": t.created_at,
    }
    for f in QUOTA_FIELDS:
        out[f] = getattr(q, f) if q is not None else None
    return out


def key_dict(k: ApiKey) -> dict[str, Any]:
    head = {
        "id": k.id,
        "object": "api_key",
        "tenant_id": k.tenant_id,
        "name": k.name,
        "prefix": k.prefix,
        "scopes": list(k.scopes),
    }
    limits = {f: getattr(k, f) for f in LIMIT_FIELDS}
    times = {"created_at": k.created_at, "expires_at": k.expires_at, "revoked_at": k.revoked_at}
    return head | limits | times


def _new_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(8)}"


class TenantService:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create_tenant(self, name: str, quota: dict[str, Any], actor: str = "cli") -> dict:
        tenant = Tenant(id=_new_id("t"), name=name, created_at=time.time())
        tenant.quota = Quota(
            **{f: quota.get(f) for f in LIMIT_FIELDS},
            priority=quota.get("priority") or 0,
            weight=quota.get("weight") or 1.0,
        )
        try:
            async with self.db.session() as s, s.begin():
                s.add(tenant)
                s.add(_audit(actor, "tenant.create", tenant.id, {"name": name, **quota}))
        except IntegrityError:
            raise Conflict(f"a tenant named {name!r} already exists") from None
        return tenant_dict(tenant)

    async def get_tenant(self, tenant_id: str) -> dict:
        async with self.db.session() as s:
            tenant = await s.get(Tenant, tenant_id)
            if tenant is None:
                raise NotFound(f"no tenant {tenant_id!r}")
            return tenant_dict(tenant)

    async def list_tenants(self) -> list[dict]:
        async with self.db.session() as s:
            rows = (await s.scalars(select(Tenant).order_by(Tenant.created_at))).unique().all()
            return [tenant_dict(t) for t in rows]

    async def update_tenant(
        self, tenant_id: str, changes: dict[str, Any], actor: str = "cli"
    ) -> dict:
        try:
            async with self.db.session() as s, s.begin():
                tenant = await s.get(Tenant, tenant_id)
                if tenant is None:
                    raise NotFound(f"no tenant {tenant_id!r}")
                if "name" in changes:
                    tenant.name = changes["name"]
                for f in QUOTA_FIELDS:
                    if f in changes:
                        setattr(tenant.quota, f, changes[f])
                s.add(_audit(actor, "tenant.update", tenant_id, changes))
                await bump_epoch(s)
                await s.flush()
                return tenant_dict(tenant)
        except IntegrityError:
            raise Conflict(f"a tenant named {changes.get('name')!r} already exists") from None

    async def delete_tenant(self, tenant_id: str, actor: str = "cli") -> None:
        async with self.db.session() as s, s.begin():
            tenant = await s.get(Tenant, tenant_id)
            if tenant is None:
                raise NotFound(f"no tenant {tenant_id!r}")
            await s.execute(delete(ApiKey).where(ApiKey.tenant_id == tenant_id))
            await s.delete(tenant)
            s.add(_audit(actor, "tenant.delete", tenant_id, {"name": tenant.name}))
            await bump_epoch(s)

    async def create_key(
        self,
        tenant_id: str | None,
        name: str = "",
        scopes: list[str] | None = None,
        expires_at: float | None = None,
        actor: str = "cli",
        key: str | None = None,
        limits: dict[str, Any] | None = None,
    ) -> tuple[dict, str]:
        """Returns the key's record and the key itself, which is never shown again.
        `limits`: the key's own (LIMIT_FIELDS), held beside its tenant's."""
        limits = {f: v for f, v in (limits or {}).items() if v is not None}
        _check_limits(tenant_id, limits)
        key = key or generate_key()
        record = ApiKey(
            id=_new_id("key"),
            tenant_id=tenant_id,
            name=name,
            prefix=visible_prefix(key),
            key_hash=hash_key(key),
            scopes=scopes or ["inference"],
            created_at=time.time(),
            expires_at=expires_at,
            revoked_at=None,
            **limits,
        )
        async with self.db.session() as s, s.begin():
            if tenant_id is not None and await s.get(Tenant, tenant_id) is None:
                raise NotFound(f"no tenant {tenant_id!r}")
            s.add(record)
            detail = {"tenant_id": tenant_id, "name": name} | limits
            s.add(_audit(actor, "key.create", record.id, detail))
        return key_dict(record), key

    async def update_key(self, key_id: str, changes: dict[str, Any], actor: str = "cli") -> dict:
        """Change a key's name or limits: those in `changes` replace the old ones, None
        lifts a limit."""
        async with self.db.session() as s, s.begin():
            key = await s.get(ApiKey, key_id)
            if key is None:
                raise NotFound(f"no key {key_id!r}")
            limits = {f: v for f, v in changes.items() if f in LIMIT_FIELDS}
            _check_limits(key.tenant_id, {f: v for f, v in limits.items() if v is not None})
            for f, value in limits.items():
                setattr(key, f, value)
            if "name" in changes:
                key.name = changes["name"] or ""  # null: no name, as a key made without
            s.add(_audit(actor, "key.update", key_id, changes))
            await bump_epoch(s)
            return key_dict(key)

    async def list_keys(self, tenant_id: str | None = None) -> list[dict]:
        query = select(ApiKey).order_by(ApiKey.created_at)
        if tenant_id is not None:
            query = query.where(ApiKey.tenant_id == tenant_id)
        async with self.db.session() as s:
            return [key_dict(k) for k in (await s.scalars(query)).all()]

    async def get_key(self, key_id: str) -> dict:
        async with self.db.session() as s:
            key = await s.get(ApiKey, key_id)
            if key is None:
                raise NotFound(f"no key {key_id!r}")
            return key_dict(key)

    async def revoke_key(self, key_id: str, actor: str = "cli") -> dict:
        async with self.db.session() as s, s.begin():
            key = await s.get(ApiKey, key_id)
            if key is None:
                raise NotFound(f"no key {key_id!r}")
            if key.revoked_at is None:
                key.revoked_at = time.time()
                s.add(_audit(actor, "key.revoke", key_id, {}))
                await bump_epoch(s)
            return key_dict(key)

    async def usage(
        self, tenant_id: str | None = None, since: str | None = None, until: str | None = None
    ) -> dict:
        """Daily totals per tenant and model; `since`/`until` are inclusive YYYY-MM-DD."""
        query = select(DailyUsage).order_by(DailyUsage.day, DailyUsage.tenant_id, DailyUsage.model)
        if tenant_id is not None:
            query = query.where(DailyUsage.tenant_id == tenant_id)
        if since:
            query = query.where(DailyUsage.day >= since)
        if until:
            query = query.where(DailyUsage.day <= until)
        async with self.db.session() as s:
            rows = (await s.scalars(query)).all()
        cols = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")
        data = [
            {"tenant_id": r.tenant_id, "day": r.day, "model": r.model}
            | {c: getattr(r, c) for c in cols}
            for r in rows
        ]
        total = {c: sum(d[c] for d in data) for c in cols}
        return {"object": "list", "data": data, "total": total}

    async def committed_usage(self, now: float) -> dict[str, dict[str, int]]:
        """Per tenant, and per key with limits of its own, what its committed rows used
        in the windows open at `now`: tokens this month and today (a tenant's from its
        daily totals), requests and tokens this minute (rows). The in-memory quota store
        starts from these, so a restart resets no window."""
        day = time.strftime("%Y-%m-%d", time.gmtime(now))
        tokens = func.sum(DailyUsage.prompt_tokens + DailyUsage.completion_tokens)
        row_tokens = func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens)
        async with self.db.session() as s:
            month = await s.execute(
                select(DailyUsage.tenant_id, tokens)
                .where(DailyUsage.day.startswith(day[:7]))
                .group_by(DailyUsage.tenant_id)
            )
            today = await s.execute(
                select(DailyUsage.tenant_id, tokens)
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
        for tenant, value in month.all():
            used[tenant][MONTHLY] = int(value or 0)
        for tenant, value in today.all():
            used[tenant][DAILY] = int(value or 0)
        for tenant, requests, value in minute.all():
            used[tenant] |= {REQUESTS: int(requests), TOKENS: int(value or 0)}
        return dict(used) | await self._keys_committed_usage(now)

    async def _keys_committed_usage(self, now: float) -> dict[str, dict[str, int]]:
        """committed_usage for the keys with limits, from their rows of this month (read
        by their tenants' index: there is no daily total per key)."""
        counters = [getattr(ApiKey, f).is_not(None) for f in LIMIT_FIELDS if f != "models"]
        t = time.gmtime(now)
        month_start = calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0))
        today = UsageRecord.created_at >= now - now % 86400
        this_minute = UsageRecord.created_at >= now - now % 60
        tokens = UsageRecord.prompt_tokens + UsageRecord.completion_tokens
        columns = (
            func.sum(tokens),
            func.sum(tokens).filter(today),
            func.sum(tokens).filter(this_minute),
            # a 503 gives its request back (QuotaStore.settle), so it does not count here
            func.count().filter(this_minute, UsageRecord.status != 503),
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
        for key, month, day, minute, requests in rows.all():
            used[key] = {MONTHLY: int(month or 0), DAILY: int(day or 0)}
            used[key] |= {TOKENS: int(minute or 0), REQUESTS: int(requests)}
        return used

    async def ensure_admin_key(self, admin_key: str | None) -> str | None:
        """Make sure an admin key exists. Returns a newly generated key (to print once),
        or None when the configured key or an existing one is used."""
        async with self.db.session() as s:
            if admin_key is not None:
                found = await s.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(admin_key)))
                if found is not None:
                    return None
            else:
                admins = (await s.scalars(select(ApiKey).where(ApiKey.tenant_id.is_(None)))).all()
                if any("admin" in k.scopes and k.revoked_at is None for k in admins):
                    return None
        _, key = await self.create_key(
            None, "bootstrap admin", ["admin"], actor="bootstrap", key=admin_key
        )
        return None if admin_key is not None else key

    async def server_secret(self, configured: str | None) -> str:
        if configured:
            return configured
        async with self.db.session() as s, s.begin():
            row = await s.get(ServerSetting, "cache_salt_secret")
            if row is None:
                row = ServerSetting(key="cache_salt_secret", value=secrets.token_hex(32))
                s.add(row)
            return row.value


def _check_limits(tenant_id: str | None, limits: dict[str, Any]) -> None:
    if tenant_id is None and limits:
        raise ValueError("an admin key belongs to no tenant: it cannot have limits")


def _audit(actor: str, action: str, target: str, detail: dict[str, Any]) -> AuditLog:
    return AuditLog(
        ts=time.time(), actor=actor, action=action, target=target, detail=json.dumps(detail)
    )
