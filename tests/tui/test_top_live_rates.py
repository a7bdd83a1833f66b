"""The dashboard's rates move while long streams generate, not only when they end: a real
`kvgate serve` with a slow fake backend, streams from the openai client, and the
dashboard following the gateway's stats stream."""

from __future__ import annotations

import asyncio
import contextlib

import openai
from top_helpers import SIZE

from tests.conftest import ADMIN_KEY, start_gateway
from tui.app import TopApp
from tui.source import StatsSource
from tui.widgets import TenantsTable

# 400 tokens at 10 a second: each stream lasts 40 s, far longer than the test needs
SLOW_FAKE = """
[[backends]]
name = "fake"
type = "fake"
served_model_name = "fake-model"
tokens_per_second = 10
"""
STREAMS = 3
MAX_SNAPSHOTS = 50  # the dashboard gets this many refreshes to show the streams


async def test_output_rate_moves_while_the_streams_run(tmp_path):
    gateway = start_gateway(tmp_path, config=SLOW_FAKE)
    _, key = gateway.tenant_key("acme")
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)
    streams = []
    try:
        for i in range(STREAMS):
            stream = await client.chat.completions.create(
                model="fake-model",
                messages=[{"role": "user", "content": f"a very long story number {i}"}],
                max_tokens=400,
                stream=True,
            )
            streams.append(stream)
            await anext(aiter(stream))  # it has started
        app = TopApp(StatsSource(gateway.url, ADMIN_KEY, interval=0.2))
        async with app.run_test(size=SIZE) as pilot:

            def output_shown() -> bool:
                return app.source.dashboard().throughput[0].current > 0

            while app.source.received < MAX_SNAPSHOTS and not output_shown():
                await pilot.pause(0.05)
            await pilot.pause()

            board = app.source.dashboard()
            assert board.throughput[0].current > 0, f"{app.source.received} snapshots"
            # no stream has finished: every token on screen was counted as it streamed
            assert board.in_flight == STREAMS and board.totals["completion_tokens"] == 0
            title = app.query_one("#chart-output").border_title
            assert title.startswith("output ") and title.split()[1] != "0.0"
            assert board.throughput[1].current > 0  # the prompts, counted at first token
            (acme,) = board.tenants
            assert acme.tokens_per_s > 0
            cell = app.query_one(TenantsTable).get_row_at(0)[2]
            assert str(cell) != "0.0"
    finally:
        for stream in streams:
            with contextlib.suppress(Exception):
                await stream.close()
        await client.close()
        await asyncio.to_thread(gateway.stop)
