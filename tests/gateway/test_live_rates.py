"""The rates in /admin/stats count tokens as they stream, so a long generation shows while
it runs; the totals (like the usage rows) still count a request when it ends."""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI

from gateway.observe.stats import RATE_WINDOW_S, Finished, TrafficStats
from tests.gateway.conftest import fake_backends

T0 = 1_000_000.0  # a fixed clock: the rates are a pure function of the times given


def _output_rate(traffic: TrafficStats, now: float) -> float:
    return traffic.snapshot(now)["rates"]["output_tokens_per_s"]


def test_streamed_tokens_count_before_the_request_ends():
    traffic = TrafficStats()
    traffic.started_at = T0 - 100
    traffic.request_started("t1", "acme")
    traffic.tokens_streamed("t1", "acme", prompt=30, output=1, now=T0)
    for i in range(1, 20):
        traffic.tokens_streamed("t1", "acme", prompt=0, output=1, now=T0 + i * 0.25)
    snap = traffic.snapshot(T0 + 5)

    assert snap["totals"]["completion_tokens"] == 0 and snap["totals"]["in_flight"] == 1
    assert snap["rates"]["output_tokens_per_s"] > 0
    span = 20 / snap["rates"]["output_tokens_per_s"]  # the 20 output tokens over the window
    assert RATE_WINDOW_S <= span <= RATE_WINDOW_S + 0.5
    assert snap["rates"]["prompt_tokens_per_s"] * span == pytest.approx(30)
    assert snap["rates"]["requests_per_s"] == 0  # a request counts when it is done
    (tenant,) = snap["tenants"]
    assert tenant["tokens_per_s"] * span == pytest.approx(50) and tenant["tokens"] == 0


def test_the_end_of_a_streamed_request_adds_no_token_twice():
    traffic = TrafficStats()
    traffic.started_at = T0 - 100
    traffic.request_started("t1", "acme")
    traffic.tokens_streamed("t1", "acme", prompt=30, output=20, now=T0)
    before = traffic.snapshot(T0 + 1)["rates"]
    traffic.request_finished("t1", "acme", Finished(T0 + 1, 30, 20, 0.1, 0.01, 1.0), ok=True)
    snap = traffic.snapshot(T0 + 1)

    assert snap["totals"]["prompt_tokens"] == 30 and snap["totals"]["completion_tokens"] == 20
    assert snap["rates"]["output_tokens_per_s"] == before["output_tokens_per_s"]
    assert snap["rates"]["prompt_tokens_per_s"] == before["prompt_tokens_per_s"]
    assert snap["rates"]["requests_per_s"] > 0 and snap["tenants"][0]["requests"] == 1


def test_a_prompt_that_got_no_token_counts_at_the_end():
    traffic = TrafficStats()
    traffic.started_at = T0 - 100
    traffic.request_started("t1", "acme")
    traffic.request_finished("t1", "acme", Finished(T0, 30, 0, None, None, 0.5), ok=True)
    assert traffic.snapshot(T0)["rates"]["prompt_tokens_per_s"] > 0


def test_tokens_leave_the_rates_after_the_window():
    traffic = TrafficStats()
    traffic.started_at = T0 - 100
    traffic.tokens_streamed("t1", "acme", prompt=5, output=5, now=T0)
    assert _output_rate(traffic, T0 + RATE_WINDOW_S - 0.5) > 0
    assert _output_rate(traffic, T0 + RATE_WINDOW_S + 1) == 0
    assert traffic.snapshot(T0 + RATE_WINDOW_S + 1)["tenants"][0]["tokens_per_s"] == 0


async def test_a_live_stream_moves_the_rates_before_it_ends(make_gateway):
    gw = await make_gateway(fake_backends(tokens_per_second=20))
    _, key = await gw.tenant("acme")
    client = AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    stream = await client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "a long story please"}],
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = stream.__aiter__()
    seen = 0
    while seen < 5:  # a few tokens out, most of the stream still to come
        chunk = await anext(chunks)
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
    _, snap = await gw.admin("GET", "/admin/stats")
    assert snap["totals"]["in_flight"] == 1 and snap["totals"]["completion_tokens"] == 0
    assert snap["rates"]["output_tokens_per_s"] > 0
    assert snap["rates"]["prompt_tokens_per_s"] > 0
    assert snap["tenants"][0]["tokens_per_s"] > 0

    usage = None
    async for chunk in chunks:
        usage = chunk.usage or usage
    await client.close()
    assert usage is not None and usage.completion_tokens == 40
    _, snap = await gw.admin("GET", "/admin/stats")
    assert snap["totals"]["completion_tokens"] == 40
    # every streamed token went into the rates once: the window's sums are the totals
    sums = [sum(b[i] for b in gw.state.traffic.recent.buckets) for i in (1, 2, 3)]
    assert sums == [1, usage.prompt_tokens, 40]
