"""GenRequests for the engines' tests, as both engines take them whole: the model
name is the gateway's concern, so these leave it empty."""

from __future__ import annotations

from engine_api.records import GenRequest
from engine_api.sampling import SamplingParams


def req(
    request_id: str,
    prompt: list[int],
    params: SamplingParams | None = None,
    cache_salt: str | None = None,
    priority: int = 0,
    shared_prefix_len: int = 0,
    tenant_id: str = "",
    weight: float = 1.0,
) -> GenRequest:
    """The engine's old positional order: request id, prompt ids, params, salt, ..."""
    return GenRequest(
        request_id,
        "",
        list(prompt),
        params or SamplingParams(),
        tenant_id=tenant_id,
        cache_salt=cache_salt,
        priority=priority,
        shared_prefix_len=shared_prefix_len,
        weight=weight,
    )
