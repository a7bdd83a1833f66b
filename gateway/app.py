"""The aiohttp application, assembled: its middleware, every route, and the gateway's
start-up and shutdown hooked to the app's (gateway.lifecycle)."""

from __future__ import annotations

import hmac
import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.backends import Backend
from gateway.batches.start import BATCHES, start_batches
from gateway.config import Settings
from gateway.config_load import ConfigSource
from gateway.http.drain import DRAIN, Drain
from gateway.http.middleware import gateway_requests
from gateway.http.traced import traced_requests
from gateway.http.util import SETTINGS, json_response
from gateway.lifecycle import start_gateway, stop_gateway
from gateway.observe.tracing import Tracing, trace_export
from gateway.ondemand.shown import shown_stats
from gateway.routes import adapters as adapter_api
from gateway.routes import admin as admin_api
from gateway.routes import audit as audit_api
from gateway.routes import batch_lines, batches, embeddings, files, guards, openapi, responses_api
from gateway.routes import messages as messages_api
from gateway.routes import ollama as ollama_api
from gateway.routes import prefixes as prefix_api
from gateway.routes import reload as reload_api
from gateway.routes.openai import (
    chat_completions,
    completions,
    detokenize,
    list_models,
    tokenize,
)
from gateway.state import GW, INFERENCE_PATHS, GatewayState
from gateway.tenancy.auth import AuthError, bearer_token

log = logging.getLogger("kvgate")
# probes and scrapes: frequent, and noise in a trace store
UNTRACED = frozenset({"/health", "/ready", "/metrics"})


async def health(request: web.Request) -> web.Response:
    """Liveness: 200 while the process serves, with the backends that cannot serve now
    and why (one that failed to start, an upstream that does not answer)."""
    gw = request.app[GW]
    return json_response({"status": "ok", "down": gw.router.down(_configured(gw))})


def _configured(gw: GatewayState) -> list[Backend]:
    """The backends that should be up: not a models directory's, loaded on demand."""
    models = gw.models_dir
    return [b for b in gw.backends if models is None or not models.owns(b)]


async def ready(request: web.Request) -> web.Response:
    """Readiness: 503 while no backend can serve, and from the first moment of a drain
    (a load balancer stops sending here while the requests in flight finish)."""
    gw = request.app[GW]
    # a models directory's model not loaded is available (loaded by its first request)
    states = {
        b.name: shown_stats(gw, b).healthy and b.name not in gw.router.broken for b in gw.backends
    }
    serves = any(states.values()) or gw.models_dir is not None
    ok = serves and not gw.drain.draining
    body = {"ready": ok, "draining": gw.drain.draining, "backends": states}
    return json_response(body, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GW]
    if gw.settings.metrics_auth and not _is_scraper(request, gw.settings.metrics_token):
        await guards.admin(request)
    return web.Response(
        body=generate_latest(gw.metrics.registry),
        headers={"Content-Type": CONTENT_TYPE_LATEST},
    )


def _is_scraper(request: web.Request, token: str | None) -> bool:
    """A Prometheus scraper may send `metrics_token` instead of the admin key."""
    if token is None:
        return False
    try:  # the Authorization header read as every key is: printable ASCII after "Bearer"
        sent = bearer_token(request.headers.get("Authorization"))
    except AuthError:
        return False
    return hmac.compare_digest(sent.encode(), token.encode())


def create_app(settings: Settings, source: ConfigSource | None = None) -> web.Application:
    """The gateway's app; `source`, how `settings` were read, lets it reload them."""
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[gateway_requests],  # errors, control characters, the drain
    )
    app[SETTINGS] = settings
    export = trace_export(settings.otlp_traces_endpoint, "kvgate")
    if export is not None:  # outermost; off, not even a middleware
        app.middlewares.insert(0, traced_requests(lambda a: a[GW].tracing, UNTRACED))
    app[DRAIN] = drain = Drain(INFERENCE_PATHS)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    responses_api.add_routes(app)
    messages_api.add_routes(app)
    ollama_api.add_routes(app)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    embeddings.add_routes(app)
    admin_api.add_routes(app)
    audit_api.add_routes(app)
    adapter_api.add_routes(app)
    prefix_api.add_routes(app)
    reload_api.add_routes(app)
    openapi.add_routes(app)
    files.add_routes(app)
    batches.add_routes(app)

    async def lifecycle(app: web.Application):
        state = await start_gateway(settings, drain)
        state.source = source
        state.url = f"http://{settings.host}:{settings.port}"
        state.tracing = None if export is None else Tracing(export)
        app[GW] = state
        app[BATCHES] = room = start_batches(state, batch_lines.execute)
        yield
        await room.runner.stop(settings.drain_timeout_s)
        await stop_gateway(state)
        if state.tracing is not None:  # the last requests' spans go out before the exit
            await state.tracing.close()

    app.cleanup_ctx.append(lifecycle)
    return app
