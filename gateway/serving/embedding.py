"""One /v1/embeddings request, from its validated body to its vectors and usage row.

An embedding request is admitted as a completion is (gateway.serving.admission): the
model must be one the tenant may use and one that embeds; every input is rendered on a
replica and held to the model's context; the quota takes one request, one concurrency
slot and the inputs' tokens (and their worst-case spend at the model's input price)
before any engine work; then a replica embeds them (through the gateway's fair queue
where it keeps one), trying the next healthy one if it fails. There is no output, so the
usage row has no completion tokens; it is committed before the answer goes out, and the
reservation is settled on every path, a failure or a client that left included. A client
that hangs up pays for the inputs the replica had pooled by then (their tokens, as its
Progress says: a request of hundreds of inputs is computed over many steps); a failure
pays nothing.

The tokens billed are the gateway's own count of what it rendered (what it reserved and
checked). A backend's own count (a remote upstream's `usage.prompt_tokens`) is a claim,
taken only where the gateway can hold it: no more than its count, at least one token an
input, and within 10% (and 2 tokens) of it, as gateway.serving.metering takes a claim of
output; otherwise the row says the gateway counted. For an upstream the gateway cannot
tokenize for (gateway.backends.remote_text) the inputs are text-bound: their length is
an upper bound, reserved as such, not held to the context (the upstream refuses an input
too long), and settled by the upstream's claim anywhere within the bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from gateway.backends import (
    EMBED,
    Backend,
    BackendError,
    BadRequestError,
    EmbeddingBackend,
    EmbedRequest,
    EmbedResult,
    Progress,
    is_text_bound,
)
from gateway.backends.capabilities import supports
from gateway.http.errors import ApiError
from gateway.observe.stats import Finished
from gateway.observe.tracing import step
from gateway.schemas.embeddings import EmbeddingRequest
from gateway.serving.admission import admit
from gateway.serving.embedding_answer import check_dimensions
from gateway.serving.model_access import loaded, model_card, require_task, tenant_of
from gateway.serving.outcome import CLIENT_GONE
from gateway.serving.rendering import render_on_a_replica
from gateway.serving.request_ids import time_ordered_hex
from gateway.serving.token_plan import EMBED_COST, check_input_tokens, check_spend
from gateway.serving.traces import embedding_attributes
from gateway.state import GatewayState
from gateway.tenancy.auth import Principal
from gateway.tenancy.quota import Reservation
from gateway.tenancy.quota.limits import ratelimit_headers
from gateway.tenancy.quota.prices import Price
from gateway.tenancy.usage import UsageRow

log = logging.getLogger("kvgate")


@dataclass
class Embedded:
    """An answered request: its vectors, in input order, and what was billed."""

    request_id: str
    model: str
    vectors: list[list[float]]
    prompt_tokens: int
    headers: dict[str, str]


async def embed(
    gw: GatewayState,
    principal: Principal,
    body: EmbeddingRequest,
    batch: tuple[str, str] | None = None,
    price: Price | None = None,
) -> Embedded:
    """Admit, embed, record; an ApiError for any refusal or failure (nothing is taken
    for a refused request, and a failed one settles what it took). A Batch API line's
    (`batch`: its batch id and custom_id) is priced at `price`, the batch price. A models
    directory's model is loaded first and held to the end (gateway.ondemand)."""
    async with loaded(gw, principal, body.model):
        return await _embed(gw, principal, body, batch, price)


async def _embed(
    gw: GatewayState,
    principal: Principal,
    body: EmbeddingRequest,
    batch: tuple[str, str] | None,
    price: Price | None,
) -> Embedded:
    tenant_of(principal)
    card = model_card(gw, principal, body.model)
    require_task(gw, principal, card, EMBED)
    check_dimensions(card, body.dimensions)
    inputs = body.inputs()
    candidates, renderer, rendered = await render_on_a_replica(gw, principal, body.model, inputs)
    bound = any(is_text_bound(renderer, r) for r in rendered)
    context = None if bound else card.context_length
    tokens = check_input_tokens([len(r) for r in rendered], context, principal.limits)
    price = price or gw.settings.price_of(body.model)
    worst = price.worst_case(tokens, 0)
    check_spend(worst, principal.limits, EMBED_COST)
    reservation = await admit(gw, principal, tokens, 1, worst)
    call = _Call(gw, principal, body.model, reservation, tokens, bound, body.user, price, batch)
    req = EmbedRequest(
        call.request_id,
        body.model,
        rendered,
        principal.tenant_id or "",
        body.dimensions,
        body.texts(),
    )
    # no prefix to route by: the least loaded replica first, the others after it
    first = gw.router.pick_from(candidates, [])
    order = [first, *(c.backend for c in candidates if c.backend is not first)]
    with step(gw.tracing, "embeddings " + body.model) as span:
        if span is not None:
            span.set_attributes(embedding_attributes(req, tokens))
        return await call.run(order, req)


@dataclass
class _Call:
    """An admitted request: the replica call, its retries and how it ends."""

    gw: GatewayState
    principal: Principal
    model: str
    reservation: Reservation
    tokens: int  # the gateway's count of the rendered inputs: what it reserved
    bound: bool  # `tokens` is an upper bound (text-bound inputs), not a count
    user: str | None
    price: Price
    batch: tuple[str, str] | None  # a Batch API line's (batch id, custom_id)
    request_id: str = field(default_factory=lambda: "embd-" + time_ordered_hex())
    started: float = field(default_factory=time.perf_counter)
    counted_by: str = "engine"
    # the tokens of the inputs the replica called last has pooled (it fills this): what
    # a client that hangs up pays for
    progress: Progress = field(default_factory=Progress)

    async def run(self, order: list[Backend], req: EmbedRequest) -> Embedded:
        p = self.principal
        self.gw.traffic.request_started(p.tenant_id or "", p.tenant_name)
        try:
            result = await self._on_replicas(order, req)
            vectors = _checked(result, req)
        except CLIENT_GONE:
            pooled = min(self.progress.tokens, self.tokens)
            await asyncio.shield(self._finish(499, pooled, "the client went away"))
            raise
        except BadRequestError as e:
            await asyncio.shield(self._finish(400, 0, str(e)))
            raise ApiError(400, str(e)) from None
        except Exception as e:
            message = str(e) if isinstance(e, BackendError) else self._unexpected()
            await asyncio.shield(self._finish(503, 0, message))
            raise ApiError(503, message, code="backend_unavailable") from None
        billed = self._billed(result.prompt_tokens, len(req.inputs))
        await asyncio.shield(self._finish(200, billed, ""))
        r = self.reservation
        headers = ratelimit_headers(r.limits, r.remaining, r.windows)
        headers["x-request-id"] = self.request_id
        return Embedded(self.request_id, self.model, vectors, billed, headers)

    def _unexpected(self) -> str:
        log.exception("request %s failed", self.request_id)
        return f"the backend of model {self.model!r} failed (request {self.request_id})"

    async def _on_replicas(self, order: list[Backend], req: EmbedRequest) -> EmbedResult:
        """The first replica's answer; a replica that fails (BackendError) hands the
        request to the next, as a completion's does before any output went out."""
        router = self.gw.router
        for i, backend in enumerate(order):
            if not supports(backend, EmbeddingBackend):
                raise BackendError(f"the backend of model {self.model!r} cannot embed")
            router.claim(backend)
            self.progress = Progress()  # a replica that failed is not billed
            try:
                return await self._embed_on(backend, req)
            except BackendError as e:
                if i == len(order) - 1:
                    raise
                log.warning(
                    "request %s: %s failed (%s); retrying on %s",
                    *(self.request_id, backend.name, e, order[i + 1].name),
                )
            finally:
                router.release(backend)
        raise AssertionError("no replica")  # order is never empty

    async def _embed_on(self, backend: EmbeddingBackend, req: EmbedRequest) -> EmbedResult:
        """Through the gateway's fair queue where the backend has one (its scheduler is
        not kvgate's), charged the inputs' tokens: the service the tenant is given."""
        queue = self.gw.queues.get(backend.name)
        if queue is None:
            return await backend.embed(req, self.progress)
        tenant = req.tenant_id
        async with queue.slot(tenant, self.principal.weight, self.principal.priority):
            queue.charge(tenant, self.tokens)
            return await backend.embed(req, self.progress)

    def _billed(self, claimed: int, inputs: int) -> int:
        """The backend's count where it agrees with the gateway's; else the gateway's."""
        own = self.tokens
        if not isinstance(claimed, int) or isinstance(claimed, bool):
            why = f"prompt_tokens {claimed!r} is not an integer"
        elif not inputs <= claimed <= own:
            why = f"prompt_tokens {claimed} outside [{inputs} inputs, {own} counted]"
        elif not self.bound and own - claimed > max(2, own // 10):
            why = f"prompt_tokens {claimed}, counted {own}"
        else:
            return claimed
        log.warning("request %s: the backend's usage is not taken: %s", self.request_id, why)
        self.counted_by = "gateway"
        return own

    async def _finish(self, status: int, tokens: int, error: str) -> None:
        """The usage row (committed before the answer goes out), the settlement that
        rides on it, metrics and the dashboard; a 503 if the row cannot be committed."""
        gw, p = self.gw, self.principal
        end = time.perf_counter()
        spend = self.price.spend(tokens, 0, 0)
        counted = status != 503 and self.batch is None  # a batch line is no request of rpm's
        settlement = gw.quota.settlement(
            self.reservation, tokens, count_request=counted, used_spend=spend
        )
        row = UsageRow(
            request_id=self.request_id,
            tenant_id=p.tenant_id or "",
            key_id=p.key_id,
            model=self.model,
            prompt_tokens=tokens,
            completion_tokens=0,
            cached_tokens=0,
            ttft_ms=None,
            latency_ms=(end - self.started) * 1000,
            status=status,
            finish_reason=None,
            user=self.user,
            counted_by=self.counted_by,
            spend_nano_usd=spend,
            batch_id=self.batch[0] if self.batch else None,
            custom_id=self.batch[1] if self.batch else None,
            settlement=settlement,
        )
        try:
            await gw.usage.submit(row)
            gw.metrics.billed(p.tenant_name, self.model, spend)
        except Exception:  # the database's words stay in the log: they may name others
            log.exception("usage row of %s not committed", self.request_id)
            if status == 200:
                raise ApiError(
                    503,
                    f"Usage could not be recorded, so request {self.request_id} was not "
                    "completed. Please retry.",
                    code="usage_unavailable",
                ) from None
        finally:
            self._count(status, tokens, end, error)

    def _count(self, status: int, tokens: int, end: float, error: str) -> None:
        gw, tenant = self.gw, self.principal.tenant_name
        m, e2e = gw.metrics, end - self.started
        m.child(m.requests, tenant, self.model, str(status)).inc()
        m.child(m.prompt_tokens, tenant, self.model).inc(tokens)
        m.child(m.e2e, self.model).observe(e2e)
        done = Finished(time.time(), tokens, 0, None, None, e2e)
        tenant_id = self.principal.tenant_id or ""
        gw.traffic.request_finished(tenant_id, tenant, done, ok=status == 200)
        if status >= 500:
            gw.traffic.error(tenant, self.model, status, error)


def _checked(result: EmbedResult, req: EmbedRequest) -> list[list[float]]:
    """The vectors, if there is one per input, each of one size (`dimensions` where
    asked); a BackendError (503) for a backend that answered something else."""
    vectors = result.embeddings
    sizes = {len(v) for v in vectors}
    wrong = len(vectors) != len(req.inputs) or len(sizes) != 1
    if not wrong and req.dimensions is not None:
        wrong = sizes != {req.dimensions}
    if wrong:
        raise BackendError(
            f"the backend of model {req.model!r} answered vectors that do not fit the request"
        )
    return vectors
