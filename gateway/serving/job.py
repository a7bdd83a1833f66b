"""One admitted completion request, from its backend's stream to its usage row.

`Job.events` streams the backend's chunks for every choice, counting tokens as they come
and trying another replica while nothing has reached the client; `Job.finish` (its base,
gateway.serving.job_finish) commits the usage row, settles the quota and updates metrics.
Admission (gateway.serving.admission) builds a Job or refuses the request; the HTTP layer
(openai_api) only formats what a Job yields.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from gateway.backends import (
    AdapterLoadError,
    Backend,
    BackendError,
    GenChunk,
    GenRequest,
    Progress,
)
from gateway.serving.choice_streams import merged, queued
from gateway.serving.echo import Echo
from gateway.serving.job_finish import JobFinish
from gateway.serving.metering import ChoiceMeter, metered
from gateway.serving.prefill_apart import prefill_apart
from gateway.serving.tool_calls import ToolPlan
from gateway.serving.traces import traced_call
from gateway.state import GatewayState
from gateway.tenancy.auth import Principal
from gateway.tenancy.quota import Reservation
from gateway.tenancy.quota.limits import ratelimit_headers
from gateway.tenancy.quota.prices import Price

log = logging.getLogger("kvgate")
# A stream's tokens reach the dashboard's rates (gateway.observe.stats) at its first token,
# then at most this often, and the rest when it ends: not once a chunk.
RATES_EVERY_S = 0.1


@dataclass
class Job(JobFinish):
    gw: GatewayState
    principal: Principal
    chat: bool
    model: str
    backend: Backend
    request_id: str
    created: int
    requests: list[GenRequest]  # one per choice, prompt-major
    n: int
    reservation: Reservation
    user: str | None
    # priced at admission: a reload's new prices, or the adapter deleted while it runs,
    # do not change what it costs
    price: Price
    block_hashes: list[str] = field(default_factory=list)  # the first prompt's full blocks
    # other healthy replicas of the model: a request whose replica fails before any
    # output reaches the client is tried again on the next one
    fallbacks: list[Backend] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    completion_tokens: int = 0
    cached_by_prompt: dict[int, int] = field(default_factory=dict)
    counted: dict[int, int] = field(default_factory=dict)  # choice -> its tokens so far
    told: int = 0  # the completion tokens the dashboard's rates have heard of
    told_at: float = 0.0
    counted_by: str = "engine"  # "gateway" if the gateway counted any choice's output
    finished: bool = False
    tools: ToolPlan = field(default_factory=ToolPlan)  # chat: the calls a reply may make
    echoes: list[Echo] | None = None  # completions with echo: one per prompt
    adapter: str | None = None  # the LoRA adapter `model` names (its requests carry it)
    meters: list[ChoiceMeter] = field(default_factory=list)  # one per choice, per attempt
    # a long prompt prefilled on a prefill worker first (prefill_apart.py): that job's
    # cached tokens, per prompt; None until it has been tried
    prefill_cached: dict[int, int] | None = None
    # how much of each prompt sent apart the prefill worker computed (it fills this)
    prefill_progress: dict[int, Progress] = field(default_factory=dict)
    span: Span | None = None  # the request's server span while tracing is on
    batch: tuple[str, str] | None = None  # a Batch API line's (batch id, custom_id)

    def echo_of(self, choice: int) -> Echo | None:
        return None if self.echoes is None else self.echoes[choice // self.n]

    @property
    def num_choices(self) -> int:
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        # A prompt counts once however many choices it has (as OpenAI counts it), as its
        # meter settles it (a text-bound prompt: by the backend's usage, within the bound)
        if self.meters:
            return sum(m.prompt for m in self.meters[:: self.n])
        return sum(len(r.prompt_token_ids) for r in self.requests[:: self.n])

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached_by_prompt.values())

    @property
    def image_tokens(self) -> int:
        """Of the prompt tokens, its images' placeholders, as the engine counted them
        (within the prompt; 0 where it sent no usage)."""
        claims = [m.claim for m in self.meters[:: self.n]]
        return sum(c.image_tokens for c in claims if c is not None)

    def headers(self) -> dict[str, str]:
        r = self.reservation
        return ratelimit_headers(r.limits, r.remaining, r.windows) | {
            "x-request-id": self.request_id
        }

    async def events(self) -> AsyncIterator[tuple[int, GenChunk]]:
        if self.prefill_cached is None:
            self.requests, self.prefill_cached = await prefill_apart(
                self.gw,
                self.backend,
                self.requests,
                self.n,
                self.block_hashes,
                self.prefill_progress,
            )
        while True:
            try:
                async for item in self._attempt():
                    yield item
                return
            except BackendError as e:
                if isinstance(e, AdapterLoadError):  # the registry shows it, the log says
                    self.gw.adapters.load_failed(e, self.backend.name)
                if self.counted or not self.fallbacks:
                    raise  # output went out, or no replica is left: the client hears
                failed, self.backend = self.backend, self.fallbacks.pop(0)
                self.gw.router.release(failed)
                self.gw.router.claim(self.backend)
                log.warning(
                    "request %s: %s failed before any output (%s); retrying on %s",
                    *(self.request_id, failed.name, e, self.backend.name),
                )

    def _generate(self, req: GenRequest, meter: ChoiceMeter) -> AsyncIterator[GenChunk]:
        """The backend's stream for one choice, in its span while the request is traced
        (a request the sampler left out has none: the upstream still hears so from the
        server span's traceparent, current in the handler)."""
        tracing = self.gw.tracing
        if tracing is None or self.span is None or not self.span.is_recording():
            return self._stream(req, meter)
        return traced_call(
            *(tracing, self.span, self.chat, self.model, self.backend.name, req, meter),
            lambda traced, slot_given: self._stream(traced, meter, slot_given),
        )

    def _stream(
        self, req: GenRequest, meter: ChoiceMeter, slot_given: Callable[[int], None] | None = None
    ) -> AsyncIterator[GenChunk]:
        """The backend's stream for one choice, through its meter; through the gateway's
        fair queue when the backend has one (its scheduler is not kvgate's)."""
        stream = metered(self.backend.generate(req, meter.progress), meter)
        queue = self.gw.queues.get(self.backend.name)
        return stream if queue is None else queued(queue, req, stream, meter, slot_given)

    async def _attempt(self) -> AsyncIterator[tuple[int, GenChunk]]:
        self.meters = [ChoiceMeter.of(r, self.backend) for r in self.requests]
        if len(self.requests) == 1:  # the common case, one generator layer less
            gen = self._generate(self.requests[0], self.meters[0])
            try:
                async for chunk in gen:
                    self._account(0, chunk)
                    yield 0, chunk
            finally:
                await gen.aclose()
            return
        stream = merged(
            [self._generate(r, m) for r, m in zip(self.requests, self.meters, strict=True)]
        )
        try:
            async for index, chunk in stream:
                self._account(index, chunk)
                yield index, chunk
        finally:
            await stream.aclose()

    def _account(self, index: int, chunk: GenChunk) -> None:
        """The chunk is on its way to the client: the running counts move."""
        tokens = self.meters[index].count
        self.completion_tokens += tokens - self.counted.get(index, 0)
        self.counted[index] = tokens
        if chunk.token_ids or chunk.text:
            now = time.perf_counter()
            self.last_token_at = now
            if self.first_token_at is None:
                self.first_token_at = now
                self._tell_rates(now, self.prompt_tokens)  # its prefill is done
            elif now - self.told_at >= RATES_EVERY_S:  # the rates move while it streams
                self._tell_rates(now)

    def _tell_rates(self, now: float, prompt: int = 0) -> None:
        """The dashboard's rates hear of the tokens streamed since they last did."""
        delta = self.completion_tokens - self.told
        if prompt or delta:
            p = self.principal
            self.gw.traffic.tokens_streamed(p.tenant_id or "", p.tenant_name, prompt, delta)
        self.told, self.told_at = self.completion_tokens, now

    @property
    def ttft(self) -> float | None:
        """Seconds to the first token; None if none came."""
        return None if self.first_token_at is None else self.first_token_at - self.started

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after each choice's first; None without two tokens."""
        if self.first_token_at is None or self.completion_tokens <= self.num_choices:
            return None
        return (self.last_token_at - self.first_token_at) / (
            self.completion_tokens - self.num_choices
        )
