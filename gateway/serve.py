"""`kvgate serve`: run the gateway until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import signal
import socket
import sys

from aiohttp import web

from gateway.app import create_app
from gateway.config import Settings
from gateway.http_server import GatewayRunner
from gateway.openai_api import GW


class CannotListen(Exception):
    """The port is taken or the address is not ours: a one-line message, not a traceback."""


def _listen_error(settings: Settings, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return (
            f"port {settings.port} is in use; pick another with --port N or KVGATE_PORT=N "
            "(make serve PORT=N)"
        )
    return f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}"


def _check_can_listen(settings: Settings) -> None:
    """The engines take seconds to minutes to load: find a taken port before that. The
    real bind afterwards still catches a port taken in between."""
    if settings.port == 0:  # any free port
        return
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            settings.host, settings.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            probe.bind(addr)
    except OSError as e:
        raise CannotListen(_listen_error(settings, e)) from None


async def serve(settings: Settings) -> None:
    _check_can_listen(settings)
    app = create_app(settings)
    # the gateway's transport: limits on slow and idle clients (gateway/http_server.py)
    runner = GatewayRunner(app, settings, access_log=None)
    await runner.setup()
    gw = app[GW]
    site = web.TCPSite(runner, settings.host, settings.port, backlog=1024)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()  # the engines started: stop them before exiting
        raise CannotListen(_listen_error(settings, e)) from None
    # Everything allocated so far lives as long as the process: keep it out of the
    # collector's way, and collect young objects less often. Full collections over a
    # large heap were the longest pauses in the latency tail.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    _announce(settings, gw)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("kvgate: shutting down (draining requests)", flush=True)
    await runner.cleanup()


def _announce(settings: Settings, gw) -> None:
    for backend in gw.backends:
        kind = gw.backend_types[backend.name]
        models = ", ".join(m for m, bs in gw.router.serving.items() if backend in bs) or "-"
        print(f"kvgate: backend {backend.name} ({kind}) serving: {models}", flush=True)
        if kind == "fake":
            print(
                "kvgate: NOTE this is the fake backend: deterministic made-up words, no model. "
                "Use --backend gpu|local --model PATH for real inference.",
                flush=True,
            )
    for why in gw.router.broken.values():
        print(f"kvgate: WARNING {why}", file=sys.stderr, flush=True)
    if gw.generated_admin_key:
        print(
            "kvgate: generated an admin key; it is shown only this once, store it now:\n"
            f"    {gw.generated_admin_key}",
            flush=True,
        )
    print(f"kvgate: listening on http://{settings.host}:{settings.port}", flush=True)


def run(settings: Settings) -> int:
    """The exit status: 0 after a clean shutdown, 1 when the address cannot be bound."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop  # the event loop is most of the gateway's per-request cost

        loop_run = uvloop.run
    except ImportError:  # only this import: an ImportError while serving must surface
        loop_run = asyncio.run
    try:
        loop_run(serve(settings))
    except CannotListen as e:
        print(f"kvgate: {e}", file=sys.stderr)
        return 1
    return 0
