"""The aiohttp application: routes, the error middleware, start-up and shutdown."""

from __future__ import annotations

import hmac
import logging
import re

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import admin_api, openapi, prefix_api
from gateway.auth import AuthError, bearer_token
from gateway.config import Settings
from gateway.db import is_outage
from gateway.errors import ApiError, error_body
from gateway.http_util import SETTINGS, json_response
from gateway.openai_api import (
    GW,
    chat_completions,
    completions,
    detokenize,
    list_models,
    tokenize,
)
from gateway.state import start_gateway, stop_gateway

log = logging.getLogger("kvgate")
DATABASE_UNAVAILABLE = ApiError(
    503,
    "The database is unavailable; the request was not served. Retry shortly.",
    code="database_unavailable",
    headers={"Retry-After": "1"},
)


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves as OpenAI-shaped JSON, aiohttp's own (404, 405, 413) included."""
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = e.text if e.text and not e.text.startswith(f"{e.status}:") else e.reason
        # keep what the exception says in headers (Allow on a 405), not its text type
        headers = {k: v for k, v in e.headers.items() if k.lower() != "content-type"}
        return json_response(error_body(e.status, message), status=e.status, headers=headers)
    except Exception as e:
        if is_outage(e):
            log.warning("database unavailable on %s %s: %s", request.method, request.path, e)
            return DATABASE_UNAVAILABLE.response()
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_response(error_body(500, "Internal server error."), status=500)


@web.middleware
async def refuse_control_characters(request: web.Request, handler) -> web.StreamResponse:
    """A path or query holding a control character (NUL above all, which PostgreSQL cannot
    store or compare) is refused before any handler sends it to the database."""
    if _CONTROL.search(request.path) or _CONTROL.search(request.query_string):
        raise ApiError(400, "The URL holds a control character.")
    return await handler(request)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


async def health(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    gw = request.app[GW]
    states = {b.name: b.stats().healthy and b.name not in gw.router.broken for b in gw.backends}
    ok = bool(states) and any(states.values())
    return json_response({"ready": ok, "backends": states}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GW]
    if gw.settings.metrics_auth and not _is_scraper(request, gw.settings.metrics_token):
        await admin_api._admin(request)
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


def create_app(settings: Settings) -> web.Application:
    app = web.Application(
        client_max_size=settings.max_body_bytes,
        middlewares=[openai_errors, refuse_control_characters],
    )
    app[SETTINGS] = settings
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    admin_api.add_routes(app)
    prefix_api.add_routes(app)
    openapi.add_routes(app)

    async def lifecycle(app: web.Application):
        state = await start_gateway(settings)
        state.url = f"http://{settings.host}:{settings.port}"
        app[GW] = state
        yield
        await stop_gateway(state)

    app.cleanup_ctx.append(lifecycle)
    return app
