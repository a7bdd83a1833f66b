"""A request's prompts as token ids, rendered on one of its model's healthy replicas.

Apart from admission because rendering has callers that admit nothing (/tokenize,
Anthropic's count_tokens: `rendered_tokens`) and one that admits otherwise (embeddings:
`render_on_a_replica`), and because it is a replica's work with a replica's failures: the
first replica that renders them all serves, and `backend_errors` says what a refusal or a
failure is to the client (admission's own calls to the replica that rendered use it too).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from engine_api.images import ImageInput
from engine_api.records import PromptInput
from gateway.backends import (
    Backend,
    BackendError,
    BadRequestError,
    ModelCard,
    is_text_bound,
)
from gateway.backends.base import ChatTemplateBackend
from gateway.backends.capabilities import supports
from gateway.http.errors import ApiError
from gateway.ondemand import held
from gateway.routing.router import Candidate
from gateway.schemas.inference import ChatCompletionRequest, CompletionRequest
from gateway.serving.images import ImageLimits, chat_images
from gateway.serving.model_access import model_card, served_model
from gateway.state import GatewayState
from gateway.tenancy.auth import Principal

RENDERS_AT_ONCE = 32  # a request's prompts or inputs rendered concurrently, at most


async def render_request(
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
    backend_errors says."""
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
    with backend_errors(gw, principal, model):
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
def backend_errors(gw: GatewayState, principal: Principal, model: str) -> Iterator[None]:
    """A backend's refusal of the request is the client's 400; a backend that failed is
    a 503, noted in the dashboard's error log."""
    try:
        yield
    except BadRequestError as e:
        raise ApiError(400, str(e)) from None
    except BackendError as e:
        gw.traffic.error(principal.tenant_name, model, 503, str(e))
        raise ApiError(503, str(e), code="backend_unavailable") from None
