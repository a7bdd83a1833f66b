"""`kvgate serve --workers N`: N `kvgate worker` processes for one backend, kept alive.

Each worker is a child process on a loopback port, placed on its own GPU or share of
the cores (placement.py), reached with one token generated here. The first start takes
a free port (the worker prints it); a restarted worker comes back on the same one, so
the gateway's `remote` replicas keep their addresses. A worker that dies is restarted
with backoff (doubling while it keeps dying soon after starting), and `on_restart(url)`
tells the gateway, which prefills its pins there again: a restarted worker's cache is
empty (a new epoch). Children run in their own session, so a terminal's Ctrl-C reaches
the gateway, which stops them in order (SIGTERM, then SIGKILL after a grace period);
each also exits by itself if the supervising process goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from gateway.backends import BackendSpec
from gateway.backends.kv_transfer import BOTH, DECODE, PREFILL
from gateway.worker_pool import READY_LINE
from gateway.worker_pool.placement import Placement, place_workers, visible_gpus

log = logging.getLogger("kvgate.supervisor")
OUTPUT_TAIL = 20  # lines of a worker's output kept to explain a failed start


class WorkerStartError(RuntimeError):
    """A worker exited, or did not answer /health, before it was ready."""


@dataclass
class Worker:
    index: int
    placement: Placement
    role: str = BOTH  # prefill | decode | both (`kvgate worker --role`)
    port: int = 0  # 0 until the first start picks one
    proc: asyncio.subprocess.Process | None = None
    epoch: str = ""
    started_at: float = 0.0
    restarts: int = 0
    relay: asyncio.Task | None = None
    output: deque[str] = field(default_factory=lambda: deque(maxlen=OUTPUT_TAIL))


class WorkerSupervisor:
    def __init__(
        self,
        spec: BackendSpec,
        n: int,
        *,
        on_restart: Callable[[str], Awaitable[None]] | None = None,
        prefill: int = 0,  # the first `prefill` workers prefill, the rest decode
        start_timeout_s: float = 600.0,  # loading a large model takes minutes
        grace_s: float = 10.0,
        backoff_s: tuple[float, float] = (0.5, 30.0),  # first delay, longest delay
        stable_s: float = 30.0,  # a worker that ran this long restarts at the first delay
        env: dict[str, str] | None = None,  # beyond the gateway's own environment
    ) -> None:
        if n < 1:
            raise ValueError(f"workers must be >= 1, got {n}")
        self.spec = spec
        self.token = secrets.token_urlsafe(32)
        self.on_restart = on_restart
        self.env = env or {}
        self.start_timeout_s, self.grace_s = start_timeout_s, grace_s
        self.backoff_s, self.stable_s = backoff_s, stable_s
        cpus = sorted(os.sched_getaffinity(0))
        placements = place_workers(spec, n, cpus, visible_gpus(spec))
        roles = [PREFILL] * prefill + [DECODE] * (n - prefill) if prefill else [BOTH] * n
        pairs = zip(placements, roles, strict=True)
        self.workers = [Worker(i, p, role) for i, (p, role) in enumerate(pairs)]
        self._monitors: list[asyncio.Task] = []
        self._stopping = False

    def url(self, worker: Worker) -> str:
        """The worker's `/v1` base URL: what a `remote` backend's `options.urls` take."""
        return f"http://127.0.0.1:{worker.port}/v1"

    @property
    def urls(self) -> list[str]:
        return [self.url(w) for w in self.workers]

    def urls_of(self, role: str) -> list[str]:
        return [self.url(w) for w in self.workers if w.role == role]

    def remote_options(self) -> dict[str, object]:
        """`options` for a `remote` backend spec that reaches these workers."""
        return {"urls": self.urls, "api_key": self.token}

    async def start(self) -> None:
        """Start every worker and wait until each is healthy; on a failure, stop them all
        and raise WorkerStartError."""
        try:
            async with asyncio.TaskGroup() as group:
                for w in self.workers:
                    group.create_task(self._launch(w))
        except BaseException as e:
            await self.stop()
            if isinstance(e, BaseExceptionGroup):
                raise e.exceptions[0] from None
            raise
        self._monitors = [asyncio.create_task(self._monitor(w)) for w in self.workers]

    async def stop(self) -> None:
        """SIGTERM to every worker; SIGKILL to those still running after `grace_s`."""
        self._stopping = True
        for task in self._monitors:
            task.cancel()
        await asyncio.gather(*self._monitors, return_exceptions=True)
        await asyncio.gather(*(self._end(w) for w in self.workers))

    async def _launch(self, w: Worker) -> None:
        w.output.clear()
        w.proc = await asyncio.create_subprocess_exec(
            *self._command(w),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=os.environ | self.env | w.placement.env | {"KVGATE_WORKER_TOKEN": self.token},
            start_new_session=True,
            limit=1 << 20,
        )
        ready = asyncio.get_running_loop().create_future()
        w.relay = asyncio.create_task(self._relay(w, w.proc, ready))
        try:
            async with asyncio.timeout(self.start_timeout_s):
                w.port = await ready
                w.epoch = await self._health(w)
        except TimeoutError:
            raise WorkerStartError(
                f"worker {w.index} was not ready within {self.start_timeout_s:g} s:\n"
                + "\n".join(w.output)
            ) from None
        w.started_at = time.monotonic()
        log.info("worker %d (pid %d) ready at %s", w.index, w.proc.pid, self.url(w))

    def _command(self, w: Worker) -> list[str]:
        spec = self.spec
        # each worker is one replica: the spec's `replicas` is how many workers there are
        options = {k: v for k, v in spec.options.items() if k != "replicas"}
        options |= w.placement.options
        cmd = [sys.executable, "-m", "gateway.cli", "worker", "--host", "127.0.0.1"]
        cmd += ["--port", str(w.port), "--backend", spec.type, "--options", json.dumps(options)]
        cmd += ["--parent-pid", str(os.getpid()), "--role", w.role]
        if spec.model:
            cmd += ["--model", spec.model]
        if spec.served_model_name:
            cmd += ["--served-model-name", spec.served_model_name]
        if w.placement.cpus:
            cmd += ["--cpus", ",".join(map(str, w.placement.cpus))]
        return cmd

    async def _relay(
        self, w: Worker, proc: asyncio.subprocess.Process, ready: asyncio.Future
    ) -> None:
        """Log the worker's output as it comes (a full pipe would stall the worker) and
        resolve `ready` with the port it announces."""
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            w.output.append(line)
            log.log(_relay_level(line), "worker %d: %s", w.index, line)
            if line.startswith(READY_LINE) and not ready.done():
                ready.set_result(int(line.rsplit(":", 1)[1]))
        if ready.done():
            return
        code = await proc.wait()
        # start() may have given up on this worker meanwhile (another worker failed and the
        # task group cancelled the wait on `ready`): nothing is left to tell
        if not ready.done():
            ready.set_exception(
                WorkerStartError(
                    f"worker {w.index} exited ({code}) before it was ready:\n" + "\n".join(w.output)
                )
            )

    async def _health(self, w: Worker) -> str:
        """The worker's epoch, once its /health answers ok."""
        url = f"http://127.0.0.1:{w.port}/health"
        async with aiohttp.ClientSession() as http:
            while True:
                with contextlib.suppress(aiohttp.ClientError, ValueError):
                    async with http.get(url) as r:
                        if r.status == 200:
                            return (await r.json())["epoch"]
                await asyncio.sleep(0.1)

    async def _monitor(self, w: Worker) -> None:
        """Restart the worker whenever it exits, until the supervisor stops."""
        failures = 0  # deaths soon after a start, and failed starts, in a row
        while True:
            assert w.proc is not None
            code = await w.proc.wait()
            ran = time.monotonic() - w.started_at
            failures = failures + 1 if ran < self.stable_s else 0
            why = f"worker {w.index} exited ({code}) after {ran:.0f} s"
            while True:
                delay = self._backoff(failures)
                log.warning("%s; restarting it in %.1f s", why, delay)
                await asyncio.sleep(delay)
                try:
                    await self._launch(w)
                    break
                except (WorkerStartError, OSError) as e:
                    failures += 1
                    why = f"worker {w.index} did not start: {e}"
                    await self._end(w)
            w.restarts += 1
            if self.on_restart is not None:
                try:
                    await self.on_restart(self.url(w))
                except Exception:  # the gateway's hook must not end the supervision
                    log.exception("on_restart(%s) failed", self.url(w))

    def _backoff(self, failures: int) -> float:
        first, longest = self.backoff_s
        return min(longest, first * 2 ** max(failures - 1, 0))

    async def _end(self, w: Worker) -> None:
        proc = w.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            try:
                async with asyncio.timeout(self.grace_s):
                    await proc.wait()
            except TimeoutError:
                log.warning(
                    "worker %d (pid %d) ignored SIGTERM for %g s; killing it",
                    w.index,
                    proc.pid,
                    self.grace_s,
                )
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
            # 0: it drained its requests (gateway/http/drain.py) and exited cleanly
            log.info("worker %d (pid %d) exited (%s)", w.index, proc.pid, proc.returncode)
        if w.relay is not None:
            await w.relay  # the output's end: the pipe closed with the process


def _relay_level(line: str) -> int:
    """A worker's warnings and errors reach the gateway's log; the rest of its output (its
    start-up, llama.cpp's load messages) only with `kvgate serve --verbose`."""
    return logging.WARNING if _ALARMING.search(line) else logging.DEBUG


_ALARMING = re.compile(r"\b(WARNING|ERROR|CRITICAL|Traceback)\b")
