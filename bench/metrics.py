"""Serving metrics from request timelines, with vLLM's `bench serve` definitions.

- TTFT: send to first generated text; E2EL: send to last generated text (a reply
  with no text: to its first and last chunk, bench/client.py).
- TPOT: (E2EL - TTFT) / (output_tokens - 1), for requests with more than one token.
- ITL: every gap between consecutive text chunks, pooled over requests.
- Goodput: requests per second that met every given SLO (ms); a one-token
  request counts TPOT 0.
- Throughputs divide by the benchmark's wall duration; token counts are the
  server's usage. A request without usage adds no tokens and no TPOT.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.client import RequestOutput

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
METRIC_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass
class Summary:
    """mean/median/std and selected percentiles of one metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]


@dataclass
class ServingMetrics:
    completed: int
    failed: int
    missing_usage: int  # successful requests whose server sent no usage
    duration: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    summaries: dict[str, Summary]


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> Summary:
    """Seconds in, milliseconds out; an empty list summarizes as zeros (like vLLM)."""
    ms = np.asarray(values_s if len(values_s) else [0.0], dtype=float) * 1000.0
    return Summary(
        mean=float(np.mean(ms)),
        median=float(np.median(ms)),
        std=float(np.std(ms)),
        percentiles={p: float(np.percentile(ms, p)) for p in percentiles},
    )


def request_tpot(out: RequestOutput) -> float | None:
    if out.output_tokens is None or out.output_tokens < 1:
        return None
    if out.output_tokens == 1:
        return 0.0
    return (out.latency - out.ttft) / (out.output_tokens - 1)


def peak_concurrency(outputs: Sequence[RequestOutput]) -> int:
    """Most requests in flight at once, intervals [start, start + latency) half-open."""
    events = sorted(
        [(o.start_time, 1) for o in outputs] + [(o.start_time + o.latency, -1) for o in outputs]
    )  # at equal times -1 sorts first: one request ending as another starts is not overlap
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def peak_output_tokens_per_s(outputs: Sequence[RequestOutput]) -> float:
    """Most text chunks that arrived within one one-second bucket from the first send.

    Like vLLM, each chunk counts as one token here (a per-second histogram cannot
    split a chunk's usage); with one token per chunk, as kvgate and vLLM stream, it is exact.
    """
    if not outputs:
        return 0.0
    t0 = min(o.start_time for o in outputs)
    buckets: dict[int, int] = {}
    for o in outputs:
        t = o.start_time + o.ttft
        times = [t]
        for gap in o.itl:
            t += gap
            times.append(t)
        for t in times:
            second = int(t - t0)
            buckets[second] = buckets.get(second, 0) + 1
    return float(max(buckets.values()))


def meets_slos(out: RequestOutput, goodput: dict[str, float]) -> bool:
    tpot = request_tpot(out)
    values = {"ttft": out.ttft, "tpot": tpot if tpot is not None else math.inf, "e2el": out.latency}
    return all(values[name] * 1000.0 <= slo_ms for name, slo_ms in goodput.items())


def compute_metrics(
    outputs: Sequence[RequestOutput],
    duration: float,
    percentiles: Sequence[float] = (99.0,),
    goodput: dict[str, float] | None = None,
) -> ServingMetrics:
    assert duration > 0, "the benchmark duration must be positive"
    ok = [o for o in outputs if o.success]
    with_usage = [o for o in ok if o.output_tokens is not None]
    total_in = sum(o.prompt_tokens or 0 for o in ok)
    total_out = sum(o.output_tokens for o in with_usage)
    tpots = [t for o in ok if (o.output_tokens or 0) > 1 and (t := request_tpot(o)) is not None]
    series = {
        "ttft": [o.ttft for o in ok],
        "tpot": tpots,
        "itl": [gap for o in ok for gap in o.itl],
        "e2el": [o.latency for o in ok],
    }
    good = sum(meets_slos(o, goodput) for o in ok) if goodput else None
    return ServingMetrics(
        completed=len(ok),
        failed=len(outputs) - len(ok),
        missing_usage=len(ok) - len(with_usage),
        duration=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        total_cached_tokens=sum(o.cached_tokens or 0 for o in ok),
        request_throughput=len(ok) / duration,
        request_goodput=None if good is None else good / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        max_output_tokens_per_s=peak_output_tokens_per_s(ok),
        max_concurrent_requests=peak_concurrency(ok),
        summaries={name: summarize(values, percentiles) for name, values in series.items()},
    )


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation, as numpy's default computes it (for callers without numpy's
    arrays at hand)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def percentile_key(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def metrics_to_dict(m: ServingMetrics, selected: Sequence[str]) -> dict:
    """The flat JSON fields vLLM's `--save-result` writes (mean_ttft_ms, p99_tpot_ms, ...)."""
    result = {
        "duration": m.duration,
        "completed": m.completed,
        "failed": m.failed,
        "missing_usage": m.missing_usage,
        "total_input_tokens": m.total_input_tokens,
        "total_output_tokens": m.total_output_tokens,
        "total_cached_tokens": m.total_cached_tokens,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
    }
    for name in selected:
        s = m.summaries[name]
        result[f"mean_{name}_ms"] = s.mean
        result[f"median_{name}_ms"] = s.median
        result[f"std_{name}_ms"] = s.std
        for p, value in s.percentiles.items():
            result[f"p{percentile_key(p)}_{name}_ms"] = value
    return result


def format_report(m: ServingMetrics, selected: Sequence[str], header: dict[str, object]) -> str:
    """The familiar `bench serve` result block."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]

    def row(label: str, value: object) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40} {text:<10}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    for label, value in header.items():
        row(label, value)
    row("Benchmark duration (s):", m.duration)
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    if m.total_cached_tokens:
        row("Cached prompt tokens:", m.total_cached_tokens)
    if m.missing_usage:
        row("Requests without usage (uncounted):", m.missing_usage)
    row("Request throughput (req/s):", m.request_throughput)
    if m.request_goodput is not None:
        row("Request goodput (req/s):", m.request_goodput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s)
    row("Peak concurrent requests:", m.max_concurrent_requests)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    for name in selected:
        short, title = METRIC_HEADERS[name]
        s = m.summaries[name]
        lines.append(f"{title:-^50}")
        row(f"Mean {short} (ms):", s.mean)
        row(f"Median {short} (ms):", s.median)
        for p, value in s.percentiles.items():
            row(f"P{percentile_key(p)} {short} (ms):", value)
    lines.append("=" * 50)
    return "\n".join(lines)
