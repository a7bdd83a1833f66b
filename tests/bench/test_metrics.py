"""The serving metrics on hand-made request timelines whose answers are worked out below."""

import pytest

from bench.client import RequestOutput
from bench.metrics import (
    compute_metrics,
    format_report,
    metrics_to_dict,
    peak_concurrency,
    peak_output_tokens_per_s,
    request_tpot,
)


def req(start, ttft, itl, prompt, output, success=True):
    latency = ttft + sum(itl)
    return RequestOutput(
        success=success,
        start_time=start,
        ttft=ttft,
        itl=list(itl),
        latency=latency,
        prompt_tokens=prompt,
        output_tokens=output,
    )


@pytest.fixture
def timeline():
    return [
        # A: 4 tokens; TTFT 100 ms, gaps 20/30/50 ms -> E2EL 200, TPOT (200-100)/3
        req(0.0, 0.100, [0.020, 0.030, 0.050], 10, 4),
        # B: 2 tokens; TTFT 300, gap 100 -> E2EL 400, TPOT 100
        req(0.05, 0.300, [0.100], 20, 2),
        # C: failed, contributes nothing but the count
        RequestOutput(success=False, error="HTTP 429"),
        # D: 1 token; TTFT = E2EL = 50; no TPOT (counts 0 for goodput)
        req(0.5, 0.050, [], 30, 1),
    ]


def test_counts_and_throughputs(timeline):
    m = compute_metrics(timeline, duration=2.0)
    assert (m.completed, m.failed, m.missing_usage) == (3, 1, 0)
    assert m.total_input_tokens == 60
    assert m.total_output_tokens == 7
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(3.5)
    assert m.total_token_throughput == pytest.approx(33.5)
    assert m.request_goodput is None


def test_ttft_tpot_itl_e2el(timeline):
    m = compute_metrics(timeline, duration=2.0, percentiles=[50, 99])
    ttft, tpot, itl, e2el = (m.summaries[k] for k in ("ttft", "tpot", "itl", "e2el"))
    assert ttft.mean == pytest.approx(150.0)
    assert ttft.median == pytest.approx(100.0)
    # sorted [50, 100, 300]: p99 sits at rank 1.98 -> 100 + 0.98 * 200
    assert ttft.percentiles[99] == pytest.approx(296.0)
    assert ttft.percentiles[50] == pytest.approx(100.0)
    # TPOT excludes the first token and one-token requests: [100/3, 100]
    assert tpot.mean == pytest.approx((100 / 3 + 100) / 2)
    # ITL pools every gap: [20, 30, 50, 100]; p99 at rank 2.97 -> 50 + 0.97 * 50
    assert itl.mean == pytest.approx(50.0)
    assert itl.median == pytest.approx(40.0)
    assert itl.percentiles[99] == pytest.approx(98.5)
    assert e2el.mean == pytest.approx((200 + 400 + 50) / 3)
    assert e2el.median == pytest.approx(200.0)


def test_request_tpot():
    assert request_tpot(req(0, 0.1, [0.02, 0.03, 0.05], 1, 4)) == pytest.approx(0.1 / 3)
    assert request_tpot(req(0, 0.1, [], 1, 1)) == 0.0
    assert request_tpot(req(0, 0.1, [], 1, None)) is None


@pytest.mark.parametrize(
    ("slos", "good"),
    [
        ({"ttft": 150}, 2),  # A (100) and D (50) meet it, B (300) does not
        ({"tpot": 50}, 2),  # A (33.3) and D (0)
        ({"ttft": 150, "e2el": 100}, 1),  # only D
        ({"e2el": 1000}, 3),
        ({"ttft": 10}, 0),
    ],
)
def test_goodput(timeline, slos, good):
    m = compute_metrics(timeline, duration=2.0, goodput=slos)
    assert m.request_goodput == pytest.approx(good / 2.0)


def test_missing_usage_is_not_guessed():
    outs = [req(0, 0.1, [0.1, 0.1], 5, 3), req(0, 0.1, [0.1, 0.1], None, None)]
    m = compute_metrics(outs, duration=1.0)
    assert (m.completed, m.missing_usage) == (2, 1)
    assert m.total_output_tokens == 3
    assert m.total_input_tokens == 5
    assert m.summaries["tpot"].mean == pytest.approx(100.0)  # only the request with usage
    assert m.summaries["ttft"].mean == pytest.approx(100.0)  # timing needs no usage


def test_peak_concurrency_half_open():
    assert peak_concurrency([req(0, 0.5, [0.5], 1, 2), req(1.0, 0.5, [0.5], 1, 2)]) == 1
    overlapping = [req(0, 0.5, [0.5], 1, 2), req(0.9, 0.5, [], 1, 1), req(0.95, 0.1, [], 1, 1)]
    assert peak_concurrency(overlapping) == 3


def test_peak_output_tokens_per_second():
    # chunk times: A at 0.5, 1.2, 1.4; B at 1.1, 1.9, 2.5 -> second 1 holds 4 chunks
    outs = [req(0.0, 0.5, [0.7, 0.2], 1, 3), req(0.1, 1.0, [0.8, 0.6], 1, 3)]
    assert peak_output_tokens_per_s(outs) == 4.0


def test_empty_run_summarizes_as_zero():
    m = compute_metrics([RequestOutput(success=False, error="refused")], duration=1.0)
    assert (m.completed, m.failed) == (0, 1)
    assert m.summaries["ttft"].mean == 0.0
    assert m.max_concurrent_requests == 0


def test_result_fields_and_report(timeline):
    m = compute_metrics(timeline, 2.0, percentiles=[50, 99.9], goodput={"ttft": 150})
    fields = metrics_to_dict(m, ["ttft", "tpot", "itl", "e2el"])
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99.9"):
            assert f"{stat}_{name}_ms" in fields
    assert fields["request_goodput"] == pytest.approx(1.0)
    assert "p99_ttft_ms" not in fields
    only_ttft = metrics_to_dict(m, ["ttft"])
    assert "mean_tpot_ms" not in only_ttft
    report = format_report(m, ["ttft", "e2el"], {"Maximum request concurrency:": 8})
    assert "Serving Benchmark Result" in report
    assert "Mean TTFT (ms):" in report and "150.00" in report
    assert "P99.9 TTFT (ms):" in report
    assert "Request goodput (req/s):" in report
    assert "Maximum request concurrency:" in report
    assert "TPOT" not in report
