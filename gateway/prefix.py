"""Cache salts: tenants never share cached KV blocks unless an admin publishes a prefix."""

from __future__ import annotations

import functools
import hashlib
import hmac

PUBLIC_SALT = "public"


@functools.lru_cache(maxsize=4096)
def tenant_cache_salt(secret: str, tenant_id: str) -> str:
    """HMAC of the tenant id: stable across restarts, unguessable without the secret."""
    return hmac.new(secret.encode(), tenant_id.encode(), hashlib.sha256).hexdigest()[:32]
