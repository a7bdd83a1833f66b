"""The background watch over one remote upstream: health checks with backoff, what the
upstream is (a kvgate worker or a third-party server, its context length), a worker's
stats, and the long poll of its KV events.

The adapter's `stats()` must be cheap and never wait on the network (the router reads it
for every request), so everything it reports is gathered here, ahead of time. A failed
request wakes the watch at once, so a replica that just died leaves the rotation before
the next interval; a failing one is retried with backoff and rejoins when it answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_api.errors import BackendError, BadRequestError
from engine_api.records import EMBED, GENERATE, BackendStats
from gateway.backends.remote_discovery import Found, announce, pick_entry, positive_int, probe
from gateway.backends.remote_http import UpstreamClient, UpstreamRefused
from gateway.backends.remote_worker import WorkerEvents, WorkerInfo, parse_stats

log = logging.getLogger("kvgate.remote")

HEALTH_READ_S = 5.0  # at most this (or read_timeout_s) for a health or stats answer
HEALTH_MAX_BYTES = 64 * 1024  # a health answer is an epoch at most
EVENTS_WAIT_S = 1  # the KV-events long poll (the worker answers at once when it has some)


def backoff(interval_s: float, failures: int) -> float:
    """Seconds before the next try after `failures` in a row: a quarter of the interval,
    doubling, up to five intervals."""
    return min(interval_s / 4 * 2 ** (failures - 1), interval_s * 5)


@dataclass(frozen=True)
class UpstreamInfo:
    model: str  # the upstream's id of the model served (remote_discovery.pick_entry)
    context_length: int | None  # its max_model_len, or what probing found
    worker: WorkerInfo | None  # None: a third-party server
    found: Found = Found()  # a third-party server's probed context length and tokenizer
    task: str | None = None  # what its /v1/models entry says the model does (a worker's)
    vision: bool = False  # a worker's model takes images (its /v1/models entry's `vision`)


def parse_models(data: Any, wanted: str | None, default: str, label: str) -> dict:
    """The /v1/models entry of the model to use; BackendError if it is not served."""
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise BackendError(f"{label} sent an invalid model list")
    return pick_entry(entries, wanted, default, label)


class Monitor:
    """Health, discovery, stats and KV events of one upstream, kept up to date by
    background tasks between `start` and `stop`."""

    def __init__(
        self,
        client: UpstreamClient,
        name: str,
        model: str,
        interval_s: float,
        inflight: Callable[[], int],
        wanted: str | None = None,
        configured: dict[str, Any] | None = None,
    ) -> None:
        """`model`: the id to look for when `wanted` (options.upstream_model) is unset;
        `configured`: the entry's options, which win over what is discovered."""
        self.client = client
        self.model = model
        self.wanted = wanted
        self.configured = configured or {}
        self.interval_s = interval_s
        self.inflight = inflight
        self.healthy = False
        self.reason = "not checked yet"
        self.info: UpstreamInfo | None = None
        self.discovered = asyncio.Event()  # set by the first answer to /v1/models
        self.checked = asyncio.Event()  # set when the first check ends, either way
        self.refused = False  # the last check's answer refused the gateway (UpstreamRefused)
        self.stats: BackendStats | None = None  # a worker's, from the last check
        self.inflight_at_poll = 0  # this gateway's requests in flight when it was read
        self.last_progress = 0.0  # when a request to it last started or read output
        self.events = WorkerEvents(name)
        self._name = name
        self._use_models = False  # no /health there: /v1/models answers for it
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._polling_events = False

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._watch()))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def check_now(self, down: str | None = None) -> None:
        """A request failed: check at once; `down` (why) takes it out of rotation now."""
        if down is not None:
            self.healthy, self.reason = False, down
        self._wake.set()

    async def _watch(self) -> None:
        failures, woken = 0, False
        while True:
            try:
                if woken or not self._busy():
                    await self._check()
                if not self.healthy:
                    log.info("%s is healthy", self._name)
                self.healthy, self.reason, failures = True, "", 0
                delay = self.interval_s
            except Exception as e:  # the watch must outlive any one bad answer
                if not isinstance(e, BackendError | BadRequestError):
                    log.exception("%s: health check failed", self._name)
                elif self.healthy or failures == 0:
                    log.warning("%s is unhealthy: %s", self._name, e)
                self.healthy, self.reason = False, str(e)
                self.refused = isinstance(e, UpstreamRefused)
                failures += 1
                delay = backoff(self.interval_s, failures)
            self.checked.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            woken = self._wake.is_set()  # a request failed: check even if others flow
            self._wake.clear()

    def progress(self) -> None:
        """A request to the upstream just started or read output."""
        self.last_progress = time.monotonic()

    def _busy(self) -> bool:
        """Our requests to a third-party server are alive (one started or read output
        within the read timeout): they are its health check. Such servers may serve one
        request at a time: llama-cpp-python's queues even /v1/models behind a
        generation, and by default cuts the stream for it."""
        return (
            self.info is not None
            and self.info.worker is None
            and self.inflight() > 0
            and time.monotonic() - self.last_progress < self.client.read_timeout_s
        )

    async def _check(self) -> None:
        timeout_s = self.client.connect_timeout_s + min(self.client.read_timeout_s, HEALTH_READ_S)
        epoch = None if self._use_models else await self._health(timeout_s)
        worker = self.info.worker if self.info else None
        if self._use_models or self.info is None or (worker and epoch and epoch != worker.epoch):
            await self._discover(timeout_s)
        assert self.info is not None
        if self.info.worker is not None:
            url = self.client.endpoint.root + "/kvgate/v1/stats"
            data = await self.client.json("GET", url, timeout_s=timeout_s)
            self.stats = parse_stats(data, self._name, self.client.label)
            self.inflight_at_poll = self.inflight()

    async def _health(self, timeout_s: float) -> str | None:
        """GET /health: a worker's epoch, None for others (vLLM answers an empty body)."""
        url = self.client.endpoint.root + "/health"
        resp = await self.client.request("GET", url, timeout_s=timeout_s)
        async with resp:
            if resp.status == 404:  # llama-cpp-python's server has none
                self._use_models = True
                return None
            if resp.status != 200:
                await self.client.raise_for(resp)
            body = await self.client.read(resp, HEALTH_MAX_BYTES)
        with contextlib.suppress(ValueError):
            data = json.loads(body)
            if isinstance(data, dict) and isinstance(data.get("epoch"), str):
                return data["epoch"]
        return None

    async def _discover(self, timeout_s: float) -> None:
        url = self.client.endpoint.base + "/models"
        data = await self.client.json("GET", url, timeout_s=timeout_s)
        label = self.client.label
        entry = parse_models(data, self.wanted, self.model, label)
        worker = WorkerInfo.parse(entry["kvgate"], label) if "kvgate" in entry else None
        previous = self.info
        found = previous.found if previous and previous.model == entry["id"] else None
        length = positive_int(entry.get("max_model_len"))
        if worker is None and found is None:  # a new upstream (or model): ask it once
            context = length is None and "context_length" not in self.configured
            tokenizer = "tokenizer" not in self.configured
            found = await probe(self.client, entry["id"], timeout_s, context, tokenizer)
        found = found or Found()
        if length is not None:
            found = dataclasses.replace(found, context_length=length, context_from="/v1/models")
        task = entry.get("task") if entry.get("task") in (GENERATE, EMBED) else None
        vision = worker is not None and entry.get("vision") is True
        self.info = UpstreamInfo(entry["id"], found.context_length, worker, found, task, vision)
        if worker is None and (previous is None or previous.model != entry["id"]):
            announce(self._name, entry["id"], found, self.configured)
        if worker is not None and worker.prefix_events and not self._polling_events:
            self._polling_events = True
            self._tasks.append(asyncio.create_task(self._poll_events()))
        self.discovered.set()

    async def _poll_events(self) -> None:
        url = self.client.endpoint.root + "/kvgate/v1/kv_events"
        timeout_s = self.client.connect_timeout_s + self.client.read_timeout_s + EVENTS_WAIT_S
        failures = 0
        while True:
            params = {"epoch": self.events.epoch, "after": self.events.seq, "wait": EVENTS_WAIT_S}
            try:
                reply = await self.client.json("GET", url, params=params, timeout_s=timeout_s)
                self.events.apply(reply, self.client.label)
                failures = 0
            except Exception as e:  # the catalog is advisory: keep polling, with backoff
                failures += 1
                if not isinstance(e, BackendError | BadRequestError):
                    log.exception("%s: reading KV events failed", self._name)
                elif failures == 1:
                    log.warning("%s: reading KV events failed: %s", self._name, e)
                await asyncio.sleep(backoff(self.interval_s, failures))
