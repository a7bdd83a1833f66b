"""The per-request series count in plain floats (LoopCounter, LoopHistogram): what a scrape
reads of them must be what prometheus_client's own Counter and Histogram give for the
same calls, name for name and value for value."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import metrics as prometheus_metrics

from gateway.observe.metrics import LoopCounter, LoopHistogram, Metrics

BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0)
# what a request's series see: amounts on a bound, between bounds, past the last, zero
AMOUNTS = [0.0, 0.001, 0.0011, 0.05, 0.1, 2.0, 10.0, 11.5, 250.0, 0.3]


def exposition(counter: type[Counter], histogram: type[Histogram]) -> str:
    r = CollectorRegistry()
    c = counter("t:requests", "Finished", ["tenant", "status"], registry=r)
    h = histogram("t:latency_seconds", "Latency", ["model"], buckets=BUCKETS, registry=r)
    for i, amount in enumerate(AMOUNTS):
        c.labels("acme", str(200 + i % 2)).inc()
        c.labels("acme", "200").inc(amount * 7)
        h.labels("m1" if i % 3 else "m2").observe(amount)
    # the creation times differ between the two runs: compare everything else
    return re.sub(r"(_created\{[^}]*\}) \S+", r"\1 T", generate_latest(r).decode())


def test_loop_metrics_expose_what_prometheus_client_s_do() -> None:
    ours = exposition(LoopCounter, LoopHistogram)
    assert ours == exposition(Counter, Histogram)
    assert 't:latency_seconds_bucket{le="0.01",model="m1"} 2.0' in ours
    assert "_created" in ours


def test_without_created_series_as_prometheus_client(monkeypatch) -> None:
    monkeypatch.setattr(prometheus_metrics, "_use_created", False)
    ours = exposition(LoopCounter, LoopHistogram)
    assert ours == exposition(Counter, Histogram) and "_created" not in ours


def test_they_refuse_what_prometheus_client_refuses() -> None:
    r = CollectorRegistry()
    c = LoopCounter("t:c", "c", ["tenant"], registry=r)
    h = LoopHistogram("t:h", "h", ["model"], registry=r)
    with pytest.raises(ValueError, match="non-negative"):
        c.labels("a").inc(-1)
    with pytest.raises(ValueError, match="missing label values"):
        c.inc()
    with pytest.raises(ValueError, match="missing label values"):
        h.observe(1.0)


def test_a_request_s_series_are_loop_metrics() -> None:
    m = Metrics(lambda: [])
    for metric in (m.requests, m.prompt_tokens, m.generation_tokens, m.spend, m.cached_tokens):
        assert isinstance(metric, LoopCounter)
    for metric in (m.ttft, m.tpot, m.e2e):
        assert isinstance(metric, LoopHistogram)
    m.child(m.requests, "acme", "fake-model", "200").inc()
    m.billed("acme", "fake-model", 2_500_000_000)
    text = generate_latest(m.registry).decode()
    assert 'kvgate:requests_total{model="fake-model",status="200",tenant="acme"} 1.0' in text
    assert 'kvgate:spend_usd_total{model="fake-model",tenant="acme"} 2.5' in text
