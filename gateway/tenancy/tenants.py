"""Tenants, their quotas and their API keys (with limits of their own): the one service
behind the admin API and the CLI. Every change to a key or a tenant rewrites the auth
epoch in its transaction, so every running gateway drops its cached keys (gateway.tenancy.auth)."""

from __future__ import annotations

import secrets
import time
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError

from gateway.db import (
    ApiKey,
    Quota,
    ServerSetting,
    Tenant,
)
from gateway.tenancy.audit import audit_row
from gateway.tenancy.auth import bump_epoch, generate_key, hash_key, visible_prefix
from gateway.tenancy.quota.limits import LIMIT_FIELDS, SPEND_FIELDS
from gateway.tenancy.quota.prices import to_nanos, to_usd
from gateway.tenancy.usage_queries import UsageQueries

# a fresh database's tenant, so that the first request needs no admin call before it
STARTER_TENANT = "starter"
# a tenant's quota: the limits a key may also have (LIMIT_FIELDS), and a priority and a weight
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
        out[f] = _stored_to_api(f, getattr(q, f)) if q is not None else None
    return out


def key_dict(k: ApiKey) -> dict[str, Any]:
    head = {
        "id": k.id,
        "object": "api_key",
        "tenant_id": k.tenant_id,
        "name": k.name,
        "prefix": k.prefix,
        "scopes": list(k.scopes),
        "priority": k.priority,
    }
    limits = {f: _stored_to_api(f, getattr(k, f)) for f in LIMIT_FIELDS}
    times = {"created_at": k.created_at, "expires_at": k.expires_at, "revoked_at": k.revoked_at}
    return head | limits | times


def _stored_to_api(field: str, value: Any) -> Any:
    return to_usd(value) if field in SPEND_FIELDS and value is not None else value


def _api_to_stored(values: dict[str, Any]) -> dict[str, Any]:
    """Limits as given (money budgets in dollars) as stored (nanodollars)."""
    return {f: _api_to_stored_value(f, v) for f, v in values.items()}


def _api_to_stored_value(field: str, value: Any) -> Any:
    return to_nanos(value) if field in SPEND_FIELDS and value is not None else value


def _new_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(8)}"


class TenantService(UsageQueries):
    """Tenants and keys; the usage reports come from UsageQueries."""

    async def create_tenant(self, name: str, quota: dict[str, Any], actor: str = "cli") -> dict:
        tenant = Tenant(id=_new_id("t"), name=name, created_at=time.time())
        tenant.quota = Quota(
            **_api_to_stored({f: quota.get(f) for f in LIMIT_FIELDS}),
            priority=quota.get("priority") or 0,
            weight=quota.get("weight") or 1.0,
        )
        try:
            async with self.db.session() as s, s.begin():
                s.add(tenant)
                after = tenant_dict(tenant)
                s.add(audit_row(actor, "tenant.create", tenant.id, tenant.id, None, after))
        except IntegrityError:
            raise Conflict(f"a tenant named {name!r} already exists") from None
        return tenant_dict(tenant)

    async def get_tenant(self, tenant_id: str) -> dict:
        async with self.db.session() as s:
            tenant = await s.get(Tenant, tenant_id)
            if tenant is None:
                raise NotFound(f"no tenant {tenant_id!r}")
            return tenant_dict(tenant)

    async def tenant_id_of(self, ref: str) -> str:
        """The id of the tenant `ref` names: its id, or its name (names are unique). People
        create tenants by name, so the command line takes either."""
        async with self.db.session() as s:
            if await s.get(Tenant, ref) is not None:
                return ref
            found = await s.scalar(select(Tenant.id).where(Tenant.name == ref))
        if found is None:
            raise NotFound(f"no tenant {ref!r}")
        return found

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
                before = tenant_dict(tenant)
                if "name" in changes:
                    tenant.name = changes["name"]
                for f in QUOTA_FIELDS:
                    if f in changes:
                        setattr(tenant.quota, f, _api_to_stored_value(f, changes[f]))
                after = tenant_dict(tenant)
                s.add(audit_row(actor, "tenant.update", tenant_id, tenant_id, before, after))
                await bump_epoch(s)
                await s.flush()
                return after
        except IntegrityError:
            raise Conflict(f"a tenant named {changes.get('name')!r} already exists") from None

    async def delete_tenant(self, tenant_id: str, actor: str = "cli") -> None:
        async with self.db.session() as s, s.begin():
            tenant = await s.get(Tenant, tenant_id)
            if tenant is None:
                raise NotFound(f"no tenant {tenant_id!r}")
            keys = await s.scalars(select(ApiKey.id).where(ApiKey.tenant_id == tenant_id))
            before = tenant_dict(tenant) | {"key_ids": list(keys)}  # deleted with it
            await s.execute(delete(ApiKey).where(ApiKey.tenant_id == tenant_id))
            await s.delete(tenant)
            s.add(audit_row(actor, "tenant.delete", tenant_id, tenant_id, before, None))
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
        priority: int | None = None,
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
            priority=priority,
            **_api_to_stored(limits),
        )
        async with self.db.session() as s, s.begin():
            if tenant_id is not None and await s.get(Tenant, tenant_id) is None:
                raise NotFound(f"no tenant {tenant_id!r}")
            s.add(record)
            s.add(audit_row(actor, "key.create", record.id, tenant_id, None, key_dict(record)))
        return key_dict(record), key

    async def update_key(self, key_id: str, changes: dict[str, Any], actor: str = "cli") -> dict:
        """Change a key's name or limits: those in `changes` replace the old ones, None
        lifts a limit."""
        async with self.db.session() as s, s.begin():
            key = await s.get(ApiKey, key_id)
            if key is None:
                raise NotFound(f"no key {key_id!r}")
            before = key_dict(key)
            limits = {f: v for f, v in changes.items() if f in LIMIT_FIELDS}
            _check_limits(key.tenant_id, {f: v for f, v in limits.items() if v is not None})
            for f, value in _api_to_stored(limits).items():
                setattr(key, f, value)
            if "name" in changes:
                key.name = changes["name"] or ""  # null: no name, as a key made without
            if "priority" in changes:
                key.priority = changes["priority"]  # null: its tenant's again
            after = key_dict(key)
            s.add(audit_row(actor, "key.update", key_id, key.tenant_id, before, after))
            await bump_epoch(s)
            return after

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
                before = key_dict(key)
                key.revoked_at = time.time()
                after = key_dict(key)
                s.add(audit_row(actor, "key.revoke", key_id, key.tenant_id, before, after))
                await bump_epoch(s)
            return key_dict(key)

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

    async def create_starter(self) -> str | None:
        """On a database that holds no tenant yet: the tenant STARTER_TENANT, without
        limits, and an inference key for it. The key, to print once; None when a tenant
        exists (or another gateway made the starter first)."""
        async with self.db.session() as s:
            if await s.scalar(select(Tenant.id).limit(1)) is not None:
                return None
        try:
            tenant = await self.create_tenant(STARTER_TENANT, {}, actor="bootstrap")
        except Conflict:
            return None
        _, key = await self.create_key(tenant["id"], "starter", actor="bootstrap")
        return key

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
