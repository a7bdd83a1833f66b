"""The requests a worker runs for a gateway, by the gateway's request id, so that a gateway
whose client left can stop one and hear what the engine computed of it first.

A gateway bills a request cut short by the prompt its engine computed (and an embedding
request by the inputs pooled): that work stays in the prefix cache. Closing the connection
aborts the request here, but tells the gateway nothing, and the engine's step in flight
still completes after it. So `POST /kvgate/v1/abort` (generate.py; the gateway's, before
it closes the stream) stops the request through this registry: its handler is cancelled,
and the answer waits until the engine applied the abort, then tells the final Progress.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from aiohttp import web

from engine_api.records import Progress
from gateway.backends.remote_abort import REQUEST_ID_HEADER

MAX_ID_CHARS = 200  # as AbortRequest's (gateway.schemas.fields.Name)


@dataclass
class _Running:
    task: asyncio.Task
    progress: Progress = field(default_factory=Progress)
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class RunningRequests:
    """The requests in flight here, each with its handler's task and its Progress."""

    def __init__(self) -> None:
        self._by_id: dict[str, _Running] = {}

    @contextlib.contextmanager
    def track(self, request_id: str) -> Iterator[Progress]:
        """Around a handler's whole engine call (the stream closed inside it): the
        Progress to give the engine; `stop` waits for the block to end."""
        task = asyncio.current_task()
        assert task is not None
        running = _Running(task)
        self._by_id[request_id] = running
        try:
            yield running.progress
        finally:
            running.ended.set()
            if self._by_id.get(request_id) is running:
                del self._by_id[request_id]

    async def stop(self, request_id: str) -> Progress | None:
        """Cancel the request's handler and wait until its engine applied the abort: its
        final Progress; None when no such request runs here."""
        running = self._by_id.get(request_id)
        if running is None:
            return None
        running.task.cancel()
        await running.ended.wait()
        return running.progress


def request_id_of(request: web.Request, fallback: str) -> str:
    """The gateway's name for the request (REQUEST_ID_HEADER), else `fallback`."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    return given if 0 < len(given) <= MAX_ID_CHARS and given.isprintable() else fallback
