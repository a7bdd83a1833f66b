"""One admitted completion request, from its backend's stream to its usage row.

`Job.events` streams the backend's chunks for every choice, counting tokens as they come
and trying another replica while nothing has reached the client; `Job.finish` commits the
usage row, settles the quota and updates metrics. Admission (gateway.serving.admission) builds a
Job or refuses the request; the HTTP layer (openai_api) only formats what a Job yields.
"""

from __future__ import annotations

import asyncio
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
    OutputCountingBackend,
    Progress,
)
from gateway.backends.capabilities import supports
from gateway.observe.stats import Finished
from gateway.serving.choice_streams import merged, queued
from gateway.serving.echo import Echo
from gateway.serving.metering import ChoiceMeter, metered
from gateway.serving.prefill_apart import prefill_apart
from gateway.serving.tool_calls import ToolPlan
from gateway.serving.traces import traced_call, usage_attributes
from gateway.state import GatewayState
from gateway.tenancy.auth import Principal
from gateway.tenancy.quota import Reservation
from gateway.tenancy.quota.limits import ratelimit_headers
from gateway.tenancy.quota.prices import Price
from gateway.tenancy.usage import UsageRow

log = logging.getLogger("kvgate")
# A stream's tokens reach the dashboard's rates (gateway.observe.stats) at its first token,
# then at most this often, and the rest when it ends: not once a chunk.
RATES_EVERY_S = 0.1


@dataclass
class Job:
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

    def _counts_to_await(self) -> bool:
        """Whether settling needs the tokenizer's counts (_count_tokens), which may await
        the upstream: a text-bound prompt without the backend's usage, or text that came
        without token ids, from a backend that counts them."""
        return supports(self.backend, OutputCountingBackend) and any(
            meter.text or (index % self.n == 0 and meter.prompt_bound and meter.claim is None)
            for index, meter in enumerate(self.meters)
        )

    async def _count_tokens(self) -> dict[int, int | None]:
        """The tokenizer's counts the meters need: each text-bound prompt's (into its
        meter), and each choice's text without token ids (returned, by choice)."""
        texts = {}
        for index, meter in enumerate(self.meters):
            if index % self.n == 0 and meter.prompt_bound and meter.claim is None:
                meter.prompt_counted = await self._count_prompt(index)
            texts[index] = await self._count_text(meter)
        return texts

    def _settle_meters(self, text_counts: dict[int, int | None]) -> None:
        """Each choice's completion tokens and each prompt's cached tokens, as billed:
        the backend's usage where its meter took it, else the gateway's own count (with
        the model's tokenizer for text that came without token ids: `text_counts`)."""
        total, cached, counters = 0, {}, set()
        for index, meter in enumerate(self.meters):
            tokens, counter = meter.billed(text_counts.get(index))
            total += tokens
            counters.add(counter)
            cached.setdefault(index // self.n, meter.cached)
        for prompt, on_prefill in (self.prefill_cached or {}).items():
            # as without disaggregation: the blocks found cached where the prompt ran
            cached[prompt] = max(cached.get(prompt, 0), on_prefill)
        self.completion_tokens, self.cached_by_prompt = total, cached
        self._tell_rates(time.perf_counter())  # what is left, as billed
        self.counted_by = "gateway" if "gateway" in counters else "engine"

    def _prompt_computed(self) -> int:
        """The prompt tokens of a request that ended before its answer did (a client that
        left, a drain's cut, a failure): per prompt, what its engines computed (its
        choices' replica, a prefill worker it went to first; all of it once one of its
        choices had output: its prefill was done), the cached tokens within that; none
        for a prompt no engine took. What was not computed is not cached for the next
        request either."""
        total = 0
        for prompt in range(len(self.requests) // self.n):
            first = prompt * self.n
            meters = self.meters[first : first + self.n]
            whole = meters[0].prompt if meters else len(self.requests[first].prompt_token_ids)
            taken = [m.progress for m in meters]
            if prompt in self.prefill_progress:
                taken.append(self.prefill_progress[prompt])
            computed = max((p.tokens for p in taken), default=0)
            if any(m.delivered for m in meters):
                computed = whole
            computed = min(computed, whole)
            cached = max([self.cached_by_prompt.get(prompt, 0), *(p.cached for p in taken)])
            self.cached_by_prompt[prompt] = min(cached, computed)
            total += computed
        return total

    async def _count_prompt(self, index: int) -> int | None:
        """A text-bound prompt the backend sent no usage for: its tokens by the upstream's
        tokenizer where it can count them (else the bound stands)."""
        if not supports(self.backend, OutputCountingBackend):
            return None
        try:
            req = self.requests[index]  # its model: the replica's (an adapter's base)
            return await self.backend.count_prompt(req.model, req.prompt_token_ids)
        except Exception:  # the bound stands; the row must still be written
            log.exception("request %s: counting its prompt failed", self.request_id)
            return None

    async def _count_text(self, meter: ChoiceMeter) -> int | None:
        """The tokenizer's count of the text the choice delivered without token ids; the
        upstream's /tokenize against its own usage only where that usage looks off."""
        if not meter.text or not supports(self.backend, OutputCountingBackend):
            return None
        try:
            return await self.backend.count_output(
                self.requests[0].model, "".join(meter.text), local_only=meter.plausible()
            )
        except Exception:  # the meter's own count stands; the row must still be written
            log.exception("request %s: counting its output failed", self.request_id)
            return None

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

    async def finish(
        self, status: int, finish_reason: str | None, error: str = "", delivered: bool = True
    ) -> None:
        """Commit the usage row, then settle quota and count. Safe to call once.
        `delivered` False: the client received none of the output (a whole response
        that failed), so none of it is billed."""
        assert not self.finished
        self.finished = True
        self.gw.router.release(self.backend)
        if self.adapter is not None:
            self.gw.adapters.release(self.adapter, served=self.first_token_at is not None)
        end = time.perf_counter()
        # Shielded: a client that goes away must not lose the row.
        if delivered and self._counts_to_await():  # all of it in a task: it awaits counts
            await asyncio.shield(self._count_then_record(status, finish_reason, error, end))
            return
        # the common case: the row is queued now and its commit awaited, with no task a
        # request (each a turn of the event loop and about 10 us)
        await asyncio.shield(self._record(status, finish_reason, error, delivered, end))

    async def _count_then_record(
        self, status: int, finish_reason: str | None, error: str, end: float
    ) -> None:
        counts = await self._count_tokens()
        await self._record(status, finish_reason, error, True, end, counts)

    def _record(
        self,
        status: int,
        finish_reason: str | None,
        error: str,
        delivered: bool,
        end: float,
        text_counts: dict[int, int | None] | None = None,
    ) -> asyncio.Future[None]:
        """The usage row queued; its future resolves once it is committed. The metrics and
        the dashboard count the request then, whether the commit worked or not."""
        prompt_tokens = 0
        try:
            if delivered:
                self._settle_meters(text_counts or {})
                prompt_tokens = self.prompt_tokens if status == 200 else self._prompt_computed()
            else:
                self.completion_tokens, self.cached_by_prompt = 0, {}
            row = self._usage_row(status, finish_reason, prompt_tokens, end)
            if self.span is not None:
                self.span.set_attributes(
                    usage_attributes(
                        self.request_id,
                        prompt_tokens,
                        self.completion_tokens,
                        self.cached_tokens,
                        self.ttft,
                        finish_reason,
                    )
                )
            committed = self.gw.usage.submit(row)
        except BaseException:
            self._count(status, prompt_tokens, end, error)
            raise

        def done(f: asyncio.Future[None]) -> None:
            if not f.cancelled() and f.exception() is None:
                self.gw.metrics.billed(self.principal.tenant_name, self.model, row.spend_nano_usd)
            self._count(status, prompt_tokens, end, error)

        committed.add_done_callback(done)
        return committed

    def _usage_row(
        self, status: int, finish_reason: str | None, prompt_tokens: int, end: float
    ) -> UsageRow:
        """The request's row, with its spend and the quota settlement that commits with it."""
        gw, p, ttft = self.gw, self.principal, self.ttft
        spend = self.price.spend(prompt_tokens, self.cached_tokens, self.completion_tokens)
        # settled with the row: in memory at once, on PostgreSQL in the row's commit
        settlement = gw.quota.settlement(
            self.reservation,
            prompt_tokens + self.completion_tokens,
            # a batch line is no request of the tenant's rate (rpm): given back
            count_request=status not in (503,) and self.batch is None,
            used_spend=spend,
        )
        return UsageRow(
            request_id=self.request_id,
            tenant_id=p.tenant_id or "",
            key_id=p.key_id,
            model=self.model,
            prompt_tokens=prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            ttft_ms=None if ttft is None else ttft * 1000,
            latency_ms=(end - self.started) * 1000,
            status=status,
            finish_reason=finish_reason,
            user=self.user,
            counted_by=self.counted_by,
            spend_nano_usd=spend,
            batch_id=self.batch[0] if self.batch else None,
            custom_id=self.batch[1] if self.batch else None,
            image_tokens=self.image_tokens,
            settlement=settlement,
        )

    def _count(self, status: int, prompt_tokens: int, end: float, error: str) -> None:
        """The finished request in the metrics, the prefix catalog and the dashboard."""
        gw, p, ttft, tpot = self.gw, self.principal, self.ttft, self.tpot
        m, tenant, model = gw.metrics, p.tenant_name, self.model
        m.child(m.requests, tenant, model, str(status)).inc()
        m.child(m.prompt_tokens, tenant, model).inc(prompt_tokens)
        m.child(m.generation_tokens, tenant, model).inc(self.completion_tokens)
        m.child(m.prefix_queries, tenant, model).inc(prompt_tokens)
        if self.cached_tokens:
            m.child(m.cached_tokens, tenant, model).inc(self.cached_tokens)
        if images := self.image_tokens:
            m.child(m.image_tokens, tenant, model).inc(images)
        if self.block_hashes and self.cached_by_prompt.get(0):
            gw.catalog.drain([self.backend])  # the blocks it hit may be just stored
            hits = self.cached_by_prompt[0]
            gw.catalog.record_hits(self.backend.name, self.block_hashes, hits)
        if ttft is not None:
            m.child(m.ttft, model).observe(ttft)
        if tpot is not None:
            m.child(m.tpot, model).observe(tpot)
        m.child(m.e2e, model).observe(end - self.started)
        done = Finished(
            time.time(), prompt_tokens, self.completion_tokens, ttft, tpot, end - self.started
        )
        gw.traffic.request_finished(p.tenant_id or "", tenant, done, ok=status == 200)
        if status >= 500:
            gw.traffic.error(tenant, self.model, status, error)
