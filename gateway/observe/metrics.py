"""Prometheus metrics, named after vLLM's where the meaning is the same."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.backends import BackendStats

_LATENCY_UNDER_1S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75)
_LATENCY_BUCKETS = (*_LATENCY_UNDER_1S, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# speculative decoding counters a backend may report in BackendStats.extra (vLLM's names)
SPEC_DECODE_COUNTERS = {
    "spec_decode_num_drafts": "Decode steps that verified proposed tokens",
    "spec_decode_num_draft_tokens": "Proposed tokens verified by the target model",
    "spec_decode_num_accepted_tokens": "Proposed tokens the target model accepted",
}
_TPOT_UNDER_1S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75)
_TPOT_BUCKETS = (*_TPOT_UNDER_1S, 1.0, 2.5)


class Metrics:
    def __init__(self, backend_stats: Callable[[], Iterable[BackendStats]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvgate:requests", "Finished requests", ["tenant", "model", "status"], registry=r
        )
        self.ttft = Histogram(
            "kvgate:time_to_first_token_seconds",
            "Time to first token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "kvgate:time_per_output_token_seconds",
            "Time per output token after the first",
            ["model"],
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvgate:e2e_request_latency_seconds",
            "End-to-end request latency",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvgate:prompt_tokens", "Prompt tokens processed", ["tenant", "model"], registry=r
        )
        self.generation_tokens = Counter(
            "kvgate:generation_tokens", "Tokens generated", ["tenant", "model"], registry=r
        )
        # vLLM's prefix_cache_queries/hits, per tenant; a hit token is a prefill token saved
        self.prefix_queries = Counter(
            "kvgate:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            ["tenant", "model"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "kvgate:prefix_cache_hits",
            "Prompt tokens served from the prefix cache (not computed)",
            ["tenant", "model"],
            registry=r,
        )
        self.quota_rejections = Counter(
            "kvgate:quota_rejections", "Requests refused with 429", ["tenant", "limit"], registry=r
        )
        r.register(_BackendCollector(backend_stats))
        self._children: dict[tuple, object] = {}

    def child(self, metric, *labels: str):
        """`metric.labels(*labels)`, cached: the lookup is a measurable part of a request."""
        key = (id(metric), *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found


class _BackendCollector(Collector):
    """Backend queue gauges, read from the backends at scrape time."""

    def __init__(self, backend_stats: Callable[[], Iterable[BackendStats]]) -> None:
        self.backend_stats = backend_stats

    def collect(self):
        gauges = {
            "running": GaugeMetricFamily(
                "kvgate:num_requests_running", "Requests running in the backend", labels=["backend"]
            ),
            "waiting": GaugeMetricFamily(
                "kvgate:num_requests_waiting", "Requests queued in the backend", labels=["backend"]
            ),
            "kv_usage": GaugeMetricFamily(
                "kvgate:kv_cache_usage_perc", "KV cache usage, 0 to 1", labels=["backend"]
            ),
            "healthy": GaugeMetricFamily(
                "kvgate:backend_healthy", "1 when the backend serves", labels=["backend"]
            ),
        }
        spec = {
            key: CounterMetricFamily(f"kvgate:{key}", doc, labels=["backend"])
            for key, doc in SPEC_DECODE_COUNTERS.items()
        }
        tenants = _tenant_families()
        for s in self.backend_stats():
            for tenant, row in s.extra.get("tenants", {}).items():
                for key, family in tenants.items():
                    family.add_metric([s.name, tenant], row[key])
            gauges["running"].add_metric([s.name], s.running)
            gauges["waiting"].add_metric([s.name], s.waiting)
            gauges["kv_usage"].add_metric([s.name], s.kv_usage)
            gauges["healthy"].add_metric([s.name], 1.0 if s.healthy else 0.0)
            for key, counter in spec.items():
                if key in s.extra:
                    counter.add_metric([s.name], s.extra[key])
        yield from gauges.values()
        yield from (family for family in tenants.values() if family.samples)
        yield from (counter for counter in spec.values() if counter.samples)


def _tenant_families() -> dict[str, CounterMetricFamily | GaugeMetricFamily]:
    """Per tenant and engine, from BackendStats.extra["tenants"] (the gpu engine's VTC)."""
    return {
        "service": CounterMetricFamily(
            "kvgate:tenant_service_tokens",
            "Fair-share service an engine gave a tenant (prompt + output tokens, cached "
            "prompt tokens at a discount)",
            labels=["backend", "tenant"],
        ),
        "waiting": GaugeMetricFamily(
            "kvgate:tenant_requests_waiting",
            "A tenant's requests queued in the engine",
            labels=["backend", "tenant"],
        ),
        "running": GaugeMetricFamily(
            "kvgate:tenant_requests_running",
            "A tenant's requests running in the engine",
            labels=["backend", "tenant"],
        ),
    }
