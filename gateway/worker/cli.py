"""`kvgate worker`: its flags, its configuration, and the process's life.

The engine flags are `kvgate serve`'s and become a BackendSpec through the same code
(Settings.resolved_backends); `--options` adds engine options (a JSON object) that
serve takes from a [[backends]] entry. A worker is one replica of one backend.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import signal
import sys
from dataclasses import replace
from typing import Any

ENGINE_CHOICES = ["auto", "fake", "gpu", "local"]
READY_LINE = "kvgate worker: listening on "  # the supervisor and tests wait for it


def add_parser(sub: Any) -> None:
    p = sub.add_parser("worker", help="run one engine in its own process, served over HTTP")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001, help="0: any free port (printed)")
    p.add_argument("--backend", choices=ENGINE_CHOICES)
    p.add_argument("--model", help="GGUF file or HF directory (default: Gemma 3 270M)")
    p.add_argument("--served-model-name")
    p.add_argument("--quantization", choices=["fp8", "int8"], help="gpu backend: 8-bit weights")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], help="gpu backend: fp8 KV cache")
    p.add_argument("--fairness", choices=["vtc", "fcfs"], help="gpu backend: default vtc")
    p.add_argument(
        "--options", type=_json_object, default={}, help='engine options, e.g. {"n_threads": 2}'
    )
    p.add_argument("--worker-token", help="callers must send it (or KVGATE_WORKER_TOKEN)")
    p.add_argument("--cpus", type=_cpu_list, help="run on these CPU cores only, e.g. 0-3 or 0,2")
    p.add_argument("--parent-pid", type=int, help="exit when this process is gone")


def run(args: argparse.Namespace) -> int:
    token = args.worker_token or os.environ.get("KVGATE_WORKER_TOKEN") or None
    if token is None and not is_loopback(args.host):
        print(
            f"kvgate worker: refusing to listen on {args.host} without a worker token: anyone "
            "who reaches it could use the engine. Set --worker-token or KVGATE_WORKER_TOKEN.",
            file=sys.stderr,
        )
        return 2
    if args.cpus:
        os.sched_setaffinity(0, args.cpus)  # before the engine sizes its thread pools
    from gateway.backends import build_backends
    from gateway.config import load_settings

    overrides = {
        "host": args.host,
        "port": args.port,
        "backend": args.backend,
        "model": args.model,
        "served_model_name": args.served_model_name,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "fairness": args.fairness,
        "replicas": 1,
    }
    try:
        settings = load_settings(args.config, overrides)
        specs = settings.resolved_backends()
        if len(specs) != 1:
            raise ValueError(f"a worker runs one backend; the configuration has {len(specs)}")
        spec = replace(specs[0], options=specs[0].options | args.options)
        backends = build_backends(spec)
        if len(backends) != 1:
            raise ValueError("a worker is one replica: run one worker per replica")
    except (OSError, ValueError) as e:
        print(f"kvgate worker: bad configuration: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from gateway.worker.state import WorkerState

    state = WorkerState(settings, backends[0], spec.type, token)
    try:
        _run_loop(_serve(state, args.parent_pid))
    except Exception as e:  # the engine did not start: say why in one line, then exit
        logging.getLogger("kvgate.worker").debug("start-up failed", exc_info=True)
        print(f"kvgate worker: cannot start: {e}", file=sys.stderr)
        return 1
    return 0


async def _serve(state, parent_pid: int | None) -> None:
    from aiohttp import web

    from gateway.http_server import GatewayRunner
    from gateway.worker.app import create_worker_app

    settings = state.settings
    runner = GatewayRunner(create_worker_app(state), settings, access_log=None)
    await runner.setup()  # starts the engine
    stop = asyncio.Event()
    watcher = None if parent_pid is None else asyncio.create_task(_watch_parent(parent_pid, stop))
    try:
        site = web.TCPSite(runner, settings.host, settings.port, backlog=1024)
        await site.start()
        port = runner.addresses[0][1]
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        print(f"{READY_LINE}http://{host}:{port}", flush=True)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        print("kvgate worker: shutting down (draining requests)", flush=True)
    finally:
        if watcher is not None:
            watcher.cancel()
        await runner.cleanup()


async def _watch_parent(pid: int, stop: asyncio.Event) -> None:
    """A supervised worker must not outlive its supervisor (it would hold the engine's
    memory and its port): when the parent is gone the process is re-parented."""
    while os.getppid() == pid:
        await asyncio.sleep(1)
    stop.set()


def _run_loop(coro) -> None:
    try:
        import uvloop  # the event loop is most of the per-request cost, as in serve
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name that may resolve anywhere


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _cpu_list(text: str) -> list[int]:
    """`0-3,6` -> [0, 1, 2, 3, 6] (the shape of taskset's and cgroups' lists)."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cpus.extend(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a CPU list: {text!r}") from None
    if not cpus:
        raise argparse.ArgumentTypeError("no CPUs given")
    return cpus
