"""The worker's aiohttp application: its routes, the worker token, start-up and shutdown.

Routes (the contract with the gateway's `remote` adapter):
GET /health, GET /ready (503 while draining), GET /v1/models, POST /tokenize,
POST /detokenize, POST /v1/completions, POST /v1/embeddings (an embedding model's),
POST /kvgate/v1/generate, POST /kvgate/v1/abort (stop one of those, or an embedding
request, and hear what it computed: generate.py),
GET /kvgate/v1/stats, GET /kvgate/v1/kv_events, POST /kvgate/v1/kv/export (a prefill
worker's blocks of a prompt, for a decode worker: kv_export.py),
POST /kvgate/v1/adapters/check and DELETE /kvgate/v1/adapters/{name} (LoRA: adapters.py).
Every route but /health and /ready needs `Authorization: Bearer <worker token>` when
the worker has one; errors leave OpenAI-shaped, as the gateway's do.
"""

from __future__ import annotations

import dataclasses
import hmac

from aiohttp import web

from engine_api.errors import BackendError, BadRequestError
from gateway.backends.base import ChatTemplateBackend
from gateway.backends.capabilities import supports
from gateway.backends.remote_images import IMAGE_RECORD_BYTES, placed
from gateway.config import Settings
from gateway.http.drain import DRAIN, drain_guard
from gateway.http.errors import ApiError
from gateway.http.middleware import openai_errors
from gateway.http.traced import traced_requests
from gateway.http.util import SETTINGS, json_response, parse_body
from gateway.schemas.inference import DetokenizeRequest
from gateway.schemas.openai_format import model_entry
from gateway.worker import adapters
from gateway.worker.completions import completions
from gateway.worker.embeddings import embeddings
from gateway.worker.errors import api_error
from gateway.worker.generate import abort, generate, wire_images
from gateway.worker.kv_export import export_kv
from gateway.worker.kv_pull import EXPORT_PATH
from gateway.worker.schemas import WorkerTokenizeRequest
from gateway.worker.state import WORKER, WorkerState

MAX_WAIT_S = 30.0  # the longest long poll of /kvgate/v1/kv_events
# probes, stats and the KV events' long polls: frequent, and noise in a trace store
UNTRACED = frozenset(
    {"/health", "/ready", "/v1/models", "/kvgate/v1/stats", "/kvgate/v1/kv_events"}
)
OPEN_PATHS = ("/health", "/ready")  # a probe needs no token: they tell nothing of the work


@web.middleware
async def require_token(request: web.Request, handler) -> web.StreamResponse:
    """Only holders of the worker token get past /health (constant-time compare)."""
    token = request.app[WORKER].token
    if token is not None and not (request.method == "GET" and request.path in OPEN_PATHS):
        sent = request.headers.get("Authorization", "")
        scheme, _, value = sent.partition(" ")
        given = value.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, token.encode()):
            raise ApiError(401, "A valid worker token is required.", code="invalid_api_key")
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    state = request.app[WORKER]
    healthy = state.backend.stats().healthy
    body = {"status": "ok" if healthy else "unhealthy", "epoch": state.epoch}
    return json_response(body, status=200 if healthy else 503)


async def ready(request: web.Request) -> web.Response:
    """Readiness: 503 while the engine is unhealthy, and from the first moment of a drain."""
    state = request.app[WORKER]
    ok = state.backend.stats().healthy and not state.drain.draining
    body = {"ready": ok, "draining": state.drain.draining, "epoch": state.epoch}
    return json_response(body, status=200 if ok else 503)


async def list_models(request: web.Request) -> web.Response:
    state = request.app[WORKER]
    kvgate = {
        "backend": state.kind,
        "block_size": state.block_size,
        "prefix_events": state.prefix_events,
        "epoch": state.epoch,
        "role": state.role,
    }
    if (image_token_id := getattr(state.backend, "image_token_id", None)) is not None:
        kvgate["image_token_id"] = image_token_id  # a vision model's (remote_images.py)
    created = int(state.started_at)
    data = [model_entry(card, created) | {"kvgate": kvgate} for card in state.backend.models()]
    return json_response({"object": "list", "data": data})


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[WORKER]
    body = await parse_body(request, WorkerTokenizeRequest)
    card = state.card(body.model)
    # the images' files, decoded and checked, in their places (remote_images.py); an
    # image part without its file is refused
    images = await wire_images(state, body.images) if body.images else []
    try:
        backend, kwargs = state.backend, body.chat_template_kwargs
        rendered = placed(body.rendered(), images)
        if kwargs and supports(backend, ChatTemplateBackend):  # the template's variables
            tokens = await backend.render_chat(body.model, rendered, body.tool_dicts(), kwargs)
        else:
            tokens = await backend.render(body.model, rendered, body.tool_dicts())
    except (BadRequestError, BackendError) as e:
        raise api_error(e) from None
    return json_response(
        {"tokens": tokens, "count": len(tokens), "max_model_len": card.context_length}
    )


async def detokenize_route(request: web.Request) -> web.Response:
    state = request.app[WORKER]
    body = await parse_body(request, DetokenizeRequest)
    state.card(body.model)
    try:
        text = await state.backend.detokenize(body.model, body.tokens, body.skip_special_tokens)
    except (BadRequestError, BackendError) as e:
        raise api_error(e) from None
    return json_response({"prompt": text})


async def stats(request: web.Request) -> web.Response:
    state = request.app[WORKER]
    stats = state.backend.stats()
    stats.extra |= state.puller.stats()  # the pulls of a decode worker, beside its engine's
    return json_response(dataclasses.asdict(stats))


async def kv_events(request: web.Request) -> web.Response:
    state = request.app[WORKER]
    query = request.query
    after = _number(query, "after", int, 0, float("inf"), 0)
    wait_s = _number(query, "wait", float, 0, MAX_WAIT_S, 1.0)
    reply = await state.events.poll(query.get("epoch", ""), after, wait_s)
    return json_response(reply.to_dict())


def _number(query, name: str, kind: type, low: float, high: float, default):
    """A query parameter as `kind` in [low, high], or 400 naming it."""
    if name not in query:
        return default
    try:
        value = kind(query[name])
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ApiError(400, f"{name} must be a number in [{low:g}, {high:g}]", param=name)
    return value


def worker_body_bytes(settings: Settings) -> int:
    """The largest body a worker reads: a request's own bytes, plus room for as many
    images as the gateway takes, each its file in base64 (remote_images.py)."""
    per_image = (settings.max_image_bytes + 2) // 3 * 4 + IMAGE_RECORD_BYTES
    return settings.max_body_bytes + settings.max_images_per_request * per_image


def create_worker_app(state: WorkerState) -> web.Application:
    # a body may carry a request's images' files (gateway/backends/remote_images.py)
    body_limited = dataclasses.replace(
        state.settings, max_body_bytes=worker_body_bytes(state.settings)
    )
    app = web.Application(
        client_max_size=body_limited.max_body_bytes,
        middlewares=[openai_errors, require_token, drain_guard],
    )
    app[WORKER] = state
    if state.tracing is not None:  # outermost; off, not even a middleware
        app.middlewares.insert(0, traced_requests(lambda a: a[WORKER].tracing, UNTRACED))
    app[DRAIN] = state.drain
    app[SETTINGS] = body_limited  # parse_body's limit too
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize_route)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/kvgate/v1/generate", generate)
    app.router.add_post("/kvgate/v1/abort", abort)
    app.router.add_get("/kvgate/v1/stats", stats)
    app.router.add_get("/kvgate/v1/kv_events", kv_events)
    app.router.add_post(EXPORT_PATH, export_kv)
    adapters.add_routes(app)

    async def lifecycle(app: web.Application):
        await state.start()
        yield
        await state.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
