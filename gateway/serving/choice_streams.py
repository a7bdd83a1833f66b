"""How a Job's choices reach it: each through the gateway's fair queue when its backend
has one (the backend's scheduler is not kvgate's), and several merged into one stream as
their chunks come. Stream plumbing only, kept apart from the Job's accounting
(gateway.serving.job) so each reads alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from gateway.backends import GenChunk, GenRequest
from gateway.routing.fair_queue import CACHED_TOKEN_COST, FairQueue
from gateway.serving.metering import ChoiceMeter


async def queued(
    queue: FairQueue,
    req: GenRequest,
    stream: AsyncIterator[GenChunk],
    meter: ChoiceMeter,
    slot_given: Callable[[int], None] | None = None,
) -> AsyncIterator[GenChunk]:
    """Wait for a slot in line with the tenant's other requests, then stream, charging
    the tenant for the service as it is given: the meter's count (the backend's usage
    only where the meter took it). `slot_given` hears when the wait began (time.time_ns)
    once it ends: a trace's span of the wait."""
    tenant = req.tenant_id
    asked = time.time_ns()
    async with queue.slot(tenant, req.weight, req.priority):
        if slot_given is not None:
            slot_given(asked)
        queue.charge(tenant, len(req.prompt_token_ids))
        charged = 0
        try:
            async for chunk in stream:
                if chunk.finish_reason is not None and meter.cached:  # the last chunk's usage
                    queue.charge(tenant, -(1 - CACHED_TOKEN_COST) * meter.cached)
                queue.charge(tenant, meter.count - charged)
                charged = meter.count
                yield chunk
        finally:
            await stream.aclose()


_DONE = object()


async def merged(gens: list[AsyncIterator[GenChunk]]) -> AsyncIterator[tuple[int, GenChunk]]:
    """Interleave several choices' streams as their chunks come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, gen: AsyncIterator[GenChunk]) -> None:
        try:
            async for chunk in gen:
                queue.put_nowait((index, chunk))
            queue.put_nowait((index, _DONE))
        except Exception as e:
            queue.put_nowait((index, e))
        finally:
            await gen.aclose()

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
