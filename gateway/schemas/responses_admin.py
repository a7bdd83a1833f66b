"""Operator-facing response bodies as pydantic models, for the OpenAPI document only
(gateway.routes.openapi): tenants, keys, usage, backends, stats, health and prefixes.

The OpenAI-shaped ones, and the `Body` every one extends (no extra keys, so the
schemathesis run in tests/gateway/test_fuzz.py fails on a field that drifts), are in
gateway.schemas.responses.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, create_model

from gateway.schemas.responses import Body
from gateway.tenancy.quota.limits import COUNT32, COUNT53, LIMITS, MODELS, USD

# what each limit holds (gateway.tenancy.quota.limits) as a response states it
_STATED: dict[str, Any] = {COUNT32: int, COUNT53: int, USD: float, MODELS: list[str]}


def _limits(note: str | None = None) -> dict[str, Any]:
    """The limit fields of a tenant or a key, built from gateway.tenancy.quota.limits.LIMITS
    (the one list of them), in its order; `note`, said of them all, is the first one's
    description. `Tenant` and `ApiKey` are built with `create_model` so that the limits
    stand in the middle of their fields, where the published document has them."""
    first = LIMITS[0].name
    return {
        f.name: (
            _STATED[f.holds] | None,
            Field(description=note if f.name == first else f.description),
        )
        for f in LIMITS
    }


Tenant = create_model(
    "Tenant",
    __base__=Body,
    __module__=__name__,
    id=(str, ...),
    object=(Literal["tenant"], ...),
    name=(str, ...),
    created_at=(float, ...),
    **_limits(),
    priority=(int | None, ...),
    weight=(float | None, ...),
)


class TenantList(Body):
    object: Literal["list"]
    data: list[Tenant]


class TenantDeleted(Body):
    id: str
    object: Literal["tenant"]
    deleted: Literal[True]


ApiKey = create_model(
    "ApiKey",
    __base__=Body,
    __module__=__name__,
    id=(str, ...),
    object=(Literal["api_key"], ...),
    tenant_id=(str | None, ...),
    name=(str, ...),
    prefix=(str, ...),
    scopes=(list[Literal["inference", "admin"]], ...),
    priority=(
        int | None,
        Field(description="the key's default priority, lower first; null: its tenant's"),
    ),
    **_limits("the key's own limits, beside its tenant's; null: none"),
    created_at=(float, ...),
    expires_at=(float | None, ...),
    revoked_at=(float | None, ...),
)


class ApiKeyCreated(ApiKey):
    key: str = Field(description="The key itself, shown only in this response.")


class ApiKeyList(Body):
    object: Literal["list"]
    data: list[ApiKey]


class UsageTotals(Body):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    image_tokens: int = Field(description="of prompt_tokens, those standing for images")
    spend: float = Field(description="USD at the configured prices; 0 for a model with none")


class UsageDay(UsageTotals):
    tenant_id: str
    day: str = Field(description="YYYY-MM-DD, UTC")
    model: str


class UsageTenant(UsageTotals):
    tenant_id: str


class UsageKey(UsageTotals):
    key_id: str
    tenant_id: str
    name: str | None = Field(description="null: the key was deleted with its tenant")


class UsageReport(Body):
    object: Literal["list"]
    data: list[UsageDay]
    total: UsageTotals
    tenants: list[UsageTenant] = Field(description="the period's totals per tenant")
    keys: list[UsageKey] = Field(description="the period's totals per API key")


class BackendInfo(Body):
    name: str
    type: str
    healthy: bool
    error: str | None
    loaded: bool = Field(
        description="false while a models directory's model is not loaded (or still loading): "
        "not a failure, it loads on its first request, and reads healthy meanwhile"
    )
    models: list[str]
    running: int
    waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    prompt_tokens_per_s: float
    gen_tokens_per_s: float
    kv_tiers: dict[str, dict[str, int]] = Field(
        description="per tier under the engine's KV cache that is on (host, disk, shared): "
        "hits (prompt tokens loaded from it), blocks and bytes it holds, blocks_written, "
        "blocks_loaded, rejected, write_errors or errors, as far as the tier counts them"
    )
    kv_transfer: dict[str, float] = Field(
        description="a decode worker's pulls of prefill workers' blocks, where it pulls: "
        "pulls, bytes, seconds, fallbacks (pulls that failed: the prompt computed "
        "here) and hits (prompt tokens taken instead of computed)"
    )


class BackendList(Body):
    object: Literal["list"]
    data: list[BackendInfo]


class GatewayInfo(Body):
    url: str
    version: str
    started_at: float
    uptime_s: float


class TrafficTotals(Body):
    requests: int
    errors: int
    rejected_429: int
    prompt_tokens: int
    completion_tokens: int
    in_flight: int


class TrafficRates(Body):
    requests_per_s: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float


class Latency(Body):
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p99_ms: float | None


class TenantQuotaUse(Body):
    rpm: int | None
    rpm_used: int
    tpm: int | None
    tpm_used: int
    daily_tokens: int | None
    daily_used: int
    monthly_tokens: int | None
    monthly_used: int
    daily_spend: float | None = Field(description="USD")
    daily_spend_used: float = Field(description="USD, this UTC day")
    monthly_spend: float | None = Field(description="USD")
    monthly_spend_used: float = Field(description="USD, this UTC month")


class TenantFairShare(Body):
    service: float = Field(description="tokens served, cached prompt tokens at a discount")
    waiting: int
    running: int


class TenantTraffic(Body):
    id: str
    name: str
    requests: int
    tokens: int
    requests_per_s: float
    tokens_per_s: float
    rejected_429: int
    in_flight: int
    quota: TenantQuotaUse | None
    fair_share: TenantFairShare | None = Field(
        description="from engines that share fairly between tenants (the gpu engine's VTC)"
    )


class RecentError(Body):
    ts: float
    tenant: str
    model: str
    status: int
    message: str


class BatchCounts(Body):
    total: int
    completed: int
    failed: int


class BatchProgress(Body):
    """A batch as the dashboard's batch panel shows it (gateway/batches/panel.py)."""

    id: str
    tenant_id: str
    tenant: str | None = Field(description="the tenant's name; null: it was deleted")
    status: str
    endpoint: str
    created_at: float
    request_counts: BatchCounts
    output_file_id: str | None
    error_file_id: str | None
    billed_lines: int = Field(description="lines with a usage row so far")
    billed_tokens: int = Field(description="their prompt and completion tokens")
    spend: float = Field(description="USD, at the batch price")


class StatsSnapshot(Body):
    """docs/STATS.md; also each `data:` event of /admin/stats/stream."""

    ts: float
    gateway: GatewayInfo
    totals: TrafficTotals
    rates: TrafficRates
    latency: Latency
    backends: list[BackendInfo]
    tenants: list[TenantTraffic]
    errors: list[RecentError]
    batches: list[BatchProgress] = Field(
        description="running first, then the latest ended; 20 at most"
    )


class Health(Body):
    status: Literal["ok"]
    down: dict[str, str] = Field(
        description="the backends (by name) that cannot serve now, and why; empty when all can"
    )


class Readiness(Body):
    ready: bool
    draining: bool = Field(description="true from SIGTERM on: the requests in flight finish")
    backends: dict[str, bool]


class Reloaded(Body):
    """POST /admin/reload: what the config file's new reading changed."""

    reloaded: Literal[True]
    changed: list[str] = Field(description="the settings that changed")
    added: list[str] = Field(description="backend entries started, then routed to")
    removed: list[str] = Field(description="entries routed to no more; stopped once drained")
    replaced: list[str] = Field(description="entries whose spec changed: both of the above")


class Prefix(Body):
    id: str
    object: Literal["prefix"]
    tenant_id: str | None = Field(description="null: published for every tenant")
    name: str
    model: str
    text: str
    shared: bool
    created_at: float
    created_by: str
    tokens: int | None = Field(description="its length in tokens, null until prefilled")


class PrefixCreated(Prefix):
    replicas_warmed: int


class PrefixList(Body):
    object: Literal["list"]
    data: list[Prefix]


class PrefixDeleted(Body):
    id: str
    object: Literal["prefix"]
    deleted: Literal[True]


class PinReport(Prefix):
    replicas: list[str]
    hits: int
    tokens_saved: int


class CachedPrefix(Body):
    replica: str
    block_hash: str
    tenant_id: str | None
    blocks: int
    tokens: int
    hits: int
    tokens_saved: int
    last_used: float
    pin: str | None


class TenantPrefixUse(Body):
    tenant_id: str
    name: str | None
    requests: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    blocks_held: int
    tokens_held: int


class PrefixReport(Body):
    object: Literal["prefix_report"]
    prefixes: list[CachedPrefix]
    pins: list[PinReport]
    tenants: list[TenantPrefixUse]


class Adapter(Body):
    object: Literal["adapter"]
    name: str
    path: str
    base_model: str
    tenant_id: str | None = Field(description="null: every tenant may use it")
    created_at: float
    created_by: str = Field(description='the admin key that registered it; "config": lora_modules')
    state: Literal["ready", "failed"] = Field(
        description="failed: its files would not load for the last request under it"
    )
    error: str | None = Field(description="why it failed (the engine's words); null: ready")


class AdapterList(Body):
    object: Literal["list"]
    data: list[Adapter]


class AdapterDeleted(Body):
    name: str
    object: Literal["adapter"]
    deleted: Literal[True]


class AuditEntry(Body):
    id: int
    object: Literal["audit_entry"]
    ts: float
    actor: str = Field(
        description="the admin key's id (key_...); cli:USER for the command line; "
        "signal:SIGHUP for a reload by signal; bootstrap"
    )
    action: str = Field(description="tenant.create, key.revoke, prefix.pin, adapter.delete, ...")
    target: str = Field(description="the id (or an adapter's name) of what changed")
    tenant_id: str | None = Field(description="the tenant the change concerns, if one")
    before: dict[str, Any] | None = Field(description="the object before; null: it was created")
    after: dict[str, Any] | None = Field(description="the object after; null: it was deleted")


class AuditList(Body):
    object: Literal["list"]
    data: list[AuditEntry]
    next_cursor: int | None = Field(description="the cursor of the next page; null: no more")
