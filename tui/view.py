"""What the panels draw: plain records computed from one stats snapshot and its history.

Everything here is a pure function of its inputs (no clock, no I/O), so a replayed
file always gives the same screen.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# (key, column title); `s` on the dashboard walks this list.
TENANT_SORTS: list[tuple[str, str]] = [
    ("tokens_per_s", "tok/s"),
    ("requests_per_s", "req/s"),
    ("rejected_429", "429s"),
    ("quota_used", "quota"),
    ("spend_today", "spend today"),
    ("name", "tenant"),
]


@dataclass
class Connection:
    # connecting | connected | polling | disconnected | reconnecting | refused (the key;
    # no retries) | replaying | replay finished
    state: str
    error: str = ""
    retry_in_s: float | None = None
    attempt: int = 0


@dataclass
class Series:
    label: str
    unit: str
    current: float
    values: list[float]


@dataclass
class Latency:
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    e2e_p50_ms: float | None = None
    e2e_p99_ms: float | None = None


# the tiers under an engine's KV cache, in the order the panel lists them
KV_TIERS = ("host", "disk", "shared")


@dataclass
class TierRow:
    """One KV tier, summed over the backends that have it on."""

    tier: str
    hits: int  # prompt tokens loaded from it instead of computed
    blocks: int
    bytes: int


@dataclass
class Transfers:
    """Decode workers' pulls of prefill workers' blocks, summed over the backends."""

    pulls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    fallbacks: int = 0  # pulls that failed: the prompt computed on the decode worker


@dataclass
class Engine:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # the fullest backend's share of KV blocks in use, 0..1
    prefix_hit_rate: float | None = None  # None until a prefix lookup happened
    preemptions: int = 0
    tiers: list[TierRow] = field(default_factory=list)  # empty: no backend has one on
    transfers: Transfers | None = None  # None: no backend pulls blocks


@dataclass
class TenantRow:
    id: str
    name: str
    requests_per_s: float
    tokens_per_s: float
    rejected_429: int
    in_flight: int
    quota_used: float | None  # the tightest limit's used share; None: unlimited
    budget_left: int | None  # tokens left in the tightest budget; None: unlimited
    served: float | None = None  # its share of the engines' fair-share service; None: none
    spend_today: float | None = None  # USD; None: a gateway that does not report spend


@dataclass
class BackendRow:
    name: str
    type: str
    healthy: bool
    models: list[str]
    running: int
    waiting: int
    kv_usage: float
    gen_tokens_per_s: float


@dataclass
class ErrorRow:
    ts: float
    status: int
    tenant: str
    model: str
    message: str


@dataclass
class BatchRow:
    """One batch (the Batch API's): its progress, result files and what its lines were
    billed so far at the batch price."""

    id: str
    tenant_id: str
    tenant: str  # its name; its id for a deleted tenant's
    status: str
    total: int
    completed: int
    failed: int
    output_file_id: str | None
    error_file_id: str | None
    spend: float  # USD

    @property
    def done(self) -> float | None:
        """The share of its lines answered (completed or failed); None: it has none."""
        return (self.completed + self.failed) / self.total if self.total else None


@dataclass
class Dashboard:
    connection: Connection
    replay: str | None  # the replayed file's name; None when live
    url: str
    version: str = ""
    uptime_s: float | None = None
    models: list[str] = field(default_factory=list)
    backends_up: int = 0
    in_flight: int = 0
    totals: dict[str, int] = field(default_factory=dict)
    throughput: list[Series] = field(default_factory=list)
    window_s: float = 0.0  # the time the charts span
    latency: Latency = field(default_factory=Latency)
    engine: Engine = field(default_factory=Engine)
    tenants: list[TenantRow] = field(default_factory=list)
    tenant_count: int = 0  # before the filter
    sort_key: str = TENANT_SORTS[0][0]
    tenant_filter: str = ""
    backends: list[BackendRow] = field(default_factory=list)
    errors: list[ErrorRow] = field(default_factory=list)
    batches: list[BatchRow] = field(default_factory=list)  # empty: the panel is hidden
    has_data: bool = False


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _num(value: Any, default: float = 0.0) -> float:
    return float(value) if isinstance(value, int | float) else default


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) else 0


def _opt(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def quota_used(quota: dict[str, Any]) -> float | None:
    """The largest used share over the limits that are set: rpm, tpm, the daily and monthly
    token budgets and the daily and monthly money budgets."""
    shares = [
        _num(quota.get(used)) / limit
        for limit_key, used in (
            ("rpm", "rpm_used"),
            ("tpm", "tpm_used"),
            ("daily_tokens", "daily_used"),
            ("monthly_tokens", "monthly_used"),
            ("daily_spend", "daily_spend_used"),
            ("monthly_spend", "monthly_spend_used"),
        )
        if (limit := _opt(quota.get(limit_key))) is not None and limit > 0
    ]
    return max(shares) if shares else None


def budget_left(quota: dict[str, Any]) -> int | None:
    """Tokens left in the tighter of the daily and monthly budgets."""
    left = [
        max(0, int(limit - _num(quota.get(used))))
        for limit_key, used in (("daily_tokens", "daily_used"), ("monthly_tokens", "monthly_used"))
        if (limit := _opt(quota.get(limit_key))) is not None
    ]
    return min(left) if left else None


def tenant_rows(raw: Iterable[dict[str, Any]]) -> list[TenantRow]:
    raw = list(raw)
    service = {str(t.get("id", "")): _num(_dict(t.get("fair_share")).get("service")) for t in raw}
    total = sum(service.values())
    rows = []
    for t in raw:
        quota = _dict(t.get("quota"))
        rows.append(
            TenantRow(
                id=str(t.get("id", "")),
                name=str(t.get("name") or t.get("id", "")),
                requests_per_s=_num(t.get("requests_per_s")),
                tokens_per_s=_num(t.get("tokens_per_s")),
                rejected_429=_int(t.get("rejected_429")),
                in_flight=_int(t.get("in_flight")),
                quota_used=quota_used(quota),
                budget_left=budget_left(quota),
                served=service[str(t.get("id", ""))] / total if total else None,
                spend_today=_opt(quota.get("daily_spend_used")),
            )
        )
    return rows


def sort_and_filter(rows: list[TenantRow], sort_key: str, text: str) -> list[TenantRow]:
    """Tenants whose name or id contains `text` (any case), busiest first; names A to Z."""
    assert sort_key in dict(TENANT_SORTS), sort_key
    needle = text.strip().lower()
    kept = [r for r in rows if needle in r.name.lower() or needle in r.id.lower()]
    if sort_key == "name":
        return sorted(kept, key=lambda r: r.name.lower())

    def busiest_first(row: TenantRow) -> tuple[bool, float, str]:
        value = getattr(row, sort_key)
        # None (an unlimited quota, no spend reported) sorts below every value; ties by name.
        return (value is None, -(value or 0.0), row.name.lower())

    return sorted(kept, key=busiest_first)


def engine_state(backends: list[dict[str, Any]]) -> Engine:
    queries = sum(_int(b.get("prefix_queries")) for b in backends)
    hits = sum(_int(b.get("prefix_hits")) for b in backends)
    return Engine(
        running=sum(_int(b.get("running")) for b in backends),
        waiting=sum(_int(b.get("waiting")) for b in backends),
        kv_usage=max((_num(b.get("kv_usage")) for b in backends), default=0.0),
        prefix_hit_rate=hits / queries if queries else None,
        preemptions=sum(_int(b.get("preemptions")) for b in backends),
        tiers=tier_rows(backends),
        transfers=transfers(backends),
    )


def transfers(backends: list[dict[str, Any]]) -> Transfers | None:
    """The pulls of the backends that report them (`kv_transfer`), summed."""
    reported = [t for b in backends if (t := _dict(b.get("kv_transfer")))]
    if not reported:
        return None
    return Transfers(
        pulls=sum(_int(t.get("pulls")) for t in reported),
        bytes=sum(_int(t.get("bytes")) for t in reported),
        seconds=sum(_num(t.get("seconds")) for t in reported),
        fallbacks=sum(_int(t.get("fallbacks")) for t in reported),
    )


def tier_rows(backends: list[dict[str, Any]]) -> list[TierRow]:
    """The KV tiers some backend has on (its `kv_tiers`), each summed over the backends."""
    rows = {}
    for b in backends:
        for tier, counts in _dict(b.get("kv_tiers")).items():
            if tier in KV_TIERS and isinstance(counts, dict):
                row = rows.setdefault(tier, TierRow(tier, 0, 0, 0))
                row.hits += _int(counts.get("hits"))
                row.blocks += _int(counts.get("blocks"))
                row.bytes += _int(counts.get("bytes"))
    return [rows[t] for t in KV_TIERS if t in rows]


def backend_rows(backends: list[dict[str, Any]]) -> list[BackendRow]:
    return [
        BackendRow(
            name=str(b.get("name", "?")),
            type=str(b.get("type", "")),
            healthy=bool(b.get("healthy")),
            models=[str(m) for m in b.get("models") or [] if isinstance(m, str)],
            running=_int(b.get("running")),
            waiting=_int(b.get("waiting")),
            kv_usage=_num(b.get("kv_usage")),
            gen_tokens_per_s=_num(b.get("gen_tokens_per_s")),
        )
        for b in backends
    ]


def error_rows(errors: list[dict[str, Any]]) -> list[ErrorRow]:
    # Newest first: the gateway sends them newest last.
    return [
        ErrorRow(
            ts=_num(e.get("ts")),
            status=_int(e.get("status")),
            tenant=str(e.get("tenant") or ""),
            model=str(e.get("model") or ""),
            message=str(e.get("message") or ""),
        )
        for e in reversed(errors)
    ]


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def batch_rows(batches: list[dict[str, Any]]) -> list[BatchRow]:
    """As the gateway sends them: running batches first, each newest first."""
    rows = []
    for b in batches:
        counts = _dict(b.get("request_counts"))
        tenant_id = str(b.get("tenant_id") or "")
        rows.append(
            BatchRow(
                id=str(b.get("id") or "?"),
                tenant_id=tenant_id,
                tenant=str(b.get("tenant") or tenant_id),
                status=str(b.get("status") or ""),
                total=_int(counts.get("total")),
                completed=_int(counts.get("completed")),
                failed=_int(counts.get("failed")),
                output_file_id=_opt_str(b.get("output_file_id")),
                error_file_id=_opt_str(b.get("error_file_id")),
                spend=_num(b.get("spend")),
            )
        )
    return rows


def build_dashboard(
    snapshot: dict[str, Any] | None,
    history: Iterable[tuple[float, float, float, float]],
    connection: Connection,
    replay: str | None,
    url: str,
    sort_key: str,
    tenant_filter: str,
) -> Dashboard:
    """The whole screen's data. `history` holds (ts, req/s, prompt tok/s, output tok/s)."""
    board = Dashboard(
        connection=connection,
        replay=replay,
        url=url,
        sort_key=sort_key,
        tenant_filter=tenant_filter,
    )
    points = list(history)
    rates = _dict(_dict(snapshot).get("rates"))
    board.window_s = points[-1][0] - points[0][0] if points else 0.0
    board.throughput = [
        Series("output", "tok/s", _num(rates.get("output_tokens_per_s")), [p[3] for p in points]),
        Series("prompt", "tok/s", _num(rates.get("prompt_tokens_per_s")), [p[2] for p in points]),
        Series("requests", "req/s", _num(rates.get("requests_per_s")), [p[1] for p in points]),
    ]
    if snapshot is None:
        return board
    # The snapshot came over the network: any field may be missing or of the wrong type.
    gateway = _dict(snapshot.get("gateway"))
    backends = _list(snapshot.get("backends"))
    tenants = tenant_rows(_list(snapshot.get("tenants")))
    latency = _dict(snapshot.get("latency"))
    totals = _dict(snapshot.get("totals"))

    board.has_data = True
    board.url = str(gateway.get("url") or url)
    board.version = str(gateway.get("version") or "")
    board.uptime_s = _opt(gateway.get("uptime_s"))
    board.models = sorted({m for b in backend_rows(backends) for m in b.models})
    board.backends = backend_rows(backends)
    board.backends_up = sum(b.healthy for b in board.backends)
    board.totals = {k: _int(v) for k, v in totals.items()}
    board.in_flight = board.totals.get("in_flight", 0)
    board.latency = Latency(**{k: _opt(latency.get(k)) for k in Latency.__dataclass_fields__})
    board.engine = engine_state(backends)
    board.tenant_count = len(tenants)
    board.tenants = sort_and_filter(tenants, sort_key, tenant_filter)
    board.errors = error_rows(_list(snapshot.get("errors")))
    needle = tenant_filter.strip().lower()  # the tenants' filter picks their batches too
    board.batches = [
        b
        for b in batch_rows(_list(snapshot.get("batches")))
        if needle in b.tenant.lower() or needle in b.tenant_id.lower()
    ]
    return board
