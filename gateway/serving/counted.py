"""The quota of a request that runs no model and is billed nothing: /tokenize,
/detokenize and Anthropic's count_tokens.

Each is one request of its tenant's and its key's rpm, and holds a concurrency slot while
it runs, as any request does: rendering a multi-megabyte prompt costs seconds of CPU, so a
tenant refused with 429 is refused here too, with the same 429 and x-ratelimit-* headers
(gateway.serving.admission.admit), before its body is read. No tokens are reserved and no
usage row is written: the request stays counted in its minute, and nothing is billed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from gateway.serving.admission import admit
from gateway.state import GatewayState
from gateway.tenancy.auth import Principal
from gateway.tenancy.quota.limits import ratelimit_headers


@contextlib.asynccontextmanager
async def counted(gw: GatewayState, principal: Principal) -> AsyncIterator[dict[str, str]]:
    """Admit one request for the principal (a 429 if its limits refuse it) and yield the
    x-ratelimit-* headers for the answer; its slot is freed when the block ends, however
    it ends. An admin key belongs to no tenant: nothing to count."""
    if principal.tenant_id is None:
        yield {}
        return
    reservation = await admit(gw, principal, 0, 1, 0)
    try:
        yield ratelimit_headers(reservation.limits, reservation.remaining, reservation.windows)
    finally:
        # shielded: a client that hangs up must not leave the slot held
        await asyncio.shield(gw.quota.settle(reservation, 0))
