"""Admission of one completion request: from a validated body to a `Job`, or an ApiError.

`prepare` checks the model, renders the prompts, compiles any structured output, plans
the tokens and takes the quota, and only then picks a replica and builds one GenRequest
per choice: a request that is refused costs its rendering and nothing else. Everything
that may refuse a request is here, apart from the Job (gateway.serving.job) that streams and
settles an admitted one. `model_card` (the model a principal may use) serves /tokenize
and /detokenize too, and `sampling` (a body's options for one choice) the worker's own
/v1/completions. Embeddings (gateway.serving.embedding) are admitted with the same
pieces: `tenant_of`, `require_task`, `render_on_a_replica` and `admit`.

A LoRA adapter's name (gateway.routing.adapters) is a model to the client: its card, its
replicas and its rendering are its base model's (`served_model`), while the allowed
models, the price and the usage row name the adapter; each GenRequest carries it, and
the prompt's blocks are hashed under its chain root.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import NoReturn

from engine_api.images import ImageInput
from engine_api.records import AdapterRef, PromptInput
from engine_api.structured import StructuredOutput
from gateway.backends import (
    EMBED,
    GENERATE,
    Backend,
    BackendError,
    BadRequestError,
    GenRequest,
    ModelCard,
    PrefixCachingBackend,
    is_text_bound,
)
from gateway.backends.base import ChatTemplateBackend
from gateway.backends.capabilities import supports
from gateway.http.errors import ApiError
from gateway.observe.tracing import REPLICA, current_span, step
from gateway.ondemand import DEFAULT, held
from gateway.routing.router import Candidate
from gateway.routing.salts import tenant_cache_salt
from gateway.schemas.inference import ChatCompletionRequest, CompletionRequest
from gateway.serving.echo import echoes
from gateway.serving.images import ImageLimits, chat_images
from gateway.serving.job import Job
from gateway.serving.parser_choice import parsers_of
from gateway.serving.request_ids import time_ordered_hex
from gateway.serving.sampling import keep_markers, sampling, structured_output
from gateway.serving.token_plan import TokenPlan, check_spend, plan_tokens
from gateway.serving.tool_calls import ToolPlan
from gateway.serving.traces import request_attributes
from gateway.state import GatewayState
from gateway.tenancy.auth import Principal
from gateway.tenancy.quota import QuotaExceeded, Reservation
from gateway.tenancy.quota.prices import Price

RENDERS_AT_ONCE = 32  # a request's prompts or inputs rendered concurrently, at most


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
    tenant_of(principal)  # a 404 or 403 before anything loads
    model_card(gw, principal, body.model)
    async with held(gw, served_model(gw, principal, body.model), DEFAULT):
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
    served, adapter = card.id, _adapter(gw, principal, body.model)
    salt = tenant_cache_salt(gw.secret, tenant_id)
    gw.catalog.note_salt(salt, tenant_id)
    candidates, renderer, prompts, images = await _render(gw, principal, body, card)
    if body.mock_response is not None:
        _check_mock(candidates)
    echo = None
    if isinstance(body, CompletionRequest) and body.echo:
        with _backend_errors(gw, principal, body.model):
            sent, with_logprobs = body.prompts(), body.logprobs is not None
            echo = await echoes(renderer, served, sent, prompts, with_logprobs)
    # a reasoning family may think before the constrained answer: its parsers say which
    structured = structured_output(body, parsers_of(gw, renderer).reasoning)
    if structured is not None:  # compiled before admission: a bad schema costs nothing
        # the replica that rendered compiles it (its engine caches it)
        with _backend_errors(gw, principal, body.model):
            await renderer.check_structured(served, structured)
    price = gw.price_of(body.model)  # kept on the Job: its usage row pays this
    plan, worst = _plan(principal, body, card, prompts, chat, price)
    reservation = await admit(gw, principal, plan.reserve, plan.choices, worst)
    backend, block_hashes, shared_lens = await _place(
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
    gw.traffic.request_started(tenant_id, principal.tenant_name)
    span = current_span(gw.tracing)  # the request's server span, while tracing is on
    if span is not None:
        span.set_attributes(request_attributes(chat, body.model, tenant_id, plan.choices))
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


async def _place(
    gw: GatewayState,
    model: str,
    candidates: list[Candidate],
    renderer: Backend,
    prompts: list[list[int]],
    salt: str,
    reservation: Reservation,
    adapter: AdapterRef | None = None,
    images: list[ImageInput] | None = None,
) -> tuple[Backend, list[str], list[int]]:
    """The replica to serve it, claimed until the Job finishes, with the first prompt's
    block hashes it was picked by (a chat's images keying their placeholders' blocks, as
    the engine keys them) and each prompt's published prefix length. If picking fails,
    the admitted quota is given back."""
    try:
        with step(gw.tracing, "kvgate.route") as span:
            # a published prefix's length per prompt: its blocks are hashed without the salt
            shared_lens = [gw.pins.shared_prefix_len(model, p) for p in prompts]
            block_hashes = []
            if supports(renderer, PrefixCachingBackend):
                # only a vision model's replica (it took the images) is handed them
                by_image = {"images": images} if images else {}
                block_hashes = renderer.block_hashes(
                    prompts[0], salt, shared_lens[0], adapter, **by_image
                )
            name = adapter.name if adapter else None
            backend, why = gw.router.pick_why(candidates, block_hashes, name)
            gw.router.claim(backend)  # released when the Job finishes
            if span is not None:
                span.set_attributes(
                    {
                        REPLICA: backend.name,
                        "kvgate.route.reason": why,
                        "kvgate.route.policy": gw.router.policy,
                        "kvgate.route.candidates": len(candidates),
                        "kvgate.route.prompt_blocks": len(block_hashes),
                    }
                )
    except BaseException:
        await gw.quota.settle(reservation, 0, count_request=False)
        raise
    return backend, block_hashes, shared_lens


async def _render(
    gw: GatewayState,
    principal: Principal,
    body: ChatCompletionRequest | CompletionRequest,
    card: ModelCard,
) -> tuple[list[Candidate], Backend, list[list[int]], list[ImageInput]]:
    """The healthy replicas, the token ids of every prompt from the first of them that
    can render them (every replica of a model has its tokenizer, and for a remote
    replica rendering is a network call: one that just died must not fail the request
    while another is healthy), and a chat's images in prompt order, decoded first."""
    tools = kwargs = None
    images: list[ImageInput] = []
    if isinstance(body, ChatCompletionRequest):
        chat, images = await chat_images(
            ImageLimits.of(gw.settings),
            card,
            [m.as_dict() for m in body.messages],
            gw.router.serving,
        )
        inputs: list = [chat]
        if body.tool_mode != "none":  # tool_choice "none": the tools are not shown
            tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        kwargs = body.chat_template_kwargs
    else:
        inputs = body.prompts()
    rendered = await render_on_a_replica(gw, principal, body.model, inputs, tools, kwargs)
    return (*rendered, images)


async def render_on_a_replica(
    gw: GatewayState,
    principal: Principal,
    model: str,
    inputs: list[PromptInput],
    tools: list[dict] | None = None,
    kwargs: dict | None = None,
) -> tuple[list[Candidate], Backend, list[list[int]]]:
    """The healthy replicas of `model`, and the token ids of every input from the first
    of them that can render them all (with the chat template's variables `kwargs`, where
    its template is the gateway's to render); a 400 or 503 for the client as
    _backend_errors says."""
    model = served_model(gw, principal, model)
    async with held(gw, model):  # loaded, if it is a models directory's
        return await _render_on_one(gw, principal, model, inputs, tools, kwargs)


async def _render_on_one(
    gw: GatewayState,
    principal: Principal,
    model: str,
    inputs: list[PromptInput],
    tools: list[dict] | None,
    kwargs: dict | None,
) -> tuple[list[Candidate], Backend, list[list[int]]]:
    with _backend_errors(gw, principal, model):
        candidates = gw.router.candidates(model)  # each replica's stats, read once
        for candidate in candidates[:-1]:
            with contextlib.suppress(BackendError):
                backend = candidate.backend
                rendered = await _render_all(backend, model, inputs, tools, kwargs)
                return candidates, backend, rendered
        last = candidates[-1].backend  # its error, if it fails too, is the client's answer
        return candidates, last, await _render_all(last, model, inputs, tools, kwargs)


async def rendered_tokens(
    gw: GatewayState,
    principal: Principal,
    model: str,
    prompt: PromptInput,
    tools: list[dict] | None = None,
    kwargs: dict | None = None,
) -> list[int]:
    """The prompt's tokens as a replica of `model` renders it (with the chat template's
    variables `kwargs`), for the routes that count and bill nothing (/tokenize,
    Anthropic's count_tokens), its images' placeholders among them; a 400 where the
    upstream does not tokenize for the gateway (its rendering is the prompt's bytes, a
    bound)."""
    card = model_card(gw, principal, model)
    limits = ImageLimits.of(gw.settings)
    prompt, _ = await chat_images(limits, card, prompt, gw.router.serving)
    _, backend, [tokens] = await render_on_a_replica(gw, principal, model, [prompt], tools, kwargs)
    if is_text_bound(backend, tokens):
        raise ApiError(400, f"The upstream of model `{model}` does not tokenize for the gateway.")
    return tokens


async def _render_all(
    backend: Backend,
    model: str,
    inputs: list[PromptInput],
    tools: list[dict] | None,
    kwargs: dict | None = None,
) -> list[list[int]]:
    """Every input's ids, RENDERS_AT_ONCE at a time: for a remote replica each is a
    /tokenize call (an embedding request may hold 2048 inputs), and one by one their
    round trips would add up. The first failure cancels the rest."""
    if kwargs and supports(backend, ChatTemplateBackend):
        return [await backend.render_chat(model, p, tools, kwargs) for p in inputs]  # one chat
    if len(inputs) == 1:
        return [await backend.render(model, inputs[0], tools)]
    limit = asyncio.Semaphore(RENDERS_AT_ONCE)

    async def one(prompt: PromptInput) -> list[int]:
        async with limit:
            return await backend.render(model, prompt, tools)

    tasks = [asyncio.ensure_future(one(p)) for p in inputs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


@contextlib.contextmanager
def _backend_errors(gw: GatewayState, principal: Principal, model: str) -> Iterator[None]:
    """A backend's refusal of the request is the client's 400; a backend that failed is
    a 503, noted in the dashboard's error log."""
    try:
        yield
    except BadRequestError as e:
        raise ApiError(400, str(e)) from None
    except BackendError as e:
        gw.traffic.error(principal.tenant_name, model, 503, str(e))
        raise ApiError(503, str(e), code="backend_unavailable") from None


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


def model_card(gw: GatewayState, principal: Principal, model: str) -> ModelCard:
    """The model's card (an adapter's: its base model's), if it exists for the principal's
    tenant and it may use it; else a 404 or 403 that says what it may use. Another
    tenant's adapter is as unknown as a model that does not exist."""
    card = gw.router.card(served_model(gw, principal, model))
    if card is None:
        # name what this tenant can use instead (GET /v1/models lists the same)
        adapters = [a.name for a in gw.adapters.usable(principal.tenant_id)]
        names = [*gw.router.cards, *adapters]
        usable = ", ".join(m for m in names if principal.may_use(m)) or "none"
        raise ApiError(
            404, f"The model `{model}` does not exist. Available: {usable}.", code="model_not_found"
        )
    if not principal.may_use(model):
        raise ApiError(
            403, f"Your tenant may not use the model `{model}`.", code="model_not_allowed"
        )
    return card


def served_model(gw: GatewayState, principal: Principal, model: str) -> str:
    """The model whose replicas serve `model`: an adapter's base model, else itself."""
    adapter = gw.adapters.visible(model, principal.tenant_id)
    return adapter.base_model if adapter else model


def _adapter(gw: GatewayState, principal: Principal, model: str) -> AdapterRef | None:
    adapter = gw.adapters.visible(model, principal.tenant_id)
    return adapter.ref if adapter else None


def tenant_of(principal: Principal) -> str:
    """The tenant a request is served for; a 403 for an admin key, which has none."""
    if principal.tenant_id is None:
        raise ApiError(403, "Admin keys belong to no tenant; use a tenant's key for inference.")
    return principal.tenant_id


_TASKS = {
    GENERATE: "generates text (/v1/chat/completions, /v1/completions)",
    EMBED: "is an embedding model (/v1/embeddings)",
}


def require_task(gw: GatewayState, principal: Principal, card: ModelCard, task: str) -> None:
    """A 400 for a model asked to do what it does not (a chat model asked for embeddings,
    an embedding model for a completion) that says what it does, and which models do
    what was asked."""
    if card.task == task:
        return
    others = [c.id for c in gw.router.cards.values() if c.task == task and principal.may_use(c.id)]
    raise ApiError(
        400,
        f"The model `{card.id}` {_TASKS[card.task]}; it cannot serve this request. "
        f"Models that can: {', '.join(others) or 'none'}.",
        code="wrong_model_task",
        param="model",
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
