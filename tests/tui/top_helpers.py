"""Shared pieces of the `kvgate top` tests: the recorded file, an app that replays it,
and a real local HTTP server that serves the same snapshots the way the gateway does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp import web

from tui.app import TopApp
from tui.source import StatsSource, load_replay

DATA = Path(__file__).parent / "data" / "load.jsonl"
SIZE = (140, 42)
ADMIN_KEY = "test-admin-key"


def replay_app(speed: float = 0.0) -> TopApp:
    return TopApp(StatsSource(replay=load_replay(DATA), replay_name=DATA.name, speed=speed))


async def played_out(pilot) -> None:
    """Wait until the replay has gone through the whole file and the screen shows it."""
    while pilot.app.source.connection.state != "replay finished":
        await pilot.pause(0.01)
    await pilot.pause()


async def wait_for(pilot, condition) -> None:
    """Let the app run until `condition()` holds (the test's timeout bounds the wait)."""
    while not condition():
        await pilot.pause(0.02)
    await pilot.pause()  # and let the screen catch up with it


class StatsServer:
    """The gateway's two stats routes on a real socket, replaying recorded snapshots.

    `stream=False` leaves the SSE route out, so clients must fall back to polling.
    """

    def __init__(self, snapshots: list[dict], port: int, stream: bool = True) -> None:
        self.snapshots = snapshots
        self.port = port
        self.stream = stream
        self.served = 0
        self.stopping = asyncio.Event()
        self.runner: web.AppRunner | None = None

    def _authorized(self, request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {ADMIN_KEY}"

    def _next(self) -> dict:
        snapshot = self.snapshots[self.served % len(self.snapshots)]
        self.served += 1
        return snapshot

    async def _stats(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return _unauthorized()
        return web.json_response(self._next())

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return _unauthorized()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        while not self.stopping.is_set():
            # CRLF line ends and a keep-alive comment, both legal SSE.
            await resp.write(b": keep-alive\r\n\r\n")
            await resp.write(b"data: " + json.dumps(self._next()).encode() + b"\r\n\r\n")
            await asyncio.sleep(0.02)
        return resp

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/admin/stats", self._stats)
        if self.stream:
            app.router.add_get("/admin/stats/stream", self._stream)
        self.stopping.clear()
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        self.stopping.set()  # ends open streams, so the shutdown need not wait for them
        assert self.runner is not None
        await self.runner.cleanup()
        self.runner = None


def _unauthorized() -> web.Response:
    body = {"error": {"message": "invalid admin key", "type": "invalid_request_error"}}
    return web.json_response(body, status=401)
