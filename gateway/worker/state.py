"""What one worker process holds: its engine adapter, its epoch and its KV event log, the
requests it runs, and the checks every route makes before it reaches the engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field

from aiohttp import web

from engine_api.block_hash import hash_blocks
from engine_api.errors import BadRequestError, PromptTooLongError
from engine_api.records import GenRequest, ModelCard
from gateway.backends import Backend, PrefixCachingBackend
from gateway.backends.kv_transfer import BOTH
from gateway.config import Settings
from gateway.http.drain import Drain
from gateway.http.errors import ApiError
from gateway.observe.tracing import Tracing
from gateway.worker.events import EventLog, drain_forever
from gateway.worker.kv_pull import KVPuller
from gateway.worker.running import RunningRequests

log = logging.getLogger("kvgate.worker")
WORK_PATHS = ("/v1/", "/kvgate/v1/generate")  # POSTs under these are what a drain waits for
_PROBE_TOKENS = 4096  # longer than any engine's block


@dataclass
class WorkerState:
    settings: Settings  # the transport's limits (body size and timeouts, connections)
    backend: Backend
    kind: str  # fake | gpu | local
    token: str | None  # None: no auth (only allowed on a loopback address)
    # prefill | decode | both: what a gateway sends it (gateway.backends.kv_transfer)
    role: str = BOTH
    # pulls the blocks of a request another worker prefilled (its kv_source)
    puller: KVPuller = field(default_factory=lambda: KVPuller(None))
    # a restarted worker has a new epoch: readers of its events know its cache is empty
    epoch: str = field(default_factory=lambda: secrets.token_hex(8))
    started_at: float = field(default_factory=time.time)
    block_size: int | None = None  # how the engine keys its cache; None: no prefix events
    # OpenTelemetry traces (gateway/observe/tracing.py); None: off, and no span is made
    tracing: Tracing | None = None
    # SIGTERM's drain (gateway/http/drain.py): generation is its work
    drain: Drain = field(default_factory=lambda: Drain(WORK_PATHS))
    # the requests in flight, for a gateway to stop one and hear what it computed
    running: RunningRequests = field(default_factory=RunningRequests)
    events: EventLog = field(init=False)
    _drain: asyncio.Task | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.events = EventLog(self.epoch)

    @property
    def prefix_events(self) -> bool:
        return isinstance(self.backend, PrefixCachingBackend)

    async def start(self) -> None:
        await self.backend.start()
        if isinstance(self.backend, PrefixCachingBackend):
            self.block_size = probe_block_size(self.backend)
            self._drain = asyncio.create_task(drain_forever(self.backend, self.events))

    async def stop(self) -> None:
        if self._drain is not None:
            self._drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain
        await self.backend.stop(drain=True)
        await self.puller.close()
        if self.tracing is not None:  # the last requests' spans go out before the exit
            await self.tracing.close()

    def card(self, model: str) -> ModelCard:
        """The served model's card, or 404 as OpenAI words it."""
        cards = self.backend.models()
        for card in cards:
            if card.id == model:
                return card
        served = ", ".join(c.id for c in cards)
        raise ApiError(
            404, f"The model `{model}` does not exist. Available: {served}.", code="model_not_found"
        )

    def check_request(self, req: GenRequest) -> None:
        """BadRequestError for a request no engine call can serve: a model not served
        here, an empty prompt, or one that does not fit the context with max_tokens (its
        images are counted and checked as they are decoded: generate.read_request)."""
        context = {c.id: c.context_length for c in self.backend.models()}
        if req.model not in context:
            served = ", ".join(map(repr, context))
            raise BadRequestError(f"model {req.model!r} is not served here (this serves {served})")
        if not req.prompt_token_ids:
            raise BadRequestError("The prompt is empty.")
        prompt, wanted = len(req.prompt_token_ids), req.sampling.max_tokens
        if prompt + wanted > context[req.model]:
            raise PromptTooLongError(prompt, wanted, context[req.model])


WORKER = web.AppKey("worker", WorkerState)  # the app's state, for the route handlers


def probe_block_size(backend: PrefixCachingBackend) -> int | None:
    """The block size `backend.block_hashes` keys its cache with, checked against
    engine_api's hash chain: a gateway hashes prompts for this worker by itself with
    it, so a size that does not reproduce the engine's hashes is not reported."""
    tokens = list(range(1, _PROBE_TOKENS + 1))
    if not backend.block_hashes(tokens, None):
        return None
    low, high = 1, _PROBE_TOKENS  # the shortest prompt with one full block is the size
    while low < high:
        mid = (low + high) // 2
        if backend.block_hashes(tokens[:mid], None):
            high = mid
        else:
            low = mid + 1
    for salt in (None, "probe"):
        if backend.block_hashes(tokens, salt) != [h.hex() for h in hash_blocks(tokens, low, salt)]:
            log.warning("%s keys its cache in a way engine_api cannot reproduce", backend.name)
            return None
    return low
