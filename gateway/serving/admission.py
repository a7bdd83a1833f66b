"""Admission of one completion request: from a validated body to a `Job`, or an ApiError.

`prepare` checks the model, renders the prompts, compiles any structured output, plans
the tokens and takes the quota, and only then picks a replica and builds one GenRequest
per choice: a request that is refused costs its rendering and nothing else. Everything
that may refuse a request is here or in the steps it calls: the model a principal may use
(gateway.serving.model_access), the rendering (gateway.serving.rendering), the replica
(gateway.serving.placement); the Job (gateway.serving.job) streams and settles an
admitted one. `sampling` (a body's options for one choice) serves the worker's own
/v1/completions too. Embeddings (gateway.serving.embedding) are admitted with the same
pieces: `loaded`, `require_task`, `render_on_a_replica` and `admit`.

A LoRA adapter's name (gateway.routing.adapters) is a model to the client: its card, its
replicas and its rendering are its base model's (`served_model`), while the allowed
models, the price and the usage row name the adapter; each GenRequest carries it, and
the prompt's blocks are hashed under its chain root.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NoReturn

from opentelemetry.trace import Span

from engine_api.images import ImageInput
from engine_api.structured import StructuredOutput
from gateway.backends import GENERATE, Backend, GenRequest, ModelCard
from gateway.http.errors import ApiError
from gateway.observe.tracing import current_span, step
from gateway.routing.router import Candidate
from gateway.routing.salts import tenant_cache_salt
from gateway.schemas.inference import ChatCompletionRequest, CompletionRequest
from gateway.serving.echo import Echo, echoes
from gateway.serving.job import Job
from gateway.serving.model_access import adapter_ref, loaded, model_card, require_task, tenant_of
from gateway.serving.parser_choice import parsers_of
from gateway.serving.placement import place
from gateway.serving.rendering import backend_errors, render_request
from gateway.serving.request_ids import time_ordered_hex
from gateway.serving.sampling import keep_markers, sampling, structured_output
from gateway.serving.token_plan import TokenPlan, check_spend, plan_tokens
from gateway.serving.tool_calls import ToolPlan
from gateway.serving.traces import request_attributes
from gateway.state import GatewayState
from gateway.tenancy.auth import Principal
from gateway.tenancy.quota import QuotaExceeded, Reservation
from gateway.tenancy.quota.prices import Price


async def prepare(
    gw: GatewayState,
    principal: Principal,
    body: ChatCompletionRequest | CompletionRequest,
    chat: bool,
    id_prefix: str | None = None,
) -> Job:
    """Check, render, admit, and only then build one GenRequest per choice: a request that
    is refused costs its rendering and nothing else. The request's id (its answer's, its
    usage row's and x-request-id's) starts with `id_prefix`, the API's own (msg_, resp_);
    else OpenAI's for a chat or a text completion. A models directory's model is loaded
    first, and held until the request is placed on it (gateway.ondemand)."""
    async with loaded(gw, principal, body.model):
        return await _prepare(gw, principal, body, chat, id_prefix)


async def _prepare(
    gw: GatewayState,
    principal: Principal,
    body: ChatCompletionRequest | CompletionRequest,
    chat: bool,
    id_prefix: str | None,
) -> Job:
    tenant_id = tenant_of(principal)
    card = model_card(gw, principal, body.model)
    require_task(gw, principal, card, GENERATE)
    served, adapter = card.id, adapter_ref(gw, principal, body.model)
    salt = tenant_cache_salt(gw.secret, tenant_id)
    gw.catalog.note_salt(salt, tenant_id)
    candidates, renderer, prompts, images = await render_request(gw, principal, body, card)
    if body.mock_response is not None:
        _check_mock(candidates)
    echo, structured = await _compiled(gw, principal, body, renderer, served, prompts)
    price = gw.price_of(body.model)  # kept on the Job: its usage row pays this
    plan, worst = _plan(principal, body, card, prompts, chat, price)
    reservation = await admit(gw, principal, plan.reserve, plan.choices, worst)
    backend, block_hashes, shared_lens = await place(
        gw, served, candidates, renderer, prompts, salt, reservation, adapter, images
    )
    request_id = (id_prefix or ("chatcmpl-" if chat else "cmpl-")) + time_ordered_hex()
    requests = _requests(
        request_id, body, principal, plan, prompts, salt, shared_lens, structured, card, images
    )
    requests = keep_markers(requests, parsers_of(gw, backend), body)
    if adapter is not None:
        requests = [dataclasses.replace(r, model=served, adapter=adapter) for r in requests]
        gw.adapters.acquire(adapter.name)  # released when the Job finishes
    span = _started(gw, principal.tenant_name, tenant_id, chat, body.model, plan.choices)
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
        price,
        block_hashes,
        [c.backend for c in candidates if c.backend is not backend],
        tools=ToolPlan.of(body) if isinstance(body, ChatCompletionRequest) else ToolPlan(),
        echoes=echo,
        adapter=adapter.name if adapter else None,
        span=span,
    )


async def _compiled(
    gw: GatewayState,
    principal: Principal,
    body: ChatCompletionRequest | CompletionRequest,
    renderer: Backend,
    served: str,
    prompts: list[list[int]],
) -> tuple[list[Echo] | None, StructuredOutput | None]:
    """What the replica that rendered works out before admission: a completion's echo of
    its prompts, and the body's structured output compiled (its engine caches it), so a
    bad schema costs nothing; a 400 or 503 as backend_errors says."""
    echo = None
    if isinstance(body, CompletionRequest) and body.echo:
        with backend_errors(gw, principal, body.model):
            sent, with_logprobs = body.prompts(), body.logprobs is not None
            echo = await echoes(renderer, served, sent, prompts, with_logprobs)
    # a reasoning family may think before the constrained answer: its parsers say which
    structured = structured_output(body, parsers_of(gw, renderer).reasoning)
    if structured is not None:  # compiled before admission: a bad schema costs nothing
        with backend_errors(gw, principal, body.model):
            await renderer.check_structured(served, structured)
    return echo, structured


def _started(
    gw: GatewayState, tenant_name: str, tenant_id: str, chat: bool, model: str, choices: int
) -> Span | None:
    """The request started, on the dashboard; its server span (while tracing is on), with
    the request's attributes."""
    gw.traffic.request_started(tenant_id, tenant_name)
    span = current_span(gw.tracing)  # the request's server span, while tracing is on
    if span is not None:
        span.set_attributes(request_attributes(chat, model, tenant_id, choices))
    return span


def _plan(
    principal: Principal,
    body: ChatCompletionRequest | CompletionRequest,
    card: ModelCard,
    prompts: list[list[int]],
    chat: bool,
    price: Price,
) -> tuple[TokenPlan, int]:
    """The tokens to reserve and the worst-case spend (nanodollars), or a 400 for a
    request that no window of the principal's limits could ever admit."""
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
    worst = price.worst_case(prompt_tokens, plan.reserve - prompt_tokens)
    check_spend(worst, principal.limits)
    return plan, worst


def _requests(
    request_id: str,
    body: ChatCompletionRequest | CompletionRequest,
    principal: Principal,
    plan: TokenPlan,
    prompts: list[list[int]],
    salt: str,
    shared_lens: list[int],
    structured: StructuredOutput | None,
    card: ModelCard,
    images: list[ImageInput],
) -> list[GenRequest]:
    """One GenRequest per choice, prompt-major; seeds differ by choice; what the body
    leaves out of sampling takes the card's defaults; a chat's images go with each of
    its choices. A body's priority only yields: never ahead of the principal's."""
    defaults = card.sampling_defaults
    priority = principal.priority
    if body.priority is not None:
        priority = max(priority, body.priority)
    return [
        GenRequest(
            request_id if plan.choices == 1 else f"{request_id}-{i}",
            body.model,
            prompts[i // body.n],
            sampling(body, plan.max_tokens[i // body.n], i % body.n, structured, defaults),
            principal.tenant_id or "",
            salt,
            priority,
            shared_lens[i // body.n],
            weight=principal.weight,
            mock_response=body.mock_response,
            images=images,
        )
        for i in range(plan.choices)
    ]


def _check_mock(candidates: list[Candidate]) -> None:
    """A mock_response is the fake backend's output; a model served by any other backend
    would ignore it, so the request is refused by the field's name."""
    real = [c.backend.name for c in candidates if not getattr(c.backend, "takes_mock_response", 0)]
    if real:
        raise ApiError(
            400,
            f"mock_response is taken only by a fake backend; backend {real[0]!r} is not one",
            param="mock_response",
        )


async def admit(
    gw: GatewayState, principal: Principal, tokens: int, requests: int, spend: int
) -> Reservation:
    """The quota taken for `requests` requests (and as many concurrency slots), `tokens`
    tokens and `spend` nanodollars, or a 429 that says which limit."""
    tenant_id = tenant_of(principal)
    with step(gw.tracing, "kvgate.admission") as span:
        if span is not None:
            span.set_attributes({"kvgate.quota.tokens": tokens, "kvgate.quota.requests": requests})
        try:
            return await gw.quota.admit(
                tenant_id, principal.limits, tokens, time.time(), requests=requests, spend=spend
            )
        except QuotaExceeded as e:
            if span is not None:
                span.set_attribute("kvgate.quota.limit", e.kind)
            _refused(gw, principal, e)


def _refused(gw: GatewayState, principal: Principal, e: QuotaExceeded) -> NoReturn:
    """The 429 for a request over a limit, counted in the metrics and the dashboard."""
    m = gw.metrics
    m.child(m.quota_rejections, principal.tenant_name, e.kind).inc()
    gw.traffic.rejected(principal.tenant_id, principal.tenant_name)
    raise ApiError(429, str(e), code="rate_limit_exceeded", headers=e.headers()) from None
