"""One completion request from admission to its usage row.

`prepare` turns a validated body into a `Job` (model, backend, prompt token ids,
a quota reservation) or raises an ApiError; `Job.events` streams the backend's
chunks for every choice; `Job.finish` commits the usage row, settles the quota and
updates metrics. The HTTP layer (openai_api) only formats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine_api.structured import StructuredOutput
from gateway.auth import Principal
from gateway.backends import (
    Backend,
    BackendError,
    BadRequestError,
    GenChunk,
    GenRequest,
    ModelCard,
    PrefixCachingBackend,
    SamplingParams,
)
from gateway.errors import ApiError
from gateway.fair_queue import CACHED_TOKEN_COST, FairQueue
from gateway.prefix import tenant_cache_salt
from gateway.quota import QuotaExceeded, Reservation
from gateway.quota.limits import ratelimit_headers
from gateway.quota.prices import FREE
from gateway.router import Candidate
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.state import GatewayState
from gateway.stats import Finished
from gateway.token_plan import TokenPlan, plan_tokens
from gateway.tool_calls import ToolPlan
from gateway.usage import UsageRow

log = logging.getLogger("kvgate")


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
    counted_by: str = "engine"  # "gateway" if any choice's upstream sent no usage
    finished: bool = False
    tools: ToolPlan = field(default_factory=ToolPlan)  # chat: the calls a reply may make

    @property
    def num_choices(self) -> int:
        return len(self.requests)

    @property
    def prompt_tokens(self) -> int:
        # A prompt counts once however many choices it has (as OpenAI counts it).
        return sum(len(r.prompt_token_ids) for r in self.requests[:: self.n])

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached_by_prompt.values())

    def headers(self) -> dict[str, str]:
        r = self.reservation
        return ratelimit_headers(r.limits, r.remaining, r.windows) | {
            "x-request-id": self.request_id
        }

    async def events(self) -> AsyncIterator[tuple[int, GenChunk]]:
        while True:
            try:
                async for item in self._attempt():
                    yield item
                return
            except BackendError as e:
                if self.counted or not self.fallbacks:
                    raise  # output went out, or no replica is left: the client hears
                failed, self.backend = self.backend, self.fallbacks.pop(0)
                self.gw.router.release(failed)
                self.gw.router.claim(self.backend)
                log.warning(
                    "request %s: %s failed before any output (%s); retrying on %s",
                    *(self.request_id, failed.name, e, self.backend.name),
                )

    def _generate(self, req: GenRequest) -> AsyncIterator[GenChunk]:
        """The backend's stream for one choice; through the gateway's fair queue when the
        backend has one (its scheduler is not kvgate's)."""
        queue = self.gw.queues.get(self.backend.name)
        if queue is None:
            return self.backend.generate(req)
        return _queued(queue, self.backend, req)

    async def _attempt(self) -> AsyncIterator[tuple[int, GenChunk]]:
        if len(self.requests) == 1:  # the common case, one generator layer less
            gen = self._generate(self.requests[0])
            try:
                async for chunk in gen:
                    self._account(0, chunk)
                    yield 0, chunk
            finally:
                await gen.aclose()
            return
        stream = _merged([self._generate(r) for r in self.requests])
        try:
            async for index, chunk in stream:
                self._account(index, chunk)
                yield index, chunk
        finally:
            await stream.aclose()

    def _account(self, index: int, chunk: GenChunk) -> None:
        counted = self.counted.get(index, 0)
        prompt = 0
        if chunk.token_ids or chunk.text:
            now = time.perf_counter()
            if self.first_token_at is None:
                self.first_token_at = now
                prompt = self.prompt_tokens  # its prefill is done
            self.last_token_at = now
        tokens = counted + len(chunk.token_ids)
        if chunk.usage is not None:
            # the engine's own count is the record (a remote upstream may not send ids)
            tokens = chunk.usage.completion_tokens
            if chunk.usage.counted_by != "engine":
                self.counted_by = chunk.usage.counted_by
            self.cached_by_prompt.setdefault(index // self.n, chunk.usage.cached_tokens)
        delta = tokens - counted
        self.completion_tokens += delta
        self.counted[index] = tokens
        if prompt or delta:  # the dashboard's rates move while it streams
            p = self.principal
            self.gw.traffic.tokens_streamed(p.tenant_id or "", p.tenant_name, prompt, delta)

    async def finish(self, status: int, finish_reason: str | None, error: str = "") -> None:
        """Commit the usage row, then settle quota and count. Safe to call once."""
        assert not self.finished
        self.finished = True
        gw, p = self.gw, self.principal
        gw.router.release(self.backend)
        end = time.perf_counter()
        ttft = None if self.first_token_at is None else self.first_token_at - self.started
        tpot = None
        if self.first_token_at is not None and self.completion_tokens > self.num_choices:
            tpot = (self.last_token_at - self.first_token_at) / (
                self.completion_tokens - self.num_choices
            )
        prompt_tokens = self.prompt_tokens if self.first_token_at or status == 200 else 0
        price = gw.settings.prices.get(self.model, FREE)
        spend = price.spend(prompt_tokens, self.cached_tokens, self.completion_tokens)
        # settled with the row: in memory at once, on PostgreSQL in the row's commit
        settlement = gw.quota.settlement(
            self.reservation,
            prompt_tokens + self.completion_tokens,
            count_request=status not in (503,),
            used_spend=spend,
        )
        row = UsageRow(
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
            settlement=settlement,
        )
        try:
            # Shielded: a client that goes away must not lose the row.
            await asyncio.shield(gw.usage.submit(row))
        finally:
            m, tenant, model = gw.metrics, p.tenant_name, self.model
            m.child(m.requests, tenant, model, str(status)).inc()
            m.child(m.prompt_tokens, tenant, model).inc(prompt_tokens)
            m.child(m.generation_tokens, tenant, model).inc(self.completion_tokens)
            m.child(m.prefix_queries, tenant, model).inc(prompt_tokens)
            if self.cached_tokens:
                m.child(m.cached_tokens, tenant, model).inc(self.cached_tokens)
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


async def prepare(
    gw: GatewayState,
    principal: Principal,
    body: ChatCompletionRequest | CompletionRequest,
    chat: bool,
) -> Job:
    """Check, render, admit, and only then build one GenRequest per choice: a request that
    is refused costs its rendering and nothing else."""
    if principal.tenant_id is None:
        raise ApiError(403, "Admin keys belong to no tenant; use a tenant's key for inference.")
    card = _card(gw, principal, body.model)
    salt = tenant_cache_salt(gw.secret, principal.tenant_id)
    gw.catalog.note_salt(salt, principal.tenant_id)
    candidates, renderer, prompts = await _render(gw, principal, body)
    structured = structured_output(body)
    if structured is not None:  # compiled before admission: a bad schema costs nothing
        await _check_structured(gw, principal, renderer, body.model, structured)
    plan = plan_tokens(
        prompts,
        body.n,
        body.max_tokens,
        card.context_length,
        principal.limits,
        "messages" if chat else "prompt",
        body.min_tokens,
    )
    # the worst case: no prompt token cached, every choice generating all its max_tokens
    prompt_tokens = sum(len(p) for p in prompts)
    price = gw.settings.prices.get(body.model, FREE)
    worst = price.worst_case(prompt_tokens, plan.reserve - prompt_tokens)
    reservation = await _admit(gw, principal, plan, worst)
    try:
        # a published prefix's length per prompt: its blocks are hashed without the salt
        shared_lens = [gw.pins.shared_prefix_len(body.model, p) for p in prompts]
        block_hashes = []
        if isinstance(renderer, PrefixCachingBackend):
            block_hashes = renderer.block_hashes(prompts[0], salt, shared_lens[0])
        backend = gw.router.pick_from(candidates, block_hashes)
        gw.router.claim(backend)  # released when the Job finishes
    except BaseException:
        await gw.quota.settle(reservation, 0, count_request=False)
        raise
    request_id = ("chatcmpl-" if chat else "cmpl-") + os.urandom(12).hex()
    requests = _requests(request_id, body, principal, plan, prompts, salt, shared_lens)
    gw.traffic.request_started(principal.tenant_id, principal.tenant_name)
    return Job(
        gw,
        principal,
        chat,
        body.model,
        backend,
        request_id,
        int(time.time()),
        requests,
        body.n,
        reservation,
        body.user,
        block_hashes,
        [c.backend for c in candidates if c.backend is not backend],
        tools=ToolPlan.of(body) if isinstance(body, ChatCompletionRequest) else ToolPlan(),
    )


async def _render(
    gw: GatewayState, principal: Principal, body: ChatCompletionRequest | CompletionRequest
) -> tuple[list[Candidate], Backend, list[list[int]]]:
    """The healthy replicas, and the token ids of every prompt from the first of them
    that can render them: every replica of a model has its tokenizer, and for a remote
    replica rendering is a network call: one that just died must not fail the request
    while another is healthy."""
    tools = None
    if isinstance(body, ChatCompletionRequest):
        inputs: list = [[m.as_dict() for m in body.messages]]
        if body.tool_mode != "none":  # tool_choice "none": the tools are not shown
            tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    else:
        inputs = body.prompts()
    try:
        candidates = gw.router.candidates(body.model)  # each replica's stats, read once
        for candidate in candidates[:-1]:
            with contextlib.suppress(BackendError):
                backend = candidate.backend
                prompts = [await backend.render(body.model, p, tools) for p in inputs]
                return candidates, candidate.backend, prompts
        last = candidates[-1].backend  # its error, if it fails too, is the client's answer
        return candidates, last, [await last.render(body.model, p, tools) for p in inputs]
    except BadRequestError as e:
        raise ApiError(400, str(e)) from None
    except BackendError as e:
        gw.traffic.error(principal.tenant_name, body.model, 503, str(e))
        raise ApiError(503, str(e), code="backend_unavailable") from None


def _requests(
    request_id: str,
    body: ChatCompletionRequest | CompletionRequest,
    principal: Principal,
    plan: TokenPlan,
    prompts: list[list[int]],
    salt: str,
    shared_lens: list[int],
) -> list[GenRequest]:
    """One GenRequest per choice, prompt-major; seeds differ by choice."""
    return [
        GenRequest(
            request_id if plan.choices == 1 else f"{request_id}-{i}",
            body.model,
            prompts[i // body.n],
            _sampling(body, plan.max_tokens[i // body.n], i % body.n),
            principal.tenant_id or "",
            salt,
            principal.priority,
            shared_lens[i // body.n],
            weight=principal.weight,
        )
        for i in range(plan.choices)
    ]


def structured_output(body: ChatCompletionRequest | CompletionRequest) -> StructuredOutput | None:
    """What the output must match: a forced tool call's schema, or the body's own
    structured output (the schema refuses both at once)."""
    if isinstance(body, ChatCompletionRequest) and body.forced_tools:
        return ToolPlan.of(body).constraint()
    return body.structured()


async def _check_structured(
    gw: GatewayState,
    principal: Principal,
    backend: Backend,
    model: str,
    structured: StructuredOutput,
) -> None:
    """The replica that rendered compiles the constraint (its engine caches it): a 400
    naming what its grammar engine cannot compile comes before any quota is taken."""
    try:
        await backend.check_structured(model, structured)
    except BadRequestError as e:
        raise ApiError(400, str(e)) from None
    except BackendError as e:
        gw.traffic.error(principal.tenant_name, model, 503, str(e))
        raise ApiError(503, str(e), code="backend_unavailable") from None


def _card(gw: GatewayState, principal: Principal, model: str) -> ModelCard:
    card = gw.router.card(model)
    if card is None:
        # name what this tenant can use instead (GET /v1/models lists the same)
        usable = ", ".join(m for m in gw.router.cards if principal.may_use(m)) or "none"
        raise ApiError(
            404, f"The model `{model}` does not exist. Available: {usable}.", code="model_not_found"
        )
    if not principal.may_use(model):
        raise ApiError(
            403, f"Your tenant may not use the model `{model}`.", code="model_not_allowed"
        )
    return card


async def _admit(
    gw: GatewayState, principal: Principal, plan: TokenPlan, spend: int
) -> Reservation:
    assert principal.tenant_id is not None
    try:
        return await gw.quota.admit(
            principal.tenant_id,
            principal.limits,
            plan.reserve,
            time.time(),
            requests=plan.choices,
            spend=spend,
        )
    except QuotaExceeded as e:
        m = gw.metrics
        m.child(m.quota_rejections, principal.tenant_name, e.kind).inc()
        gw.traffic.rejected(principal.tenant_id, principal.tenant_name)
        raise ApiError(429, str(e), code="rate_limit_exceeded", headers=e.headers()) from None


def _sampling(
    body: ChatCompletionRequest | CompletionRequest, max_tokens: int, choice: int
) -> SamplingParams:
    return SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=body.stop or [],
        stop_token_ids=body.stop_token_ids or [],
        seed=None if body.seed is None else body.seed + choice,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logprobs=body.num_logprobs,
        ignore_eos=body.ignore_eos,
        structured=structured_output(body),
    )


async def _queued(queue: FairQueue, backend: Backend, req: GenRequest) -> AsyncIterator[GenChunk]:
    """Wait for a slot in line with the tenant's other requests, then stream, charging
    the tenant for the service as it is given."""
    tenant = req.tenant_id
    async with queue.slot(tenant, req.weight):
        queue.charge(tenant, len(req.prompt_token_ids))
        charged = 0
        gen = backend.generate(req)
        try:
            async for chunk in gen:
                out = len(chunk.token_ids)
                if chunk.usage is not None:  # the backend's own count (an upstream's)
                    out = chunk.usage.completion_tokens - charged
                    discount = (1 - CACHED_TOKEN_COST) * chunk.usage.cached_tokens
                    queue.charge(tenant, -discount)
                queue.charge(tenant, out)
                charged += out
                yield chunk
        finally:
            await gen.aclose()


_DONE = object()


async def _merged(gens: list[AsyncIterator[GenChunk]]) -> AsyncIterator[tuple[int, GenChunk]]:
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
