"""The worker's KV events as a numbered log, so that a gateway that polls them resumes
where it left off, or learns that it cannot and resyncs from a snapshot.

The engine hands out its events once (`kv_events()` drains them); a gateway may poll,
lose its connection, restart, or poll a worker that restarted (a new epoch: its cache is
empty). The log keeps the most recent events by sequence number and, beside them, the
set of blocks stored now: a reader too far behind gets that set instead of a history.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from engine_api.records import KVEvent
from gateway.backends import PrefixCachingBackend

MAX_EVENTS = 100_000  # the log's length: a reader further behind resyncs
DRAIN_INTERVAL_S = 0.05
log = logging.getLogger("kvgate.worker")


@dataclass
class EventsReply:
    """One long poll's answer. resync: `events` is a snapshot (one "stored" event per
    block and medium held now) and the reader must forget what it knew of this worker first."""

    epoch: str
    seq: int  # the last event's number: the reader's next `after`
    resync: bool
    events: list[KVEvent]

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "seq": self.seq,
            "resync": self.resync,
            "events": [e.to_dict() for e in self.events],
        }


class EventLog:
    """Events numbered 1, 2, ... in arrival order; the last `capacity` are kept."""

    def __init__(self, epoch: str, capacity: int = MAX_EVENTS) -> None:
        self.epoch = epoch
        self.seq = 0
        self._log: deque[KVEvent] = deque(maxlen=capacity)
        # (medium, block hash) -> the event that stored it there
        self._stored: dict[tuple[str, str], KVEvent] = {}
        self._arrived = asyncio.Event()

    def append(self, events: list[KVEvent]) -> None:
        for event in events:
            self.seq += 1
            self._log.append(event)
            key = (event.medium, event.block_hash)
            if event.kind == "stored":
                self._stored[key] = event
            else:
                self._stored.pop(key, None)
        if events:
            self._arrived.set()
            self._arrived = asyncio.Event()  # the next waiters wait for the next append

    async def poll(self, epoch: str, after: int, wait_s: float) -> EventsReply:
        """The events numbered above `after`, waiting up to `wait_s` for the first one;
        a snapshot when `epoch` is not this worker's or `after` is not in the log."""
        if self._must_resync(epoch, after):
            return self.snapshot()
        if after == self.seq and wait_s > 0:
            arrived = self._arrived
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await arrived.wait()
            if self._must_resync(epoch, after):  # the log moved past `after` meanwhile
                return self.snapshot()
        first = after - (self.seq - len(self._log))  # index of event `after + 1`
        return EventsReply(
            self.epoch, self.seq, False, list(itertools.islice(self._log, first, None))
        )

    def snapshot(self) -> EventsReply:
        return EventsReply(self.epoch, self.seq, True, list(self._stored.values()))

    def _must_resync(self, epoch: str, after: int) -> bool:
        oldest_known = self.seq - len(self._log)  # events up to this one are gone
        return epoch != self.epoch or not oldest_known <= after <= self.seq


async def drain_forever(backend: PrefixCachingBackend, events: EventLog) -> None:
    """Move the engine's events into the log every DRAIN_INTERVAL_S, until cancelled."""
    while True:
        try:
            events.append(backend.kv_events())
        except Exception:  # an engine's bad moment must not end the log for good
            log.exception("reading KV events from %s failed", backend.name)
        await asyncio.sleep(DRAIN_INTERVAL_S)
