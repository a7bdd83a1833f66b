"""Live traffic figures for /admin/stats and the dashboard (schema: docs/STATS.md)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

RATE_WINDOW_S = 10.0
LATENCY_WINDOW_S = 60.0


@dataclass
class TenantTraffic:
    name: str
    requests: int = 0
    tokens: int = 0
    rejected_429: int = 0
    in_flight: int = 0
    recent: deque[tuple[float, int]] = field(default_factory=deque)  # (t, tokens) per request


@dataclass
class Finished:
    t: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float


class TrafficStats:
    def __init__(self) -> None:
        self.started_at = time.time()
        self.requests = 0
        self.errors = 0
        self.rejected_429 = 0
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.in_flight = 0
        self.finished: deque[Finished] = deque()
        self.tenants: dict[str, TenantTraffic] = {}
        self.recent_errors: deque[dict] = deque(maxlen=20)

    def tenant(self, tenant_id: str, name: str) -> TenantTraffic:
        t = self.tenants.get(tenant_id)
        if t is None:
            t = self.tenants[tenant_id] = TenantTraffic(name)
        return t

    def request_started(self, tenant_id: str, name: str) -> None:
        self.in_flight += 1
        self.tenant(tenant_id, name).in_flight += 1

    def request_finished(self, tenant_id: str, name: str, rec: Finished, ok: bool) -> None:
        self.in_flight -= 1
        self.requests += 1
        self.prompt_tokens += rec.prompt_tokens
        self.completion_tokens += rec.output_tokens
        if not ok:
            self.errors += 1
        t = self.tenant(tenant_id, name)
        t.in_flight -= 1
        t.requests += 1
        tokens = rec.prompt_tokens + rec.output_tokens
        t.tokens += tokens
        t.recent.append((rec.t, tokens))
        self.finished.append(rec)
        self._trim(rec.t)

    def rejected(self, tenant_id: str, name: str) -> None:
        self.rejected_429 += 1
        self.tenant(tenant_id, name).rejected_429 += 1

    def error(self, tenant: str, model: str, status: int, message: str) -> None:
        self.recent_errors.append(
            {"ts": time.time(), "tenant": tenant, "model": model, "status": status,
             "message": message}
        )  # fmt: skip

    def _trim(self, now: float) -> None:
        while self.finished and self.finished[0].t < now - LATENCY_WINDOW_S:
            self.finished.popleft()

    def snapshot(self, now: float | None = None) -> dict:
        now = now or time.time()
        self._trim(now)
        recent = [f for f in self.finished if f.t >= now - RATE_WINDOW_S]
        span = min(RATE_WINDOW_S, max(now - self.started_at, 1e-9))
        tenants = []
        for tenant_id, t in self.tenants.items():
            while t.recent and t.recent[0][0] < now - RATE_WINDOW_S:
                t.recent.popleft()
            tenants.append(
                {
                    "id": tenant_id,
                    "name": t.name,
                    "requests": t.requests,
                    "tokens": t.tokens,
                    "requests_per_s": len(t.recent) / span,
                    "tokens_per_s": sum(n for _, n in t.recent) / span,
                    "rejected_429": t.rejected_429,
                    "in_flight": t.in_flight,
                }
            )
        return {
            "ts": now,
            "totals": {
                "requests": self.requests,
                "errors": self.errors,
                "rejected_429": self.rejected_429,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "in_flight": self.in_flight,
            },
            "rates": {
                "requests_per_s": len(recent) / span,
                "prompt_tokens_per_s": sum(f.prompt_tokens for f in recent) / span,
                "output_tokens_per_s": sum(f.output_tokens for f in recent) / span,
            },
            "latency": {
                "ttft_p50_ms": _pct_ms([f.ttft_s for f in self.finished], 50),
                "ttft_p99_ms": _pct_ms([f.ttft_s for f in self.finished], 99),
                "tpot_p50_ms": _pct_ms([f.tpot_s for f in self.finished], 50),
                "tpot_p99_ms": _pct_ms([f.tpot_s for f in self.finished], 99),
                "e2e_p50_ms": _pct_ms([f.e2e_s for f in self.finished], 50),
                "e2e_p99_ms": _pct_ms([f.e2e_s for f in self.finished], 99),
            },
            "tenants": tenants,
            "errors": list(self.recent_errors),
        }


def _pct_ms(values: list[float | None], pct: float) -> float | None:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    rank = (len(xs) - 1) * pct / 100
    lo = int(rank)
    hi = min(lo + 1, len(xs) - 1)
    return 1000 * (xs[lo] + (xs[hi] - xs[lo]) * (rank - lo))
