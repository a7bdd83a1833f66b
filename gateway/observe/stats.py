"""Live traffic figures for /admin/stats and the dashboard (schema: docs/STATS.md).

Tokens count toward the rates as they stream, so that a long generation shows on the
dashboard while it runs; the totals, like the usage rows, count a request when it ends.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

RATE_WINDOW_S = 10.0
LATENCY_WINDOW_S = 60.0
RATE_BUCKET_S = 0.5
RATES = ("requests_per_s", "prompt_tokens_per_s", "output_tokens_per_s")  # TrafficStats.recent


class RateWindow:
    """Counts added over time, per second over the last RATE_WINDOW_S.

    A stream adds to it with every chunk, so adding must cost the same whatever the
    traffic: counts go into buckets of RATE_BUCKET_S, and a snapshot sums a few of them.
    """

    def __init__(self, width: int) -> None:
        self.width = width
        self.buckets: deque[list[float]] = deque()  # [bucket number, count, count, ...]

    def add(self, now: float, *counts: float) -> None:
        number = now // RATE_BUCKET_S
        if not self.buckets or number > self.buckets[-1][0]:
            self.buckets.append([number] + [0] * self.width)
            self._trim(now)
        last = self.buckets[-1]  # a clock that stepped back adds to the newest bucket
        for i, count in enumerate(counts, 1):
            last[i] += count

    def rates(self, now: float, since: float) -> list[float]:
        """Each count per second over the buckets of the window, or since `since` (the
        gateway's start) when that is shorter."""
        first = self._trim(now)
        span = max(min(now - first * RATE_BUCKET_S, now - since), 1e-9)
        return [sum(b[i] for b in self.buckets) / span for i in range(1, self.width + 1)]

    def _trim(self, now: float) -> float:
        first = (now - RATE_WINDOW_S) // RATE_BUCKET_S
        while self.buckets and self.buckets[0][0] < first:
            self.buckets.popleft()
        return first


@dataclass
class TenantTraffic:
    name: str
    requests: int = 0
    tokens: int = 0
    rejected_429: int = 0
    in_flight: int = 0
    recent: RateWindow = field(default_factory=lambda: RateWindow(2))  # requests, tokens


@dataclass
class Finished:
    t: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None  # None: no token came, so the prompt's tokens were not streamed
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
        self.recent = RateWindow(3)  # requests, prompt tokens, output tokens
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

    def tokens_streamed(
        self, tenant_id: str, name: str, prompt: int, output: int, now: float | None = None
    ) -> None:
        """Tokens as a stream passes them: output tokens with each chunk, the prompt's at
        the first token (its prefill is done). Only the rates count them."""
        now = time.time() if now is None else now
        self.recent.add(now, 0, prompt, output)
        self.tenant(tenant_id, name).recent.add(now, 0, prompt + output)

    def request_finished(self, tenant_id: str, name: str, rec: Finished, ok: bool) -> None:
        """Count a request in the totals. Its output tokens went to the rates as they
        streamed; its prompt's go now if no token came (`ttft_s` is None)."""
        self.in_flight -= 1
        self.requests += 1
        self.prompt_tokens += rec.prompt_tokens
        self.completion_tokens += rec.output_tokens
        if not ok:
            self.errors += 1
        t = self.tenant(tenant_id, name)
        t.in_flight -= 1
        t.requests += 1
        t.tokens += rec.prompt_tokens + rec.output_tokens
        prompt = rec.prompt_tokens if rec.ttft_s is None else 0
        self.recent.add(rec.t, 1, prompt, 0)
        t.recent.add(rec.t, 1, prompt)
        self.finished.append(rec)
        self._trim(rec.t)

    def rejected(self, tenant_id: str, name: str) -> None:
        self.rejected_429 += 1
        self.tenant(tenant_id, name).rejected_429 += 1

    def error(self, tenant: str, model: str, status: int, message: str) -> None:
        error = dict(ts=time.time(), tenant=tenant, model=model, status=status, message=message)
        self.recent_errors.append(error)

    def _trim(self, now: float) -> None:
        while self.finished and self.finished[0].t < now - LATENCY_WINDOW_S:
            self.finished.popleft()

    def snapshot(self, now: float | None = None) -> dict:
        now = now or time.time()
        self._trim(now)
        tenants = []
        for tenant_id, t in self.tenants.items():
            requests_per_s, tokens_per_s = t.recent.rates(now, self.started_at)
            tenants.append(
                {
                    "id": tenant_id,
                    "name": t.name,
                    "requests": t.requests,
                    "tokens": t.tokens,
                    "requests_per_s": requests_per_s,
                    "tokens_per_s": tokens_per_s,
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
            "rates": dict(zip(RATES, self.recent.rates(now, self.started_at), strict=True)),
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
