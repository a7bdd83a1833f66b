"""Cache salts: tenants never share cached KV blocks unless an admin publishes a prefix.

A published prefix's blocks carry no salt at all (GenRequest.shared_prefix_len), so
every tenant's requests that start with it share them.
"""

from __future__ import annotations

import functools
import hashlib
import hmac


@functools.lru_cache(maxsize=4096)
def tenant_cache_salt(secret: str, tenant_id: str) -> str:
    """HMAC of the tenant id: stable across restarts, unguessable without the secret."""
    return hmac.new(secret.encode(), tenant_id.encode(), hashlib.sha256).hexdigest()[:32]
