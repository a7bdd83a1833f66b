"""The dashboard against a real HTTP server on a local socket: it follows the SSE
stream, falls back to polling, shows a lost gateway, and reconnects when it is back."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json

from top_helpers import ADMIN_KEY, DATA, SIZE, StatsServer, wait_for

from studies.ports import free_port
from tui.app import TopApp
from tui.source import StatsSource, load_replay
from tui.widgets import StatusBar, TenantsTable


def live_app(port: int, admin_key: str = ADMIN_KEY) -> TopApp:
    source = StatsSource(
        f"http://127.0.0.1:{port}", admin_key, interval=0.05, backoff_s=(0.05, 0.2)
    )
    return TopApp(source)


def status_text(app) -> str:
    bar = app.query_one(StatusBar)
    return "\n".join(strip.text for strip in bar.render_lines(bar.region.reset_offset))


async def test_shows_the_stream_then_the_outage_then_recovers():
    port = free_port()
    server = StatsServer(load_replay(DATA), port)
    await server.start()
    app = live_app(port)
    async with app.run_test(size=SIZE) as pilot:
        try:
            await wait_for(pilot, lambda: app.source.received >= 3)
            assert app.source.connection.state == "connected"
            assert app.query_one(TenantsTable).row_count == 6
            assert "connected" in status_text(app)

            await server.stop()
            await wait_for(pilot, lambda: app.source.connection.state == "disconnected")
            await wait_for(pilot, lambda: "cannot connect" in app.source.connection.error)
            text = status_text(app)
            assert "disconnected" in text and "retry in" in text
            assert app.dashboard.has_class("-disconnected")  # red frames
            # The last numbers stay on screen while the gateway is away.
            assert app.query_one(TenantsTable).row_count == 6

            seen = app.source.received
            await server.start()
            await wait_for(pilot, lambda: app.source.received > seen)
            await wait_for(pilot, lambda: app.source.connection.state == "connected")
            assert "connected" in status_text(app)
            assert not app.dashboard.has_class("-disconnected")
        finally:
            if server.runner is not None:
                await server.stop()


async def test_falls_back_to_polling_without_the_stream_route():
    port = free_port()
    server = StatsServer(load_replay(DATA), port, stream=False)
    await server.start()
    app = live_app(port)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.source.received >= 2)
            assert app.source.connection.state == "polling"
            assert app.query_one(TenantsTable).row_count == 6
    finally:
        await server.stop()


async def test_a_wrong_admin_key_is_reported_and_not_retried():
    port = free_port()
    server = StatsServer(load_replay(DATA), port)
    await server.start()
    app = live_app(port, admin_key="wrong")
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.source.connection.state == "refused")
            assert "HTTP 401" in app.source.connection.error
            text = status_text(app)
            assert "not retrying" in text and "admin key rejected: invalid admin key" in text
            assert app.dashboard.has_class("-disconnected")
            # far longer than the 0.05 s backoff: a retry would have come and gone
            await pilot.pause(0.5)
            assert app.source.connection.state == "refused"
            assert app.source.connection.attempt == 1 and app.source.received == 0
    finally:
        await server.stop()


async def test_no_gateway_at_all_keeps_retrying_with_backoff():
    app = live_app(free_port())
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.source.connection.attempt >= 3)
        connection = app.source.connection
        assert "cannot connect" in connection.error
        # Waits double from 0.05 s up to the 0.2 s ceiling.
        await wait_for(pilot, lambda: app.source.connection.retry_in_s == 0.2)
        assert app.query_one(TenantsTable).row_count == 0


async def test_record_writes_what_the_stream_sent():
    port = free_port()
    snapshots = load_replay(DATA)
    server = StatsServer(snapshots, port)
    await server.start()
    record = io.StringIO()
    try:
        source = StatsSource(f"http://127.0.0.1:{port}", ADMIN_KEY, interval=0.05, record=record)
        task = asyncio.create_task(source.run())
        while source.received < 5:
            await asyncio.sleep(0.02)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        await server.stop()
    recorded = [json.loads(line) for line in record.getvalue().splitlines()]
    assert len(recorded) == source.received
    assert recorded == snapshots[: len(recorded)]
