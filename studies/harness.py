"""What the studies share, written once: free ports, a nearest-rank percentile, `kvgate
serve` and `kvgate worker` processes started and stopped, aiohttp apps served from a
thread (the made-up upstreams of studies and tests), tenant keys made through a
live gateway's admin API, TOML backend entries, and the tiny random Llama's shape.

Each study used to carry its own copy of these (or import them from another study);
one harness keeps their behaviour alike, so two studies' figures are taken the same way.
A process is ready when it prints its listening line (the gateway's own, "kvgate:
listening on", never a supervised worker's relayed into the same log). What the product
benchmark already has (its client, `bench.metrics.percentile`, `bench.tiny_model`) the
studies import from `bench`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import aiohttp
from aiohttp import web

from studies.ports import free_port

ADMIN_KEY = "kvg-bench-admin-" + "s" * 32
GATEWAY_READY = "kvgate: listening on "
WORKER_READY = "kvgate worker: listening on "  # gateway/worker/cli.py's READY_LINE
# quotas that never bind: a study measures the server, not a tenant's limits
UNLIMITED = {"rpm": 10**9, "tpm": 10**12, "max_concurrent": 10**6}
# bench.tiny_model's random Llama at the size the serving studies run (51.7M parameters
# with a 32,000-token vocabulary): big enough that the engine, not the HTTP path, is the
# cost, small enough for a shared CPU
TINY_LLAMA = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4}


def kv_block_bytes(shape: dict, block_size: int, dtype_bytes: int = 4) -> int:
    """One KV block of a model of `shape`: K and V, every layer, `block_size` tokens of
    every KV head (float32 by default, as the CPU runs the tiny model)."""
    head_dim = shape["hidden_size"] // shape["num_heads"]
    return 2 * shape["num_layers"] * block_size * shape["num_kv_heads"] * head_dim * dtype_bytes


class ThreadedApps:
    """aiohttp apps on loopback ports, served from a thread of their own with their own
    event loop: a made-up upstream that a real gateway (a process, or an app in the
    test's loop) reaches over real sockets. A subclass says what to serve (`apps`);
    `with` starts and stops it."""

    def __init__(self) -> None:
        self.port = free_port()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    def apps(self) -> list[tuple[web.Application, int]]:
        """Each app to serve and its port (`self.port` is the first one's)."""
        raise NotImplementedError

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        runners = []
        for app, port in self.apps():
            runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
        self._ready.set()
        await self._stop.wait()
        for runner in runners:
            await runner.cleanup()


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The value at rank round(q% of n-1) of the sorted values: always one that was
    measured (bench.metrics.percentile interpolates between two)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    """Until `url` answers /v1/models (200, or 401 without a key); an early exit or a
    timeout raises with the end of `log`."""

    async def probe() -> bool:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            async with aiohttp.ClientSession() as s, s.get(url + "/v1/models") as r:
                return r.status in (200, 401)
        return False

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{log.read_text()[-3000:]}")
        if asyncio.run(probe()):
            return
        time.sleep(0.3)
    raise RuntimeError(f"server did not come up in {timeout}s:\n{log.read_text()[-3000:]}")


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM (a gateway stops its own workers), SIGKILL if it is still there."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Process:
    """A kvgate command whose output goes to `workdir/name.log`; `url` is the address it
    announced on its `ready` line."""

    def __init__(
        self,
        workdir: Path,
        name: str,
        args: list[str],
        ready: str,
        env: dict[str, str] | None = None,
        timeout_s: float = 180,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.log = workdir / f"{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", *args],
            env=os.environ | (env or {}),
            cwd=cwd,  # another commit's checkout: its modules come before the installed ones
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({self.proc.returncode}):\n{self.tail()}")
            lines = [line for line in self.log.read_text().splitlines() if line.startswith(ready)]
            if lines:
                self.url = lines[0].removeprefix(ready).strip()
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{name} did not start in {timeout_s:g} s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text()[-chars:]

    def stop(self) -> None:
        stop_process(self.proc, timeout=60)

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_gateway(
    workdir: Path,
    name: str,
    config: str,
    *flags: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Process:
    """`kvgate serve` on a free port with `config` as its TOML and its own SQLite file,
    unless `env` (over these defaults) names another database; from the source tree
    `cwd` when given."""
    (workdir / f"{name}.toml").write_text(config)
    args = ["--config", str(workdir / f"{name}.toml"), "serve", "--port", str(free_port())]
    defaults = {
        "KVGATE_ADMIN_KEY": ADMIN_KEY,
        "KVGATE_DATABASE_URL": f"sqlite+aiosqlite:///{workdir / name}.db",
    }
    env = defaults | (env or {})
    return Process(workdir, name, [*args, *flags], GATEWAY_READY, env, cwd=cwd)


def start_worker(
    workdir: Path, name: str, token: str, *flags: str, env: dict[str, str] | None = None
) -> Process:
    """`kvgate worker` on a port it picks, callable with `token` (`env` over the
    environment)."""
    # `=`: a token_urlsafe token may start with "-", which argparse takes for a flag
    args = ["worker", "--port", "0", f"--worker-token={token}", *flags]
    return Process(workdir, name, args, WORKER_READY, env)


def admin(url: str, method: str, path: str, body: dict | None = None) -> object:
    """One call of a gateway's admin API with ADMIN_KEY; its JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data, method=method)
    req.add_header("Authorization", f"Bearer {ADMIN_KEY}")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def make_tenant(url: str, name: str, **limits: float) -> tuple[str, str]:
    """A new tenant with `limits` (the gateway's defaults for the rest): its id and an API
    key for it."""
    tenant = admin(url, "POST", "/admin/tenants", {"name": name, **limits})
    assert isinstance(tenant, dict)
    key = admin(url, "POST", f"/admin/tenants/{tenant['id']}/keys", {})
    assert isinstance(key, dict)
    return tenant["id"], key["key"]


def tenant_key(url: str, name: str = "bench", **limits: float) -> str:
    """An API key of a new tenant whose quotas never bind, unless `limits` set some (a
    fair-share `weight`, an `rpm`, ...)."""
    return make_tenant(url, name, **UNLIMITED, **limits)[1]


def backend_rows(url: str) -> list[dict]:
    """/admin/backends: each replica's name and counters (where the requests went)."""
    out = admin(url, "GET", "/admin/backends")
    rows = out["data"] if isinstance(out, dict) else out
    assert isinstance(rows, list)
    return rows


def toml_backend(name: str, kind: str, served: str, model: str = "", **options: object) -> str:
    """One [[backends]] entry; options as its table (JSON values are valid TOML here)."""
    lines = [
        "[[backends]]",
        f'name = "{name}"',
        f'type = "{kind}"',
        f'served_model_name = "{served}"',
    ]
    if model:
        lines.append(f"model = {json.dumps(model)}")
    lines.append("[backends.options]")
    lines += [f"{key} = {json.dumps(value)}" for key, value in options.items()]
    return "\n".join(lines) + "\n"


def device_environment(device: str) -> dict:
    """What a kernel or copy study ran on: torch, Python, the device (and the GPU's name)."""
    import platform

    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device}
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name()
    return env
