"""The aiohttp application: routes, the error middleware, start-up and shutdown."""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import admin_api, prefix_api
from gateway.config import Settings
from gateway.errors import ApiError, error_body
from gateway.http_util import json_response
from gateway.openai_api import GW, chat_completions, completions, list_models
from gateway.state import start_gateway, stop_gateway

log = logging.getLogger("kvgate")


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
        return json_response(error_body(e.status, message), status=e.status)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_response(error_body(500, "Internal server error."), status=500)


async def health(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    gw = request.app[GW]
    states = {b.name: b.stats().healthy and b.name not in gw.router.broken for b in gw.backends}
    ok = bool(states) and any(states.values())
    return json_response({"ready": ok, "backends": states}, status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GW]
    if gw.settings.metrics_auth:
        await admin_api._admin(request)
    return web.Response(
        body=generate_latest(gw.metrics.registry),
        headers={"Content-Type": CONTENT_TYPE_LATEST},
    )


def create_app(settings: Settings) -> web.Application:
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[openai_errors])
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    admin_api.add_routes(app)
    prefix_api.add_routes(app)

    async def lifecycle(app: web.Application):
        state = await start_gateway(settings)
        state.url = f"http://{settings.host}:{settings.port}"
        app[GW] = state
        yield
        await stop_gateway(state)

    app.cleanup_ctx.append(lifecycle)
    return app
