"""Graceful drain: what a gateway or a worker does between SIGTERM and its exit.

A load balancer needs a moment to see a replica leave, so the listener stays open:
`/ready` turns 503 at once (`/health` stays 200: the process is alive, it must not be
killed for draining), and a request that still arrives is answered 503 with
`Retry-After` in its API's shape, which its client retries on another replica, rather
than refused by a closed port. The requests in flight finish, up to the drain timeout;
the streams still open then are cut: their handlers are cancelled where they wait for
output (`cuttable`), and `was_cut` tells the handler it was the drain, not a client
that left, so it ends the stream with its API's error event and bills what it
delivered. Only after that does the server close, and the usage rows are flushed.

One Drain per server (the gateway's, a worker's), kept under the app key DRAIN.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from aiohttp import web

from gateway.http.errors import ApiError

# after the cut, how long the cut handlers get to write their error events and usage rows
CUT_GRACE_S = 5.0
RETRY_AFTER_S = 1  # another replica is up: retry at once, elsewhere

SHUTTING_DOWN = ApiError(
    503,
    "This server is shutting down and takes no new requests; retry on another replica.",
    code="shutting_down",
    headers={"Retry-After": str(RETRY_AFTER_S)},
)


@dataclass
class Drain:
    """The work that drains: POST requests under `paths` (inference, not admin)."""

    paths: tuple[str, ...]
    draining: bool = False
    running: set[asyncio.Task] = field(default_factory=set)
    _cuttable: set[asyncio.Task] = field(default_factory=set)
    _cut: set[asyncio.Task] = field(default_factory=set)
    _hurry: asyncio.Event = field(default_factory=asyncio.Event)

    def covers(self, request: web.Request) -> bool:
        return request.method == "POST" and request.path.startswith(self.paths)

    def admit(self, request: web.Request) -> asyncio.Task | None:
        """A request's start: SHUTTING_DOWN while draining, else its task, counted in
        `running` until the caller discards it; None for work the drain does not cover."""
        if not self.covers(request):
            return None
        if self.draining:
            raise SHUTTING_DOWN
        task = asyncio.current_task()
        assert task is not None
        self.running.add(task)
        return task

    def cuttable(self) -> AbstractContextManager[None]:
        """Around the wait for a request's output: where the drain may cut it."""
        task = asyncio.current_task()
        assert task is not None
        return _Cuttable(self._cuttable, task)

    def was_cut(self) -> bool:
        """In a handler that caught CancelledError: True if the drain cancelled it (the
        cancellation is then withdrawn, so the handler can still answer)."""
        task = asyncio.current_task()
        if task is None or task not in self._cut:
            return False
        self._cut.discard(task)
        task.uncancel()
        return True

    def hurry(self) -> None:
        """Stop waiting: cut what is left now (a second SIGTERM or Ctrl-C)."""
        self._hurry.set()

    async def run(self, timeout_s: float) -> int:
        """Refuse new work, let what runs finish for up to `timeout_s`, then cut what is
        left and give it CUT_GRACE_S to end. Returns how many requests were cut."""
        self.draining = True
        await self._wait(timeout_s)
        cut = [t for t in self._cuttable if not t.done()]
        for task in cut:
            self._cut.add(task)
            task.cancel()
        await self._wait(CUT_GRACE_S, hurry=False)
        return len(cut)

    async def _wait(self, timeout_s: float, hurry: bool = True) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        hurried = asyncio.ensure_future(self._hurry.wait())
        try:
            while self.running and (left := end - loop.time()) > 0:
                if hurry and self._hurry.is_set():
                    return
                waiting = {*self.running, hurried} if hurry else set(self.running)
                await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hurried.cancel()


class _Cuttable:
    """`Drain.cuttable`'s block: the task is cuttable while in it. A class, not a
    generator: every request enters one (docs/PERF.md, issue 53)."""

    __slots__ = ("tasks", "task")

    def __init__(self, tasks: set[asyncio.Task], task: asyncio.Task) -> None:
        self.tasks, self.task = tasks, task

    def __enter__(self) -> None:
        self.tasks.add(self.task)

    def __exit__(self, *exc: object) -> None:
        self.tasks.discard(self.task)


DRAIN = web.AppKey("drain", Drain)


@web.middleware
async def drain_guard(request: web.Request, handler) -> web.StreamResponse:
    """New work is refused while draining; the work in flight is counted until it ends."""
    drain = request.app[DRAIN]
    task = drain.admit(request)
    if task is None:
        return await handler(request)
    try:
        return await handler(request)
    finally:
        drain.running.discard(task)


async def until_signalled(
    drain: Drain,
    timeout_s: Callable[[], float],
    who: str,
    on_hangup: Callable[[], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Wait for SIGTERM or SIGINT, then drain for `timeout_s()` (read then: a reload may
    have changed it); a second signal cuts what is left at once. SIGHUP calls
    `on_hangup` until then (and is ignored after, where it would otherwise end the
    process). `stop`: an event others may set too (a worker whose parent is gone)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_stop() -> None:
        if stop.is_set():
            drain.hurry()
        stop.set()

    def on_hup() -> None:
        if on_hangup is not None and not stop.is_set():  # not while draining
            on_hangup()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_stop)
    loop.add_signal_handler(signal.SIGHUP, on_hup)
    await stop.wait()
    timeout = timeout_s()
    print(
        f"{who}: draining: not ready, no new requests; {len(drain.running)} in flight get "
        f"up to {timeout:g} s",
        flush=True,
    )
    cut = await drain.run(timeout)
    print(f"{who}: drained ({cut} cut at the timeout); shutting down", flush=True)
