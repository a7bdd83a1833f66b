"""Prometheus metrics, named after vLLM's where the meaning is the same.

Every finished request counts itself in about ten series. prometheus_client's own
`inc` and `observe` take a lock and check their labels on every call (1.1 and 2.8 us,
docs/PERF.md, issue 53); the series a request counts in are `LoopCounter` and
`LoopHistogram`: prometheus_client's metrics (the same names, labels, samples and
exposition) whose children count in plain floats, for they are only counted on the
event loop's thread.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client import metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from gateway.backends import BackendStats

_LATENCY_UNDER_1S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75)
_LATENCY_BUCKETS = (*_LATENCY_UNDER_1S, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# speculative decoding counters a backend may report in BackendStats.extra (vLLM's names)
SPEC_DECODE_COUNTERS = {
    "spec_decode_num_drafts": "Decode steps that verified proposed tokens",
    "spec_decode_num_draft_tokens": "Proposed tokens verified by the target model",
    "spec_decode_num_accepted_tokens": "Proposed tokens the target model accepted",
}
# prefill and decode on different workers: a decode worker's pulls (its BackendStats.extra)
# and a gpu engine's blocks moved with them
KV_TRANSFER_COUNTERS = {
    "kv_transfers": "Prompts whose KV blocks a decode worker pulled from a prefill worker",
    "kv_transfer_bytes": "Bytes of KV blocks pulled from prefill workers",
    "kv_transfer_seconds": "Seconds spent pulling KV blocks from prefill workers",
    "kv_transfer_fallbacks": "Pulls that failed, so that the decode worker computed the prompt",
    "kv_transfer_blocks_out": "KV blocks a prefill engine exported",
    "kv_transfer_blocks_in": "KV blocks a decode engine took",
    "kv_transfer_hits": "Prompt tokens a decode engine took instead of computing them",
}
# the KV tiers under an engine's cache: a backend reports a tier's counters in
# BackendStats.extra as kv_<tier>_<key>, only for the tiers it has on
KV_TIERS = ("host", "disk", "shared")
# a BackendStats extra key: False while a models directory's model is not loaded
LOADED = "loaded"
_TIER_ERRORS = ("kv_tier_errors", "Failed writes or calls to a KV tier's store", False)
# key -> (metric, help, whether a gauge: what the tier holds now; else a counter)
KV_TIER_METRICS = {
    "hits": ("kv_tier_hit_tokens", "Prompt tokens loaded from a KV tier, not computed", False),
    "blocks": ("kv_tier_blocks", "KV blocks a tier holds", True),
    "bytes": ("kv_tier_bytes", "Bytes of KV blocks a tier holds", True),
    "blocks_written": ("kv_tier_blocks_written", "KV blocks written down to a tier", False),
    "blocks_loaded": ("kv_tier_blocks_loaded", "KV blocks loaded back from a tier", False),
    "rejected": (
        "kv_tier_rejected_blocks",
        "KV blocks a tier did not take (full) or would not serve (a mismatch, corrupt)",
        False,
    ),
    # the disk's failed writes and the shared store's failed calls, as one count
    "write_errors": _TIER_ERRORS,
    "errors": _TIER_ERRORS,
}
_TPOT_UNDER_1S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75)
_TPOT_BUCKETS = (*_TPOT_UNDER_1S, 1.0, 2.5)


class LoopCounter(Counter):
    """A Counter whose children count in a plain float: counted on the event loop only
    (no lock), read at scrape time. Its samples are Counter's (`_total`, `_created`)."""

    def _metric_init(self) -> None:
        self._total = 0.0
        self._created = time.time()

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        if amount < 0 or exemplar is not None:
            raise ValueError("a LoopCounter counts non-negative amounts, without exemplars")
        try:
            self._total += amount
        except AttributeError:
            self._raise_if_not_observable()  # the parent of labelled children: Counter's error
            raise

    def _child_samples(self) -> Iterable[Sample]:
        total = Sample("_total", {}, self._total, None, None)
        if not _created_series():
            return (total,)
        return (total, Sample("_created", {}, self._created, None, None))


class LoopHistogram(Histogram):
    """A Histogram whose children count in a list of ints and a float sum: observed on
    the event loop only (no lock), read at scrape time. Its samples are Histogram's
    (cumulative `_bucket`s, `_count`, `_sum`, `_created`)."""

    def _metric_init(self) -> None:
        self._counts = [0] * len(self._upper_bounds)
        self._total = 0.0
        self._created = time.time()

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if exemplar is not None:
            raise ValueError("a LoopHistogram keeps no exemplars")
        try:
            self._total += amount
        except AttributeError:
            self._raise_if_not_observable()  # the parent of labelled children
            raise
        # the first bucket whose upper bound is at least the amount, as Histogram's
        self._counts[bisect.bisect_left(self._upper_bounds, amount)] += 1

    def _child_samples(self) -> Iterable[Sample]:
        samples, acc = [], 0.0
        for bound, count in zip(self._upper_bounds, self._counts, strict=True):
            acc += count
            samples.append(Sample("_bucket", {"le": floatToGoString(bound)}, acc, None, None))
        samples.append(Sample("_count", {}, acc, None, None))
        if self._upper_bounds[0] >= 0:
            samples.append(Sample("_sum", {}, self._total, None, None))
        if _created_series():
            samples.append(Sample("_created", {}, self._created, None, None))
        return tuple(samples)


def _created_series() -> bool:
    """Whether prometheus_client writes `_created` samples (its
    PROMETHEUS_DISABLE_CREATED_SERIES, or disable_created_metrics(), turn them off)."""
    return getattr(prometheus_metrics, "_use_created", True)


class Metrics:
    def __init__(self, backend_stats: Callable[[], Iterable[BackendStats]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = LoopCounter(
            "kvgate:requests", "Finished requests", ["tenant", "model", "status"], registry=r
        )
        self.ttft = LoopHistogram(
            "kvgate:time_to_first_token_seconds",
            "Time to first token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = LoopHistogram(
            "kvgate:time_per_output_token_seconds",
            "Time per output token after the first",
            ["model"],
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = LoopHistogram(
            "kvgate:e2e_request_latency_seconds",
            "End-to-end request latency",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = LoopCounter(
            "kvgate:prompt_tokens", "Prompt tokens processed", ["tenant", "model"], registry=r
        )
        self.generation_tokens = LoopCounter(
            "kvgate:generation_tokens", "Tokens generated", ["tenant", "model"], registry=r
        )
        self.image_tokens = LoopCounter(
            "kvgate:image_tokens",
            "Of the prompt tokens, images' placeholder tokens (as the engine counted them)",
            ["tenant", "model"],
            registry=r,
        )
        # vLLM's prefix_cache_queries/hits, per tenant; a hit token is a prefill token saved
        self.prefix_queries = LoopCounter(
            "kvgate:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            ["tenant", "model"],
            registry=r,
        )
        self.cached_tokens = LoopCounter(
            "kvgate:prefix_cache_hits",
            "Prompt tokens served from the prefix cache (not computed)",
            ["tenant", "model"],
            registry=r,
        )
        self.spend = LoopCounter(
            "kvgate:spend_usd",
            "What requests cost at their model's price (US dollars), once their usage row is "
            "committed",
            ["tenant", "model"],
            registry=r,
        )
        self.quota_rejections = LoopCounter(
            "kvgate:quota_rejections", "Requests refused with 429", ["tenant", "limit"], registry=r
        )
        self.prefill_jobs = Counter(
            "kvgate:prefill_jobs",
            "Long prompts sent to a prefill worker: outcome ok, or fallback (it failed or "
            "timed out, and the decode worker computed the prompt)",
            ["model", "outcome"],
            registry=r,
        )
        r.register(_BackendCollector(backend_stats))
        self._children: dict[tuple[object, tuple[str, ...]], object] = {}

    def billed(self, tenant: str, model: str, nano_usd: int) -> None:
        """A committed usage row's spend (the row holds nanodollars; the metric dollars)."""
        self.child(self.spend, tenant, model).inc(nano_usd / 1e9)

    def child(self, metric, *labels: str):
        """`metric.labels(*labels)`, cached: the lookup is a measurable part of a request.
        Keyed by the metric and the labels' tuple as they come, not a tuple made of both
        (550 -> 354 ns a lookup, ten a request)."""
        key = (metric, labels)
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
            "loaded": GaugeMetricFamily(
                "kvgate:backend_loaded",
                "0 while a models directory's model is not loaded (it loads on its first request)",
                labels=["backend"],
            ),
        }
        spec = {
            key: CounterMetricFamily(f"kvgate:{key}", doc, labels=["backend"])
            for key, doc in (SPEC_DECODE_COUNTERS | KV_TRANSFER_COUNTERS).items()
        }
        tenants = _tenant_families()
        tiers = _tier_families()
        for s in self.backend_stats():
            _add_tier_samples(tiers, s)
            for tenant, row in s.extra.get("tenants", {}).items():
                for key, family in tenants.items():
                    family.add_metric([s.name, tenant], row[key])
            gauges["running"].add_metric([s.name], s.running)
            gauges["waiting"].add_metric([s.name], s.waiting)
            gauges["kv_usage"].add_metric([s.name], s.kv_usage)
            gauges["healthy"].add_metric([s.name], 1.0 if s.healthy else 0.0)
            gauges["loaded"].add_metric([s.name], 1.0 if s.extra.get(LOADED, True) else 0.0)
            for key, counter in spec.items():
                if key in s.extra:
                    counter.add_metric([s.name], s.extra[key])
        yield from gauges.values()
        yield from (family for family in tenants.values() if family.samples)
        yield from (counter for counter in spec.values() if counter.samples)
        yield from (family for family in tiers.values() if family.samples)


def _tier_families() -> dict[str, CounterMetricFamily | GaugeMetricFamily]:
    """Per backend and tier, one family per metric of KV_TIER_METRICS."""
    families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
    for name, doc, gauge in KV_TIER_METRICS.values():
        kind = GaugeMetricFamily if gauge else CounterMetricFamily
        families.setdefault(name, kind(f"kvgate:{name}", doc, labels=["backend", "tier"]))
    return families


def _add_tier_samples(families: dict, s: BackendStats) -> None:
    for tier, counts in kv_tier_stats(s.extra).items():
        for key, value in counts.items():
            families[KV_TIER_METRICS[key][0]].add_metric([s.name, tier], value)


# a decode worker's pulls of a prefill worker's blocks (gateway/worker/kv_pull.py) and
# the tokens its engine took from them
KV_TRANSFER_KEYS = {
    "kv_transfers": "pulls",
    "kv_transfer_bytes": "bytes",
    "kv_transfer_seconds": "seconds",
    "kv_transfer_fallbacks": "fallbacks",
    "kv_transfer_hits": "hits",
}


def kv_transfer_stats(extra: dict[str, Any]) -> dict[str, float]:
    """{pulls, bytes, seconds, fallbacks, hits} of a backend that pulls blocks from
    prefill workers (empty for one that does not)."""
    out = {}
    for key, name in KV_TRANSFER_KEYS.items():
        value = extra.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = value
    return out


def kv_tier_stats(extra: dict[str, Any]) -> dict[str, dict[str, int]]:
    """tier -> {key: count} of the tiers a backend reports in its BackendStats.extra
    (none when it has none on); the keys are KV_TIER_METRICS'."""
    tiers: dict[str, dict[str, int]] = {}
    for tier in KV_TIERS:
        for key in KV_TIER_METRICS:
            value = extra.get(f"kv_{tier}_{key}")
            if isinstance(value, int) and not isinstance(value, bool):
                tiers.setdefault(tier, {})[key] = value
    return tiers


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
