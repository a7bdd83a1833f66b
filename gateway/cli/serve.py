"""`kvgate serve`: run the gateway until SIGINT/SIGTERM, then drain and exit; SIGHUP
reloads its config."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import socket
import sys

from aiohttp import web

from gateway.app import create_app
from gateway.config import Settings
from gateway.config_load import ConfigSource
from gateway.http.drain import until_signalled
from gateway.http.server import GatewayRunner
from gateway.reload import reload_on_signal
from gateway.serving.parser_choice import parsers_of
from gateway.state import GW, GatewayState
from gateway.tenancy.tenants import STARTER_TENANT
from gateway.worker_pool.supervisor import WorkerStartError

# after the drain, how long other connections (a dashboard's live stream) get to close
CLOSE_GRACE_S = 2.0


class CannotServe(Exception):
    """Why the gateway cannot run, as one line for the user: no traceback."""


class CannotListen(CannotServe):
    """The port is taken or the address is not ours."""


def _listen_error(settings: Settings, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return (
            f"port {settings.port} is in use; pick another with --port N or KVGATE_PORT=N "
            "(make serve PORT=N)"
        )
    return f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}"


def _check_models_dir(settings: Settings) -> None:
    if settings.models_dir and not os.path.isdir(settings.models_dir):
        raise CannotServe(f"the models directory {settings.models_dir} is not a directory")


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


async def serve(settings: Settings, source: ConfigSource | None = None) -> None:
    _check_can_listen(settings)
    _check_models_dir(settings)
    app = create_app(settings, source)
    # the gateway's transport: limits on slow and idle clients (gateway/http/server.py)
    runner = GatewayRunner(app, settings, access_log=None, shutdown_timeout=CLOSE_GRACE_S)
    try:
        await runner.setup()
    except WorkerStartError as e:  # --workers: no worker came up, nothing to serve
        lines = [line for line in str(e).splitlines() if line.strip()]
        last = f" {lines[-1].strip()}" if len(lines) > 1 else ""
        raise CannotServe(f"{lines[0]}{last}; nothing to serve") from None
    gw = app[GW]
    if why := _nothing_to_serve(gw):
        await runner.cleanup()
        raise CannotServe(why)
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
    reloads: set[asyncio.Task] = set()

    def reload() -> None:  # SIGHUP
        task = asyncio.create_task(reload_on_signal(gw))
        reloads.add(task)  # a task nothing holds may be collected mid-way
        task.add_done_callback(reloads.discard)

    await until_signalled(gw.drain, lambda: gw.settings.drain_timeout_s, "kvgate", reload)
    await runner.cleanup()


def _nothing_to_serve(gw: GatewayState) -> str | None:
    """Why no backend can serve (every one failed to start), or None. A gateway with
    nothing to serve would only answer "Available: none": better to exit and say why."""
    if not gw.backends or any(b.name not in gw.router.broken for b in gw.backends):
        return None
    reasons = list(dict.fromkeys(gw.router.broken.values()))
    more = f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""
    return f"{reasons[0]}{more}; nothing to serve"


def _announce(settings: Settings, gw: GatewayState) -> None:
    directory = gw.models_dir
    if directory is not None:
        names = ", ".join(directory.entries) or "none yet"
        print(
            f"kvgate: models directory {directory.directory} (loaded on first use, at most "
            f"{directory.models_max} at once): {names}",
            flush=True,
        )
    for backend in gw.backends:
        if directory is not None and directory.owns(backend):
            continue
        kind = gw.backend_types[backend.name]
        models = ", ".join(m for m, bs in gw.router.serving.items() if backend in bs) or "-"
        if backend.name in gw.router.broken:  # its WARNING below says why
            print(f"kvgate: backend {backend.name} ({kind}) DOWN for: {models}", flush=True)
            continue
        if not backend.stats().healthy:  # watched: it serves once it answers
            line = f"kvgate: backend {backend.name} ({kind}) not answering yet, for: {models}"
            print(line, flush=True)
            continue
        parsers = parsers_of(gw, backend)  # said where any reads its replies
        said = f" ({parsers.line()})" if parsers.source != "none" else ""
        print(f"kvgate: backend {backend.name} ({kind}) serving: {models}{said}", flush=True)
        if kind == "fake":
            print(
                "kvgate: NOTE this is the fake backend: deterministic made-up words, no model. "
                "Use --backend gpu|local --model PATH for real inference.",
                flush=True,
            )
    for why in gw.router.broken.values():
        print(f"kvgate: WARNING {why}", file=sys.stderr, flush=True)
    _announce_keys(gw)
    print(f"kvgate: listening on http://{settings.host}:{settings.port}", flush=True)


def _announce_keys(gw: GatewayState) -> None:
    """A first start's keys, once (only their hashes are stored), as lines to paste into
    the shell the examples of the docs run in ($ADMIN, $KEY)."""
    if not gw.generated_admin_key:
        return
    if gw.starter_key:
        print(
            f'kvgate: generated an admin key, and the tenant "{STARTER_TENANT}" with a key of '
            "its own; they are shown only this once, store them now. $ADMIN manages tenants "
            "and keys, $KEY calls the models: paste into the shell you will call from:\n"
            f"    export ADMIN={gw.generated_admin_key}\n"
            f"    export KEY={gw.starter_key}",
            flush=True,
        )
        return
    print(
        "kvgate: generated an admin key; it is shown only this once, store it now:\n"
        f"    export ADMIN={gw.generated_admin_key}",
        flush=True,
    )


def configure_logging(verbose: bool) -> None:
    """kvgate's own log at INFO; other libraries' (Alembic's migration steps, llama.cpp's
    load messages, a worker's output) only with --verbose, with kvgate's DEBUG lines
    (a failed backend's traceback). A new user's first screen is the admin key."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("kvgate").setLevel(logging.DEBUG if verbose else logging.INFO)


def run(settings: Settings, verbose: bool = False, source: ConfigSource | None = None) -> int:
    """The exit status: 0 after a clean shutdown, 1 when the address cannot be bound or
    no backend could start."""
    configure_logging(verbose)
    try:
        import uvloop  # the event loop is most of the gateway's per-request cost

        loop_run = uvloop.run
    except ImportError:  # only this import: an ImportError while serving must surface
        loop_run = asyncio.run
    try:
        loop_run(serve(settings, source))
    except CannotServe as e:
        print(f"kvgate: {e}", file=sys.stderr)
        return 1
    return 0
