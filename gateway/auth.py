"""API keys: generation, hashing, and the lookup from a bearer token to a principal.

A key is `kvg-` + 43 URL-safe characters (32 random bytes). Only its SHA-256 is
stored, with the first 12 characters as a visible prefix to find it by; the hash
is compared in constant time. Resolved keys are cached for `ttl_s` so that the hot
path does not touch the database; revocation through the admin API drops the
cache entry at once, other writers (the CLI, another gateway) within the TTL.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import select

from gateway.db import ApiKey, Database, Tenant
from gateway.quota import QuotaLimits

KEY_PREFIX = "kvg-"
VISIBLE_PREFIX_LEN = 12
SCOPES = ("inference", "admin")


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


class AuthError(Exception):
    """The key is missing, unknown, revoked or expired: HTTP 401."""


class Authenticator:
    def __init__(self, db: Database, ttl_s: float = 5.0) -> None:
        self.db = db
        self.ttl_s = ttl_s
        self._cache: dict[str, tuple[Principal, float, float | None]] = {}
        # one database lookup per key at a time, however many requests wait on it
        self._loading: dict[str, asyncio.Future[tuple[Principal, float | None]]] = {}

    def forget_key(self, key_id: str) -> None:
        for digest, (principal, _, _) in list(self._cache.items()):
            if principal.key_id == key_id:
                del self._cache[digest]

    def forget_tenant(self, tenant_id: str) -> None:
        for digest, (principal, _, _) in list(self._cache.items()):
            if principal.tenant_id == tenant_id:
                del self._cache[digest]

    async def authenticate(self, authorization: str | None) -> Principal:
        token = bearer_token(authorization)
        digest = hash_key(token)
        now = time.time()
        cached = self._cache.get(digest)
        if cached is not None:
            principal, fetched_at, expires_at = cached
            if now - fetched_at < self.ttl_s:
                if expires_at is not None and now >= expires_at:
                    raise AuthError("API key has expired.")
                return principal
        loading = self._loading.get(digest)
        if loading is None:
            loading = asyncio.ensure_future(self._load(token, digest, now))
            self._loading[digest] = loading
            loading.add_done_callback(lambda _: self._loading.pop(digest, None))
        principal, expires_at = await asyncio.shield(loading)
        self._cache[digest] = (principal, now, expires_at)
        return principal

    async def _load(self, token: str, digest: str, now: float) -> tuple[Principal, float | None]:
        async with self.db.session() as session:
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
    quota = tenant.quota if tenant is not None else None
    return Principal(
        key_id=key.id,
        tenant_id=key.tenant_id,
        tenant_name=tenant.name if tenant is not None else "admin",
        scopes=tuple(key.scopes),
        limits=QuotaLimits.from_row(quota),
        models=tuple(quota.models) if quota is not None and quota.models is not None else None,
        priority=quota.priority if quota is not None else 0,
        weight=quota.weight if quota is not None else 1.0,
    )


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
