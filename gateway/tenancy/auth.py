"""API keys: generation, hashing, and the lookup from a bearer token to a principal.

A key is `kvg-` + 43 URL-safe characters (32 random bytes). Only its SHA-256 is
stored, with the first 12 characters as a visible prefix to find it by; the hash
is compared in constant time. Resolved keys are cached for `ttl_s` so that the hot
path does not touch the database. Every change to a key or a tenant, by any writer
(the admin API of any gateway, the CLI), rewrites the auth epoch row in the same
transaction; each gateway reads that one row at most every EPOCH_CHECK_S, on a request,
and drops its whole cache when it changed. A revoked key is so refused by every gateway
on the database from EPOCH_CHECK_S after the revocation at most. On PostgreSQL the same
transaction also announces the change (gateway.tenancy.auth_notify), and a gateway that is
listening reads no epoch at all.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db import ApiKey, Database, ServerSetting, Tenant
from gateway.tenancy.auth_notify import AuthListener, notify
from gateway.tenancy.quota import QuotaLimits

KEY_PREFIX = "kvg-"
VISIBLE_PREFIX_LEN = 12
SCOPES = ("inference", "admin")
AUTH_EPOCH = "auth_epoch"  # the server_settings row
LISTENING_TTL_S = 300.0
EPOCH_CHECK_S = 0.1  # one primary-key read at most this often, and only while requests come

log = logging.getLogger("kvgate")


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def visible_prefix(key: str) -> str:
    return key[:VISIBLE_PREFIX_LEN]


@dataclass(frozen=True)
class Principal:
    key_id: str
    tenant_id: str | None  # None for admin keys that belong to no tenant
    tenant_name: str
    scopes: tuple[str, ...]
    limits: QuotaLimits
    models: tuple[str, ...] | None  # None: every model
    priority: int = 0
    weight: float = 1.0  # fair-share weight among tenants

    @property
    def is_admin(self) -> bool:
        return "admin" in self.scopes and self.tenant_id is None

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


def missing_scope(principal: Principal, scope: str) -> str:
    """The 403's message for a key without `scope`. An admin key sent to a model is the
    first mistake of a new user: it says how to make a key that calls models."""
    if principal.is_admin and scope == "inference":
        return (
            "This is an admin key: it manages tenants and keys, and calls no model. Send a "
            "tenant's key. Make one with `kvgate keys create TENANT` (TENANT: a tenant's "
            "name or id, such as starter), or with this key: POST /admin/tenants/{tenant_id}"
            '/keys with {"name": "app"}; POST /admin/tenants with {"name": ...} makes a tenant.'
        )
    return f"This API key does not have the {scope!r} scope."


class AuthError(Exception):
    """The key is missing, unknown, revoked or expired: HTTP 401."""


class Authenticator:
    def __init__(self, db: Database, ttl_s: float = 5.0) -> None:
        self.db = db
        self.ttl_s = ttl_s
        # digest -> (principal, fetched at, expires at, the generation it was loaded in)
        self._cache: dict[str, tuple[Principal, float, float | None, int]] = {}
        # one database lookup per key at a time, however many requests wait on it
        self._loading: dict[str, asyncio.Future[tuple[Principal, float | None]]] = {}
        self._epoch: str | None = None
        self._generation = 0  # moves when the epoch does: older entries are stale
        self._epoch_read_at = -EPOCH_CHECK_S
        self._epoch_read: asyncio.Future[None] | None = None
        # on PostgreSQL changes are announced (gateway.tenancy.auth_notify): no epoch reads then
        self.listener = AuthListener(db, self.changed) if db.is_postgres else None

    def _ttl(self) -> float:
        """While changes are announced a cached key is dropped when it changes, so it
        need not be read again every `ttl_s`."""
        if self.listener is not None and self.listener.listening:
            return max(self.ttl_s, LISTENING_TTL_S)
        return self.ttl_s

    def changed(self) -> None:
        """Keys or tenants changed somewhere: every cached key is stale."""
        self._generation += 1
        self._cache.clear()

    def forget_key(self, key_id: str) -> None:
        for digest, (principal, *_) in list(self._cache.items()):
            if principal.key_id == key_id:
                del self._cache[digest]

    def forget_tenant(self, tenant_id: str) -> None:
        for digest, (principal, *_) in list(self._cache.items()):
            if principal.tenant_id == tenant_id:
                del self._cache[digest]

    async def authenticate(self, authorization: str | None) -> Principal:
        token = bearer_token(authorization)
        digest = hash_key(token)
        await self._check_epoch()
        now = time.time()
        cached = self._cache.get(digest)
        if cached is not None:
            principal, fetched_at, expires_at, generation = cached
            if now - fetched_at < self._ttl() and generation == self._generation:
                if expires_at is not None and now >= expires_at:
                    raise AuthError("API key has expired.")
                return principal
        loading = self._loading.get(digest)
        if loading is None:
            loading = asyncio.ensure_future(self._load(token, digest, now))
            self._loading[digest] = loading
            loading.add_done_callback(lambda _: self._loading.pop(digest, None))
        generation = self._generation
        principal, expires_at = await asyncio.shield(loading)
        self._cache[digest] = (principal, now, expires_at, generation)
        return principal

    async def _check_epoch(self) -> None:
        """Read the epoch if EPOCH_CHECK_S has passed since the last read (requests that
        come meanwhile wait on the same read); a new one drops every cached key."""
        if self.listener is not None and self.listener.listening:
            return
        read = self._epoch_read
        if read is None:
            if time.monotonic() - self._epoch_read_at < EPOCH_CHECK_S:
                return
            read = self._epoch_read = asyncio.ensure_future(self._read_epoch())
            read.add_done_callback(self._epoch_read_done)
        await asyncio.shield(read)

    def _epoch_read_done(self, _: asyncio.Future[None]) -> None:
        self._epoch_read = None

    async def _read_epoch(self) -> None:
        self._epoch_read_at = time.monotonic()  # from the start: a commit after it is new
        try:
            epoch = await self.db.setting(AUTH_EPOCH)
        except Exception:  # the database is away: cached keys serve out their TTL
            log.warning("could not read the auth epoch", exc_info=True)
            return
        if epoch != self._epoch:
            self._epoch = epoch
            self.changed()

    async def _load(self, token: str, digest: str, now: float) -> tuple[Principal, float | None]:
        # one statement in autocommit: one round trip on PostgreSQL, not three
        async with self.db.autocommit() as conn, AsyncSession(conn) as session:
            rows = (
                await session.execute(
                    select(ApiKey, Tenant)
                    .outerjoin(Tenant, ApiKey.tenant_id == Tenant.id)
                    .where(ApiKey.prefix == visible_prefix(token))
                )
            ).all()
        for key, tenant in rows:
            if not hmac.compare_digest(key.key_hash, digest):
                continue
            if key.revoked_at is not None:
                raise AuthError("API key has been revoked.")
            if key.expires_at is not None and now >= key.expires_at:
                raise AuthError("API key has expired.")
            if key.tenant_id is not None and tenant is None:
                break
            return principal_for(key, tenant), key.expires_at
        raise AuthError("Incorrect API key provided.")


def principal_for(key: ApiKey, tenant: Tenant | None) -> Principal:
    """A key's tenant's quota, with the key's own limits on top: the stricter of each
    limit, only the models both allow, and the later of the two priorities."""
    quota = tenant.quota if tenant is not None else None
    tenant_models = quota.models if quota is not None else None
    priority = quota.priority if quota is not None else 0
    if key.priority is not None:  # a key's own only yields: never ahead of its tenant's
        priority = max(priority, key.priority)
    return Principal(
        key_id=key.id,
        tenant_id=key.tenant_id,
        tenant_name=tenant.name if tenant is not None else "admin",
        scopes=tuple(key.scopes),
        limits=QuotaLimits.with_key(QuotaLimits.from_row(quota), key.id, QuotaLimits.from_row(key)),
        models=_both_allow(tenant_models, key.models),
        priority=priority,
        weight=quota.weight if quota is not None else 1.0,
    )


def _both_allow(tenant: list[str] | None, key: list[str] | None) -> tuple[str, ...] | None:
    if tenant is None or key is None:
        allowed = tenant if key is None else key
        return None if allowed is None else tuple(allowed)
    return tuple(m for m in tenant if m in key)


async def bump_epoch(session: AsyncSession) -> None:
    """Tell every gateway on this database to drop its cached keys: call it in the
    transaction that changes a key or a tenant, so that the change and the news of it
    commit together."""
    await session.execute(
        update(ServerSetting)
        .where(ServerSetting.key == AUTH_EPOCH)
        .values(value=secrets.token_hex(8))
    )
    await notify(session)


def bearer_token(authorization: str | None) -> str:
    if not authorization:
        raise AuthError(
            "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
        )
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthError("Malformed Authorization header; expected 'Bearer YOUR_KEY'.")
    # keys are printable ASCII; anything else (bytes that are not UTF-8 arrive as
    # surrogates) cannot match one and must not reach the hashing
    if not (token.isascii() and token.isprintable()):
        raise AuthError("Incorrect API key provided.")
    return token
